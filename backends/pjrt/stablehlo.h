// The StableHLO programs of the PJRT backend, as MLIR text, and their xla.CompileOptionsProto.
// Device memory is a 1-D array of bytes (ui8) per allocation; views of it are reached by
// dynamic slices at a byte offset passed at run time (an i64 scalar), so a program depends on
// sizes, not on offsets. Typed data is a bitcast of those bytes inside the program.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/communicator.h"
#include "fsdp/dtype.h"

namespace fsdp::pjrt {

// xla.CompileOptionsProto for `device_ids.size()` replicas, one partition, replica r on global
// device device_ids[r]. Never empty (empty options make some plugins abort the process).
std::string CompileOptions(const std::vector<int64_t>& device_ids);

// xla.CompileOptionsProto of a portable single-device program: no device assignment, so one
// executable runs on any device (each launch names its device). The ops' programs compile
// once for all the ranks of a client.
std::string PortableCompileOptions();

// (src: ui8[n], offset: i64) -> ui8[k]: bytes [offset, offset + k) of src.
std::string SliceProgram(int64_t n, int64_t k);
// (dst: ui8[n] donated, src: ui8[k], offset: i64) -> ui8[n]: dst with [offset, offset + k) = src.
std::string UpdateProgram(int64_t n, int64_t k);

// Collectives over `ranks` replicas (replica r = rank r), on the bytes of `count` elements of
// `dtype` per rank (in) and the result's bytes (out):
// all_gather: ui8[count*es] -> ui8[ranks*count*es] (moves bytes, any dtype);
// reduce_scatter: ui8[count*es] -> ui8[count/ranks*es]; all_reduce: ui8[count*es] -> same.
// Reductions take f32, bf16 and f16, accumulate in f32 and round once; avg divides the f32
// sum by ranks.
std::string AllGatherProgram(int ranks, int64_t count, DType dtype);
std::string ReduceScatterProgram(int ranks, int64_t count, DType dtype, ReduceOp op);
std::string AllReduceProgram(int ranks, int64_t count, DType dtype, ReduceOp op);
// all_to_all: ui8[count*es] -> ui8[count*es] (count a multiple of ranks; chunk d of rank q's
// input lands in chunk q of rank d's output; moves bytes, any dtype).
std::string AllToAllProgram(int ranks, int64_t count, DType dtype);

// A collective program above (text), applied in place on allocations: (send: ui8[send_bytes],
// recv: ui8[recv_bytes] donated (left out when `same`: send's allocation is written), offsets:
// i64[2]) -> the recv allocation with the output's out_bytes at offsets[1], the input being
// send's in_bytes at offsets[0]. One launch instead of a slice, the collective and an update.
std::string OnAllocations(const std::string& program, int64_t in_bytes, int64_t out_bytes,
                          int64_t send_bytes, int64_t recv_bytes, bool same);

}  // namespace fsdp::pjrt
