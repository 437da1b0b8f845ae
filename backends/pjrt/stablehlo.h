// The compile options of the PJRT backend's programs (xla.CompileOptionsProto), and a small
// program as MLIR text for tests of the client. The programs themselves are built by
// pjrt::Program (program.h).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fsdp::pjrt {

// Boolean XLA debug options set for a compile (CompileOptionsProto.env_option_overrides, applied
// by the plugin on top of its defaults; a plugin without the option refuses the compile).
using XlaOverrides = std::vector<std::pair<std::string, bool>>;

// xla.CompileOptionsProto for `device_ids.size()` replicas, one partition, replica r on global
// device device_ids[r]. Never empty (empty options make some plugins abort the process).
std::string CompileOptions(const std::vector<int64_t>& device_ids,
                           const XlaOverrides& overrides = {});

// xla.CompileOptionsProto of a portable single-device program: no device assignment, so one
// executable runs on any device (each launch names its device). The ops' programs compile
// once for all the ranks of a client.
std::string PortableCompileOptions(const XlaOverrides& overrides = {});

// (src: ui8[n], offset: i64) -> ui8[k]: bytes [offset, offset + k) of src.
std::string SliceProgram(int64_t n, int64_t k);

}  // namespace fsdp::pjrt
