// fsdp::backends: registers the backends outside the core library that this build has (pjrt,
// cuda) in the registry (fsdp/registry.h) when the program starts. An object library, so that a
// program that links it gets these registrations even though nothing names them.
#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "fsdp/registry.h"
#ifdef FSDP_HAVE_PJRT_BACKEND
#include "fsdp/pjrt_backend.h"
#endif
#ifdef FSDP_HAVE_CUDA_BACKEND
#include "fsdp/cuda_backend.h"
#endif

namespace fsdp {
namespace {

#ifdef FSDP_HAVE_PJRT_BACKEND
std::string PluginPath(const BackendOptions& o) {
  const char* env = std::getenv(pjrt::kPluginEnv);
  return BackendOptionText(o, "plugin", env != nullptr ? env : "");
}

// One client per (plugin, device count) for the life of the process: every rank's backend of a
// process shares it (ranks as threads take a device each). Never destroyed, as plugins may keep
// threads that outlive static destructors.
absl::StatusOr<std::shared_ptr<pjrt::Client>> SharedClient(const BackendOptions& o) {
  static std::mutex mu;
  static auto* clients = new std::map<std::pair<std::string, int64_t>,
                                      std::shared_ptr<pjrt::Client>>();
  const std::string path = PluginPath(o);
  FSDP_ASSIGN_OR_RETURN(const int64_t devices, BackendOptionInt("pjrt", o, "devices", 0, 0));
  std::lock_guard<std::mutex> lock(mu);
  auto it = clients->find({path, devices});
  if (it != clients->end()) return it->second;
  pjrt::PjrtClientOptions c;
  c.plugin_path = path;
  // The XLA CPU plugin makes as many devices as it is asked for; an accelerator has its chips.
  if (devices > 0) c.create_options["cpu_device_count"] = devices;
  FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> client, pjrt::Client::Create(c));
  clients->emplace(std::make_pair(path, devices), client);
  return client;
}

BackendRegistration PjrtRegistration() {
  BackendRegistration r;
  r.name = "pjrt";
  r.summary = "a PJRT plugin's device per rank (XLA CPU plugin, TPU, Trainium); the ranks of a "
              "process share its client, processes meet through the host-staged bridge";
  r.keys = {{"plugin", "the plugin's path (default $FSDP_PJRT_PLUGIN)"},
            {"devices", "devices the XLA CPU plugin makes (0: its default; other plugins: 0)"},
            {"device", "the device of this rank (default: the rank modulo the client's devices, "
                       "i.e. the rank's thread under CreateMpiThreadsWorld)"},
            {"cross_process", "groups that span processes: auto (default), bridge (through host "
                              "memory and the host communicator), plugin (refused unless the "
                              "client spans the processes)"},
            {"memory_limit_bytes", "allocations past it fail as on a full device (0: none)"},
            {"max_fused_ops", "the ops issued back to back on a stream run as one program of "
                              "at most this many (default 512; 1: a program per op)"}};
  r.unavailable = [](const BackendOptions& o) -> std::string {
    const std::string path = PluginPath(o);
    if (path.empty()) {
      return absl::StrCat("no plugin: give the option plugin=PATH or set ", pjrt::kPluginEnv,
                          " (scripts/fetch_pjrt_plugin.sh fetches the XLA CPU plugin)");
    }
    if (!std::filesystem::exists(path)) return absl::StrCat("no PJRT plugin at '", path, "'");
    return "";
  };
  r.check = [](const BackendOptions& o, int ranks) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> client, SharedClient(o));
    if (client->num_devices() < ranks) {
      return absl::InvalidArgumentError(absl::StrCat(
          "backend 'pjrt': the plugin ", PluginPath(o), " has ", client->num_devices(),
          " device(s), fewer than the ", ranks, " ranks of this process"));
    }
    return absl::OkStatus();
  };
  r.device_count = [](const BackendOptions& o) -> absl::StatusOr<int> {
    FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> client, SharedClient(o));
    return client->num_devices();
  };
  r.create = [](const BackendOptions& o, int rank) -> absl::StatusOr<std::unique_ptr<Backend>> {
    FSDP_ASSIGN_OR_RETURN(std::shared_ptr<pjrt::Client> client, SharedClient(o));
    FSDP_ASSIGN_OR_RETURN(
        const int64_t device,
        BackendOptionInt("pjrt", o, "device", rank % std::max(1, client->num_devices()), 0));
    FSDP_ASSIGN_OR_RETURN(const int64_t limit,
                          BackendOptionInt("pjrt", o, "memory_limit_bytes", 0, 0));
    FSDP_ASSIGN_OR_RETURN(const int64_t fused,
                          BackendOptionInt("pjrt", o, "max_fused_ops", 512, 1));
    const std::string cross = BackendOptionText(o, "cross_process", "auto");
    PjrtBackendOptions po;
    po.memory_limit_bytes = limit;
    po.fuse_ops = fused > 1;
    po.max_fused_ops = static_cast<int>(std::min<int64_t>(fused, 1 << 20));
    if (cross == "auto") {
      po.cross_process = CrossProcess::kAuto;
    } else if (cross == "bridge") {
      po.cross_process = CrossProcess::kBridge;
    } else if (cross == "plugin") {
      po.cross_process = CrossProcess::kPlugin;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "backend 'pjrt': option cross_process=", cross, " is not one of auto, bridge, plugin"));
    }
    FSDP_ASSIGN_OR_RETURN(auto b, PjrtBackend::Create(std::move(client), static_cast<int>(device),
                                                      po));
    return std::unique_ptr<Backend>(std::move(b));
  };
  return r;
}
#endif

#ifdef FSDP_HAVE_CUDA_BACKEND
BackendRegistration CudaRegistration() {
  BackendRegistration r;
  r.name = "cuda";
  r.summary = "an NVIDIA GPU per rank: cuBLASLt GEMMs, NCCL collectives";
  r.keys = {{"device", "the GPU of this rank (default: the rank modulo the GPUs)"},
            {"memory_limit_bytes", "bytes the caching allocator may hold (0: the GPU's)"},
            {"allow_tf32", "f32 matmuls on TF32 tensor cores (default false)"},
            {"compute_stream", "a cudaStream_t of the caller's to adopt as the compute stream, "
                               "as an address (\"0x7f...\"; default: the backend's own)"}};
  r.unavailable = [](const BackendOptions&) { return CudaUnavailableReason(); };
  r.device_count = [](const BackendOptions&) -> absl::StatusOr<int> { return CudaDeviceCount(); };
  r.create = [](const BackendOptions& o, int rank) -> absl::StatusOr<std::unique_ptr<Backend>> {
    FSDP_ASSIGN_OR_RETURN(
        const int64_t device,
        BackendOptionInt("cuda", o, "device", rank % std::max(1, CudaDeviceCount()), 0));
    CudaBackendOptions c;
    c.device = static_cast<int>(device);
    FSDP_ASSIGN_OR_RETURN(c.memory_limit_bytes,
                          BackendOptionInt("cuda", o, "memory_limit_bytes", 0, 0));
    FSDP_ASSIGN_OR_RETURN(c.allow_tf32, BackendOptionBool("cuda", o, "allow_tf32", false));
    const std::string stream = BackendOptionText(o, "compute_stream", "");
    if (!stream.empty()) {
      char* end = nullptr;
      const unsigned long long address = std::strtoull(stream.c_str(), &end, 0);
      if (end == stream.c_str() || *end != '\0' || address == 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "backend cuda: option compute_stream='", stream,
            "' is not a stream's address (e.g. 0x7f3a2c000b20)"));
      }
      c.compute_stream = reinterpret_cast<void*>(static_cast<uintptr_t>(address));
    }
    FSDP_ASSIGN_OR_RETURN(auto b, CudaBackend::Create(c));
    return std::unique_ptr<Backend>(std::move(b));
  };
  return r;
}
#endif

// Runs before main. A failure (a name taken twice) would be a build error of this file's.
[[maybe_unused]] const bool registered = [] {
#ifdef FSDP_HAVE_PJRT_BACKEND
  if (!RegisterBackend(PjrtRegistration()).ok()) std::abort();
#endif
#ifdef FSDP_HAVE_CUDA_BACKEND
  if (!RegisterBackend(CudaRegistration()).ok()) std::abort();
#endif
  return true;
}();

}  // namespace
}  // namespace fsdp
