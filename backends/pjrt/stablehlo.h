// The compile options of the PJRT backend's programs (xla.CompileOptionsProto), and a small
// program as MLIR text for tests of the client. The programs themselves are built by
// pjrt::Program (program.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

}  // namespace fsdp::pjrt
