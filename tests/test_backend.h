// The backend the parameterised suites run on: $FSDP_TEST_BACKEND ("cpu", the default, or
// "sim", the strict simulated accelerator). CTest registers the suites once per backend
// (tests/CMakeLists.txt), so a backend that passes them keeps the device contract.
#pragma once

#include <cstdlib>
#include <memory>
#include <string>

#include "fsdp/cpu_backend.h"
#include "fsdp/sim_backend.h"

namespace fsdp::testing {

inline std::string TestBackendName() {
  const char* v = std::getenv("FSDP_TEST_BACKEND");
  return v == nullptr || *v == '\0' ? "cpu" : v;
}

// A backend of the test's kind for one rank, its kernels on `threads` threads (bound to the
// calling thread on the CPU; a sim device's compute stream uses them).
inline absl::StatusOr<std::unique_ptr<Backend>> MakeTestBackend(
    int threads, int64_t memory_limit = 0, const std::string& name = TestBackendName()) {
  if (name == "sim") {
    SimBackendOptions options;
    options.num_threads = threads;
    options.memory_limit_bytes = memory_limit;
    // Every collective lands a while after the compute stream could have run on: work that
    // reads its result without waiting for its event reads stale memory, and the suites fail.
    options.data_plane.link_latency = absl::Microseconds(300);
    FSDP_ASSIGN_OR_RETURN(auto b, SimBackend::Create(options));
    return std::unique_ptr<Backend>(std::move(b));
  }
  if (name != "cpu") {
    return absl::InvalidArgumentError("FSDP_TEST_BACKEND must be cpu or sim, got '" + name + "'");
  }
  FSDP_ASSIGN_OR_RETURN(auto b, CpuBackend::Create({.num_threads = threads,
                                                    .memory_limit_bytes = memory_limit}));
  b->BindCurrentThread();
  return std::unique_ptr<Backend>(std::move(b));
}

// The bytes of a device view, on the host.
template <typename T = float>
inline absl::StatusOr<std::vector<T>> ToHost(Backend* backend, View v) {
  std::vector<T> out(static_cast<size_t>(v.bytes()) / sizeof(T));
  FSDP_RETURN_IF_ERROR(backend->CopyToHost(out.data(), v));
  return out;
}

}  // namespace fsdp::testing
