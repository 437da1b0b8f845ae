// The op table of the PJRT backend: each op is a builder of StableHLO (program.h) over its
// views and sizes, handed to the backend, which runs it into a program of its own or into one
// program with the ops issued after it on the same stream (PjrtBackendOptions::fuse_ops),
// compiled once per structure by the client's cache and launched in stream order.
#pragma once

#include <functional>
#include <memory>

#include "backends/pjrt/program.h"
#include "fsdp/ops.h"

namespace fsdp::pjrt {

// An op: `build` adds its nodes to a program. It holds copies of the op's arguments and may
// be run more than once (a dry run for the program's key, then a full one to compile it).
struct OpBuilder {
  const char* name;  // a literal
  std::function<void(Program*)> build;
};

// Queues an op on a stream of the backend.
using LaunchFn = std::function<void(Stream, OpBuilder)>;

std::unique_ptr<Ops> MakeOps(LaunchFn launch);

}  // namespace fsdp::pjrt
