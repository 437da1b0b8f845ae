// The backend the parameterised suites run on: $FSDP_TEST_BACKEND ("cpu", the default, "sim",
// the strict simulated accelerator, "pjrt", the PJRT backend on the XLA CPU plugin, or "cuda",
// every rank on CUDA device 0). CTest
// registers the suites once per backend (tests/CMakeLists.txt), so a backend that passes them
// keeps the device contract.
#pragma once

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>

#include "fsdp/cpu_backend.h"
#include "fsdp/registry.h"
#include "fsdp/sim_backend.h"
#ifdef FSDP_TEST_PJRT
#include "fsdp/pjrt_backend.h"
#endif
#ifdef FSDP_TEST_CUDA
#include "fsdp/cuda_backend.h"
#endif

namespace fsdp::testing {

inline std::string TestBackendName() {
  const char* v = std::getenv("FSDP_TEST_BACKEND");
  return v == nullptr || *v == '\0' ? "cpu" : v;
}

// Devices of the process's PJRT client: ranks as threads take one each.
inline constexpr int kPjrtTestDevices = 8;

// The plugin the PJRT suites load: $FSDP_PJRT_PLUGIN, else the one the build fetched.
inline std::string PjrtTestPlugin() {
  const char* v = std::getenv("FSDP_PJRT_PLUGIN");
  if (v != nullptr && *v != '\0') return v;
#ifdef FSDP_TEST_PJRT_PLUGIN
  return FSDP_TEST_PJRT_PLUGIN;
#else
  return "";
#endif
}

// Why the pjrt backend cannot run in this build ("" when it can), for the skip messages.
inline std::string PjrtUnavailable() {
#ifndef FSDP_TEST_PJRT
  return "skipped: the PJRT backend is not built (FSDP_WITH_PJRT is off or the PJRT header was "
         "not fetched: scripts/fetch_pjrt_plugin.sh <build>/pjrt)";
#else
  const std::string path = PjrtTestPlugin();
  if (path.empty() || !std::filesystem::exists(path)) {
    return "skipped: no PJRT plugin at '" + path +
           "' (scripts/fetch_pjrt_plugin.sh <build>/pjrt fetches it, or set FSDP_PJRT_PLUGIN)";
  }
  return "";
#endif
}

// Why the cuda backend cannot run here ("" when it can), for the skip messages.
inline std::string CudaUnavailable() {
#ifndef FSDP_TEST_CUDA
  return "skipped: the CUDA backend is not built (no CUDA toolkit with NCCL, FSDP_WITH_CUDA off, "
         "or a sanitizer build)";
#else
  const std::string why = CudaUnavailableReason();
  return why.empty() ? "" : "skipped: " + why;
#endif
}

// A backend of the test's kind for one rank, from the registry (fsdp/registry.h), its kernels on
// `threads` threads (bound to the calling thread on the CPU; a sim device's compute stream uses
// them). On pjrt, every rank gets a device of the process's client of kPjrtTestDevices devices:
// `device`, or (< 0) the calling thread's, taken in turn by the threads that ask, so the ranks of
// a test, each a new thread, get distinct ones. On cuda every rank takes `device` (default 0).
inline absl::StatusOr<std::unique_ptr<Backend>> MakeTestBackend(
    int threads, int64_t memory_limit = 0, const std::string& name = TestBackendName(),
    int device = -1) {
  BackendOptions o;
  if (memory_limit != 0) o["memory_limit_bytes"] = std::to_string(memory_limit);
  if (name == "cpu" || name == "sim") o["threads"] = std::to_string(threads);
  if (name == "sim") {
    // Every collective lands a while after the compute stream could have run on: work that
    // reads its result without waiting for its event reads stale memory, and the suites fail.
    o["link_latency_us"] = "300";
  }
  if (name == "pjrt") {
    const std::string why = PjrtUnavailable();
    if (!why.empty()) return absl::FailedPreconditionError(why);
    if (device < 0) {
      static std::atomic<int> next{0};
      thread_local const int mine = next.fetch_add(1) % kPjrtTestDevices;
      device = mine;
    }
    o["plugin"] = PjrtTestPlugin();
    o["devices"] = std::to_string(kPjrtTestDevices);
    o["device"] = std::to_string(device);
  }
  if (name == "cuda") {
    const std::string why = CudaUnavailable();
    if (!why.empty()) return absl::FailedPreconditionError(why);
    o["device"] = std::to_string(device < 0 ? 0 : device);
  }
  if (name != "cpu" && name != "sim" && name != "pjrt" && name != "cuda") {
    return absl::InvalidArgumentError("FSDP_TEST_BACKEND must be cpu, sim, pjrt or cuda, got '" +
                                      name + "'; this program has: " + BackendNames());
  }
  return CreateBackend(name, o);
}

// The bytes of a device view, on the host.
template <typename T = float>
inline absl::StatusOr<std::vector<T>> ToHost(Backend* backend, View v) {
  std::vector<T> out(static_cast<size_t>(v.bytes()) / sizeof(T));
  FSDP_RETURN_IF_ERROR(backend->CopyToHost(out.data(), v));
  return out;
}

}  // namespace fsdp::testing
