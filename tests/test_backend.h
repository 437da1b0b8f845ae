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
#include "fsdp/sim_backend.h"
#ifdef FSDP_TEST_PJRT
#include "backends/pjrt/pjrt_backend.h"
#endif
#ifdef FSDP_TEST_CUDA
#include "backends/cuda/cuda_backend.h"
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

#ifdef FSDP_TEST_PJRT
// One client per process, kPjrtTestDevices CPU devices, shared by every rank's backend.
inline absl::StatusOr<std::shared_ptr<pjrt::Client>> PjrtTestClient() {
  static std::mutex mu;
  static std::shared_ptr<pjrt::Client>* client = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (client == nullptr) {
    pjrt::PjrtClientOptions o;
    o.plugin_path = PjrtTestPlugin();
    o.create_options["cpu_device_count"] = int64_t{kPjrtTestDevices};
    FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> c, pjrt::Client::Create(o));
    client = new std::shared_ptr<pjrt::Client>(std::move(c));
  }
  return *client;
}
#endif

// A backend of the test's kind for one rank, its kernels on `threads` threads (bound to the
// calling thread on the CPU; a sim device's compute stream uses them). On pjrt, every rank
// gets a device of the process's client: `device`, or (< 0) the calling thread's, taken in
// turn by the threads that ask, so the ranks of a test, each a new thread, get distinct ones.
inline absl::StatusOr<std::unique_ptr<Backend>> MakeTestBackend(
    int threads, int64_t memory_limit = 0, const std::string& name = TestBackendName(),
    int device = -1) {
  if (name == "pjrt") {
#ifdef FSDP_TEST_PJRT
    if (device < 0) {
      static std::atomic<int> next{0};
      thread_local const int mine = next.fetch_add(1) % kPjrtTestDevices;
      device = mine;
    }
    FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> client, PjrtTestClient());
    FSDP_ASSIGN_OR_RETURN(auto b, PjrtBackend::Create(std::move(client), device,
                                                      {.memory_limit_bytes = memory_limit}));
    return std::unique_ptr<Backend>(std::move(b));
#else
    return absl::FailedPreconditionError(PjrtUnavailable());
#endif
  }
  if (name == "cuda") {
#ifdef FSDP_TEST_CUDA
    FSDP_ASSIGN_OR_RETURN(auto b, CudaBackend::Create({.device = device < 0 ? 0 : device,
                                                       .memory_limit_bytes = memory_limit}));
    return std::unique_ptr<Backend>(std::move(b));
#else
    return absl::FailedPreconditionError(CudaUnavailable());
#endif
  }
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
    return absl::InvalidArgumentError("FSDP_TEST_BACKEND must be cpu, sim, pjrt or cuda, got '" + name +
                                      "'");
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
