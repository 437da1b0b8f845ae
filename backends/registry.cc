// The backend registry (fsdp/registry.h): a process-wide table of factories by name. The core
// library's backends (cpu, sim) are entered when the table is first used; pjrt and cuda are
// entered by fsdp::backends (backends/linked_backends.cc) when a program links it.
#include "fsdp/registry.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/sim_backend.h"

namespace fsdp {
namespace {

// Known backends that live outside the core library, and what puts them into a program.
constexpr std::pair<std::string_view, std::string_view> kLinkedElsewhere[] = {
    {"pjrt", "this program does not have the PJRT backend: it is built when pjrt_c_api.h is in "
             "FSDP_PJRT_DIR/include (scripts/fetch_pjrt_plugin.sh <build>/pjrt) and a program "
             "gets it by linking fsdp::backends"},
    {"cuda", "this program does not have the CUDA backend: it is built with the CUDA toolkit and "
             "NCCL, FSDP_WITH_CUDA=ON and no sanitizer, and a program gets it by linking "
             "fsdp::backends"},
};

absl::Status CheckKeys(const BackendRegistration& r, const BackendOptions& options) {
  for (const auto& [key, value] : options) {
    if (r.keys.count(key) != 0) continue;
    std::vector<std::string> known;
    for (const auto& [k, help] : r.keys) known.push_back(k);
    return absl::InvalidArgumentError(absl::StrCat(
        "backend ", r.name, ": unknown option '", std::string(key), "'; it takes ",
        known.empty() ? std::string("no options") : absl::StrJoin(known, ", ")));
  }
  return absl::OkStatus();
}

BackendRegistration CpuRegistration() {
  BackendRegistration r;
  r.name = "cpu";
  r.summary = "the reference: host memory, oneDNN and AVX kernels, collectives on the host";
  r.keys = {{"threads", "OpenMP threads of the rank's kernels (0: the cores / ranks_sharing_cores)"},
            {"ranks_sharing_cores", "ranks on this host (default 1)"},
            {"memory_limit_bytes", "allocations past it fail as on a full device (0: none)"}};
  r.create = [](const BackendOptions& o, int) -> absl::StatusOr<std::unique_ptr<Backend>> {
    FSDP_ASSIGN_OR_RETURN(const int64_t threads, BackendOptionInt("cpu", o, "threads", 0, 0));
    FSDP_ASSIGN_OR_RETURN(const int64_t sharing,
                          BackendOptionInt("cpu", o, "ranks_sharing_cores", 1, 1));
    FSDP_ASSIGN_OR_RETURN(const int64_t limit,
                          BackendOptionInt("cpu", o, "memory_limit_bytes", 0, 0));
    FSDP_ASSIGN_OR_RETURN(auto b, CpuBackend::Create({.num_threads = static_cast<int>(threads),
                                                      .ranks_sharing_cores = static_cast<int>(sharing),
                                                      .memory_limit_bytes = limit}));
    b->BindCurrentThread();
    return std::unique_ptr<Backend>(std::move(b));
  };
  return r;
}

BackendRegistration SimRegistration() {
  BackendRegistration r;
  r.name = "sim";
  r.summary = "a strict simulated accelerator: asynchronous streams, guarded device memory";
  r.threads_only = true;
  r.keys = {{"threads", "OpenMP threads of the compute stream (0: the cores / ranks_sharing_cores)"},
            {"ranks_sharing_cores", "ranks on this host (default 1)"},
            {"memory_limit_bytes", "the device's memory (0: what the system gives)"},
            {"link_latency_us", "the data plane's simulated latency per transfer (default 0)"},
            {"link_bytes_per_second", "the data plane's simulated bandwidth (0: unlimited)"},
            {"op_latency_us", "the least time every op and copy takes (default 0)"},
            {"host_bytes_per_second",
             "the simulated link between host and device, e.g. 2.5e10 for PCIe 4 x16 (0: "
             "unlimited)"}};
  r.create = [](const BackendOptions& o, int) -> absl::StatusOr<std::unique_ptr<Backend>> {
    FSDP_ASSIGN_OR_RETURN(const int64_t threads, BackendOptionInt("sim", o, "threads", 0, 0));
    FSDP_ASSIGN_OR_RETURN(const int64_t sharing,
                          BackendOptionInt("sim", o, "ranks_sharing_cores", 1, 1));
    SimBackendOptions s;
    s.num_threads = ThreadsPerRank(static_cast<int>(threads), static_cast<int>(sharing));
    FSDP_ASSIGN_OR_RETURN(s.memory_limit_bytes,
                          BackendOptionInt("sim", o, "memory_limit_bytes", 0, 0));
    FSDP_ASSIGN_OR_RETURN(const double link, BackendOptionDouble("sim", o, "link_latency_us", 0, 0));
    FSDP_ASSIGN_OR_RETURN(const double op, BackendOptionDouble("sim", o, "op_latency_us", 0, 0));
    FSDP_ASSIGN_OR_RETURN(s.data_plane.link_bytes_per_second,
                          BackendOptionDouble("sim", o, "link_bytes_per_second", 0, 0));
    FSDP_ASSIGN_OR_RETURN(s.host_copy_bytes_per_second,
                          BackendOptionDouble("sim", o, "host_bytes_per_second", 0, 0));
    s.data_plane.link_latency = absl::Microseconds(link);
    s.op_latency = absl::Microseconds(op);
    FSDP_ASSIGN_OR_RETURN(auto b, SimBackend::Create(s));
    return std::unique_ptr<Backend>(std::move(b));
  };
  return r;
}

class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry();  // never destroyed: factories may run at exit
    return *r;
  }

  absl::Status Add(BackendRegistration r) {
    if (r.name.empty()) return absl::InvalidArgumentError("RegisterBackend: empty name");
    if (!r.create) {
      return absl::InvalidArgumentError(absl::StrCat("RegisterBackend(", r.name, "): no factory"));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (const BackendRegistration& e : entries_) {
      if (e.name == r.name) {
        return absl::AlreadyExistsError(
            absl::StrCat("RegisterBackend: a backend named '", r.name, "' is registered"));
      }
    }
    entries_.push_back(std::move(r));
    return absl::OkStatus();
  }

  // A copy of the entry (factories run outside the lock), or nullopt.
  std::optional<BackendRegistration> Find(std::string_view name) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const BackendRegistration& e : entries_) {
      if (e.name == name) return e;
    }
    return std::nullopt;
  }

  std::vector<BackendRegistration> All() const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_;
  }

 private:
  Registry() {
    entries_.push_back(CpuRegistration());
    entries_.push_back(SimRegistration());
  }

  mutable std::mutex mu_;
  std::vector<BackendRegistration> entries_;
};

// Why `name` cannot be made in this program, or "" when it is registered.
std::string NotHere(std::string_view name) {
  if (Registry::Get().Find(name)) return "";
  for (const auto& [known, why] : kLinkedElsewhere) {
    if (known == name) return std::string(why);
  }
  return absl::StrCat("no backend named '", std::string(name), "'");
}

absl::Status Unknown(std::string_view name) {
  const bool known = std::any_of(std::begin(kLinkedElsewhere), std::end(kLinkedElsewhere),
                                 [&](const auto& k) { return k.first == name; });
  return absl::Status(
      known ? absl::StatusCode::kFailedPrecondition : absl::StatusCode::kInvalidArgument,
      absl::StrCat("backend '", std::string(name), "': ", NotHere(std::string(name)), "; this program has: ",
                   BackendNames()));
}

// The registration of `name` when it exists, takes every key of `options` and can run here.
absl::StatusOr<BackendRegistration> Usable(std::string_view name, const BackendOptions& options) {
  std::optional<BackendRegistration> r = Registry::Get().Find(name);
  if (!r) return Unknown(name);
  FSDP_RETURN_IF_ERROR(CheckKeys(*r, options));
  const std::string why = r->unavailable ? r->unavailable(options) : std::string();
  if (!why.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("backend '", std::string(name), "': ", why));
  }
  return *std::move(r);
}

}  // namespace

absl::Status RegisterBackend(BackendRegistration registration) {
  return Registry::Get().Add(std::move(registration));
}

std::vector<BackendInfo> ListBackends(const BackendOptions& options) {
  std::vector<BackendInfo> out;
  for (const BackendRegistration& r : Registry::Get().All()) {
    BackendInfo i{r.name, r.summary, r.keys, r.threads_only, ""};
    if (r.unavailable) i.unavailable = r.unavailable(options);
    out.push_back(std::move(i));
  }
  for (const auto& [known, why] : kLinkedElsewhere) {
    const bool listed = std::any_of(out.begin(), out.end(),
                                    [&](const BackendInfo& i) { return i.name == known; });
    if (!listed) out.push_back({std::string(known), "", {}, false, std::string(why)});
  }
  return out;
}

std::string BackendNames() {
  std::vector<std::string> names;
  for (const BackendInfo& i : ListBackends()) {
    names.push_back(i.unavailable.empty() ? i.name : absl::StrCat(i.name, " (unavailable)"));
  }
  return absl::StrJoin(names, ", ");
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                       const BackendOptions& options, int rank) {
  FSDP_ASSIGN_OR_RETURN(const BackendRegistration r, Usable(name, options));
  return r.create(options, rank);
}

absl::Status CheckBackend(std::string_view name, const BackendOptions& options, int ranks,
                          bool threads) {
  FSDP_ASSIGN_OR_RETURN(const BackendRegistration r, Usable(name, options));
  if (r.threads_only && !threads) {
    return absl::InvalidArgumentError(
        absl::StrCat("backend '", std::string(name),
                     "' connects ranks as threads of one process, not as processes (mpirun)"));
  }
  if (r.check) return r.check(options, ranks);
  return absl::OkStatus();
}

absl::StatusOr<int> BackendDeviceCount(std::string_view name, const BackendOptions& options) {
  FSDP_ASSIGN_OR_RETURN(const BackendRegistration r, Usable(name, options));
  if (!r.device_count) return -1;
  return r.device_count(options);
}

namespace {

// Option `key` as a number of type T (from_chars, the whole text, finite), at least `min`.
template <typename T>
absl::StatusOr<T> BackendOptionNumber(std::string_view backend, const BackendOptions& options,
                                      std::string_view key, T fallback, T min, const char* kind) {
  const auto it = options.find(key);
  if (it == options.end()) return fallback;
  const std::string& v = it->second;
  const std::string where =
      absl::StrCat("backend ", std::string(backend), ": option ", std::string(key), "=");
  T x = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
  if (ec != std::errc() || end != v.data() + v.size() || v.empty() ||
      !std::isfinite(static_cast<double>(x))) {
    return absl::InvalidArgumentError(absl::StrCat(where, "'", v, "' is not ", kind));
  }
  if (x < min) return absl::InvalidArgumentError(absl::StrCat(where, v, " is below ", min));
  return x;
}

}  // namespace

absl::StatusOr<int64_t> BackendOptionInt(std::string_view backend, const BackendOptions& options,
                                         std::string_view key, int64_t fallback, int64_t min) {
  return BackendOptionNumber<int64_t>(backend, options, key, fallback, min, "an integer");
}

absl::StatusOr<double> BackendOptionDouble(std::string_view backend, const BackendOptions& options,
                                           std::string_view key, double fallback, double min) {
  return BackendOptionNumber<double>(backend, options, key, fallback, min, "a finite number");
}

absl::StatusOr<bool> BackendOptionBool(std::string_view backend, const BackendOptions& options,
                                       std::string_view key, bool fallback) {
  const auto it = options.find(key);
  if (it == options.end()) return fallback;
  if (it->second == "true" || it->second == "1") return true;
  if (it->second == "false" || it->second == "0") return false;
  return absl::InvalidArgumentError(absl::StrCat("backend ", std::string(backend), ": option ", std::string(key), "='",
                                                 it->second, "' is not true, false, 1 or 0"));
}

std::string BackendOptionText(const BackendOptions& options, std::string_view key,
                              std::string fallback) {
  const auto it = options.find(key);
  return it == options.end() ? std::move(fallback) : it->second;
}

}  // namespace fsdp
