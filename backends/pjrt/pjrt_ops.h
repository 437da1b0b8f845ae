// The op table of the PJRT backend: each op is one StableHLO program (program.h) built from its
// views and sizes, compiled once per shape by the client's cache, and launched in stream
// order by the backend.
#pragma once

#include <functional>
#include <memory>

#include "backends/pjrt/program.h"
#include "fsdp/ops.h"

namespace fsdp::pjrt {

// Queues a program on a stream of the backend.
using LaunchFn = std::function<void(Stream, std::shared_ptr<Program>)>;

std::unique_ptr<Ops> MakeOps(LaunchFn launch);

}  // namespace fsdp::pjrt
