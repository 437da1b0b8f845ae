// Backends by name. Every backend registers a factory under its name (`cpu`, `sim`, `pjrt`,
// `cuda`, or a framework's own); a program asks for one by name with options as key/value text,
// as a command line or a C caller has them:
//
//   absl::StatusOr<std::unique_ptr<fsdp::Backend>> b =
//       fsdp::CreateBackend("sim", {{"threads", "2"}, {"memory_limit_bytes", "1073741824"}},
//                           world.rank());
//
// `cpu` and `sim` are in the core library and always registered. `pjrt` and `cuda` are
// registered by the target fsdp::backends (a program links it to get every backend the build
// has); without it, or when the build left one out, they are listed with the reason. An unknown
// name, a backend this program does not have, an option key the backend does not take and a bad
// value are InvalidArgument / FailedPrecondition errors that list what is available and why the
// one asked for is not.
//
// Thread-safety: every function may be called from any thread. A factory runs on the calling
// thread, which should be the thread that runs the rank's hooks (the CPU backend binds its kernel
// threads to it).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/status.h"

namespace fsdp {

// Key/value options of one backend. Keys a backend does not take are an error naming the keys it
// takes. Common keys: "threads" (kernel threads of a host-computing backend; 0 = the host's
// cores divided by "ranks_sharing_cores"), "ranks_sharing_cores", "memory_limit_bytes" (0 = what
// the device gives), "device" (the device ordinal; default the rank modulo the devices).
using BackendOptions = std::map<std::string, std::string, std::less<>>;

// Makes the backend of `rank` (the rank in its world of the calling thread or process).
using BackendFactory =
    std::function<absl::StatusOr<std::unique_ptr<Backend>>(const BackendOptions& options, int rank)>;

struct BackendRegistration {
  std::string name;     // lower case, unique
  std::string summary;  // one line: what it runs on
  // The option keys it takes, each with a one-line help text.
  std::map<std::string, std::string> keys;
  // True when its ranks must be threads of one process (its data plane connects threads only).
  bool threads_only = false;
  // "" when it can run here, else why not (no device, plugin missing). May be empty.
  std::function<std::string(const BackendOptions& options)> unavailable;
  // Checks, before ranks start, that `ranks` ranks of this process can each have one (e.g. a
  // PJRT plugin with fewer devices). May be empty.
  std::function<absl::Status(const BackendOptions& options, int ranks)> check;
  // The devices this process sees (a PJRT plugin's, the GPUs). Empty: the backend has no fixed
  // number (cpu, sim: any number of ranks share the host).
  std::function<absl::StatusOr<int>(const BackendOptions& options)> device_count;
  BackendFactory create;
};

// Adds a backend. AlreadyExists when the name is taken, InvalidArgument when it is empty or has
// no factory.
absl::Status RegisterBackend(BackendRegistration registration);

// A backend of this build as ListBackends reports it.
struct BackendInfo {
  std::string name;
  std::string summary;
  std::map<std::string, std::string> keys;
  bool threads_only = false;
  // "" when it can run here; else why not: not built into this program (and what builds it),
  // plugin missing, no device.
  std::string unavailable;
};

// Every registered backend, and the known ones this program lacks, by name.
std::vector<BackendInfo> ListBackends(const BackendOptions& options = {});

// "cpu, sim, pjrt, cuda": the names ListBackends gives, for messages.
std::string BackendNames();

// The backend `name` for `rank`, made by its factory with `options`.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(std::string_view name,
                                                       const BackendOptions& options = {},
                                                       int rank = 0);

// The devices backend `name` has in this process with `options`, or -1 when it has no fixed
// number (cpu, sim). The errors of CheckBackend for a backend that cannot run here.
absl::StatusOr<int> BackendDeviceCount(std::string_view name, const BackendOptions& options = {});

// Before any rank starts: OK when backend `name` exists in this program, takes every key of
// `options`, can run here, and can give `ranks` ranks of this process one each (`threads`: ranks
// are threads of this process; false: processes, e.g. under mpirun). The error says which of
// these failed.
absl::Status CheckBackend(std::string_view name, const BackendOptions& options, int ranks,
                          bool threads);

// Option values, parsed strictly for the factories: InvalidArgument "backend <b>: option <key>:
// ..." on a malformed or out-of-range value; `fallback` when the key is absent.
absl::StatusOr<int64_t> BackendOptionInt(std::string_view backend, const BackendOptions& options,
                                         std::string_view key, int64_t fallback, int64_t min);
absl::StatusOr<double> BackendOptionDouble(std::string_view backend, const BackendOptions& options,
                                           std::string_view key, double fallback, double min);
absl::StatusOr<bool> BackendOptionBool(std::string_view backend, const BackendOptions& options,
                                       std::string_view key, bool fallback);
std::string BackendOptionText(const BackendOptions& options, std::string_view key,
                              std::string fallback);

}  // namespace fsdp
