// A PJRT plugin loaded at run time and a client on it: the thin C++ layer over the PJRT C API
// (pjrt_c_api.h) that the PJRT backend is built on. The plugin is dlopen'ed from a path given
// at run time (never linked); its errors become absl::Status with the plugin's code and
// message. The client owns the devices, compiles StableHLO programs once per (program text,
// compile options) and keeps them in a cache, moves host bytes in and out, and launches
// programs on one device.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "fsdp/communicator.h"
#include "fsdp/status.h"

// The C API's handles (pjrt_c_api.h, included by the implementation only).
struct PJRT_Api;
struct PJRT_Error;
struct PJRT_Client;
struct PJRT_Device;
struct PJRT_Buffer;
struct PJRT_LoadedExecutable;
struct PJRT_Event;

namespace fsdp::pjrt {

// The environment variable naming the plugin when PjrtClientOptions::plugin_path is empty.
inline constexpr char kPluginEnv[] = "FSDP_PJRT_PLUGIN";

// A loaded plugin: the PJRT_Api table, checked and initialised. Plugins are never unloaded:
// Load() returns the same object for the same path.
class Plugin {
 public:
  // dlopen(RTLD_NOW | RTLD_LOCAL), GetPjrtApi, version and table-size checks,
  // PJRT_Plugin_Initialize. Errors name the path and what to do.
  static absl::StatusOr<const Plugin*> Load(const std::string& path);
  const PJRT_Api* api() const { return api_; }
  const std::string& path() const { return path_; }
  int major_version() const;
  int minor_version() const;

  // Turns a PJRT error (owned; destroyed here) into a Status "what: message" with its code.
  absl::Status ToStatus(PJRT_Error* error, absl::string_view what) const;

 private:
  Plugin(std::string path, const PJRT_Api* api) : path_(std::move(path)), api_(api) {}
  std::string path_;
  const PJRT_Api* api_;
};

// A key-value store shared by the processes of a job, handed to a plugin when its client is
// created (PJRT_Client_Create's kv_get, kv_try_get and kv_put callbacks): plugins whose clients
// span processes (XLA's CUDA plugin; libtpu) exchange their topology and communicator ids
// through it. Thread-safe: plugins call it from threads of their own.
class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Sets `key` (a key is set once; setting it again to another value is AlreadyExists).
  virtual absl::Status Put(const std::string& key, const std::string& value) = 0;
  // The value of `key`, waiting for it at most `timeout`: DeadlineExceeded naming the key.
  virtual absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) = 0;
  // The value of `key` now, or NotFound.
  virtual absl::StatusOr<std::string> TryGet(const std::string& key) = 0;
};

// A store over the job's control plane: `comm` has one rank per process (the mpi world, or any
// communicator). Every process holds every key: a thread exchanges the puts made since its last
// round with the other processes (all-gather rounds, back to back while puts flow, at most
// 10 ms apart when idle) until the store is destroyed, which is collective: every process destroys its store, and the destructor returns
// once all have (within the communicator's deadline). A failure of the communicator fails the
// store: later calls return it.
absl::StatusOr<std::shared_ptr<KeyValueStore>> CreateCommKeyValueStore(
    std::unique_ptr<Communicator> comm);

// A client creation option of the plugin (PJRT_NamedValue): int64, string or bool.
using OptionValue = std::variant<int64_t, std::string, bool>;

struct PjrtClientOptions {
  // The plugin's path; empty: $FSDP_PJRT_PLUGIN.
  std::string plugin_path;
  // Plugin-specific create options, e.g. {"cpu_device_count", int64_t{4}} for the XLA CPU
  // plugin (which makes 4 devices when it is not given).
  std::map<std::string, OptionValue> create_options;
  // A client that spans processes: this process's index and the number of processes. With
  // num_nodes > 0 they are passed as the create options "node_id" and "num_nodes" (what XLA's
  // CUDA plugin and JAX's convention for plugins read); 0 passes neither (plugins that reject
  // names they do not know, such as newer CPU plugins, and libtpu, which reads its topology
  // from its environment). num_nodes > 1 needs kv_store.
  int node_id = 0;
  int num_nodes = 0;
  // Handed to the plugin's client creation when set (any num_nodes).
  std::shared_ptr<KeyValueStore> kv_store;
};

class Client;

// A compiled program, cached by the client.
struct Executable {
  PJRT_LoadedExecutable* exe = nullptr;
  std::string name;
  size_t num_outputs = 0;
  // Temporary device memory one run of it takes beyond its arguments and outputs (the
  // plugin's compiled memory stats; -1 where the plugin does not give them).
  int64_t temp_bytes = -1;
};

// An owned PJRT_Buffer handle.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const Client* client, PJRT_Buffer* b) : client_(client), buf_(b) {}
  DeviceBuffer(DeviceBuffer&& o) noexcept : client_(o.client_), buf_(o.release()) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }
  void reset();
  PJRT_Buffer* get() const { return buf_; }
  PJRT_Buffer* release() {
    PJRT_Buffer* b = buf_;
    buf_ = nullptr;
    return b;
  }
  explicit operator bool() const { return buf_ != nullptr; }

 private:
  const Client* client_ = nullptr;
  PJRT_Buffer* buf_ = nullptr;
};

// An owned PJRT_Event: a launch's completion. Await() waits for it once and returns its status.
class DeviceEvent {
 public:
  DeviceEvent() = default;
  DeviceEvent(const Client* client, PJRT_Event* e, std::string what)
      : client_(client), event_(e), what_(std::move(what)) {}
  DeviceEvent(DeviceEvent&& o) noexcept
      : client_(o.client_), event_(std::exchange(o.event_, nullptr)), what_(std::move(o.what_)) {}
  DeviceEvent& operator=(DeviceEvent&& o) noexcept;
  DeviceEvent(const DeviceEvent&) = delete;
  DeviceEvent& operator=(const DeviceEvent&) = delete;
  ~DeviceEvent();  // awaits a pending event before destroying it
  absl::Status Await();

 private:
  const Client* client_ = nullptr;
  PJRT_Event* event_ = nullptr;
  std::string what_;
};

class Client {
 public:
  static absl::StatusOr<std::shared_ptr<Client>> Create(PjrtClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const Plugin& plugin() const { return *plugin_; }
  const PJRT_Api* api() const { return plugin_->api(); }
  absl::Status ToStatus(PJRT_Error* e, absl::string_view what) const {
    return plugin_->ToStatus(e, what);
  }
  const std::string& platform_name() const { return platform_; }
  // The addressable devices, in the plugin's order, and their global ids.
  int num_devices() const { return static_cast<int>(devices_.size()); }
  // Every device of the client, in all its processes (PJRT_Client_Devices): more than
  // num_devices() when the client spans processes.
  int global_device_count() const { return global_devices_; }
  PJRT_Device* device(int i) const { return devices_[i]; }
  int64_t device_id(int i) const { return device_ids_[i]; }
  const std::string& device_description(int i) const { return device_strings_[i]; }

  // Compiles StableHLO MLIR text with a serialized xla.CompileOptionsProto (never empty: see
  // stablehlo.h), or returns the cached executable of the same text and options.
  absl::StatusOr<const Executable*> Compile(const std::string& name, const std::string& mlir,
                                            const std::string& compile_options);
  // The executable of the program whose structure is `key` (pjrt::Program::Key, built without
  // text): compiled from text() the first time the key is seen (through Compile's cache),
  // found by the key alone after that. With the environment variable FSDP_PJRT_CHECK_KEYS=1
  // every call also builds the text and fails (INTERNAL) where it differs from the text
  // compiled under the key: a key that misses part of a program's structure.
  absl::StatusOr<const Executable*> CompileKeyed(const std::string& key, const std::string& name,
                                                 const std::function<std::string()>& text,
                                                 const std::string& compile_options);
  // Programs compiled so far (cache misses) and their total compile time.
  int64_t compile_count() const { return compiles_.load(); }
  double compile_seconds() const;

  // A copy of `bytes` host bytes as a ui8[bytes] array on device `device` (done when this
  // returns: the host bytes may be reused).
  absl::StatusOr<DeviceBuffer> FromHost(const void* data, int64_t bytes, int device) const;
  // A copy of `count` host elements of `type` as a type[count] array on device `device`.
  absl::StatusOr<DeviceBuffer> FromHost(const void* data, DType type, int64_t count,
                                        int device) const;
  // An i64 scalar on device `device`.
  absl::StatusOr<DeviceBuffer> Scalar(int64_t value, int device) const;
  // An i64[n] array on device `device`.
  absl::StatusOr<DeviceBuffer> I64Array(const int64_t* values, int64_t n, int device) const;
  // The whole buffer's bytes into dst (dst_bytes must be its size); waits.
  absl::Status ToHost(PJRT_Buffer* buf, void* dst, size_t dst_bytes) const;
  // Runs `exe` on device `device` (one launch of a program whose addressable devices include
  // it) and waits for it to complete. Arguments listed in `donated` are given to the program
  // (their handles are dead after a successful launch). Returns the outputs.
  absl::StatusOr<std::vector<DeviceBuffer>> Execute(const Executable& exe, int device,
                                                    const std::vector<PJRT_Buffer*>& args,
                                                    int launch_id = 0) const;
  // The same without waiting: `done` receives the launch's completion event. The outputs may
  // be passed to later launches at once (the plugin orders them after this one).
  absl::StatusOr<std::vector<DeviceBuffer>> Launch(const Executable& exe, int device,
                                                   const std::vector<PJRT_Buffer*>& args,
                                                   DeviceEvent* done, int launch_id = 0) const;

 private:
  Client() = default;
  // Fills exe->num_outputs and, where the plugin gives them, exe->temp_bytes.
  absl::Status Describe(Executable* exe) const;
  absl::StatusOr<DeviceBuffer> Transfer(const void* data, int type,
                                        const std::vector<int64_t>& dims, int device) const;
  const Plugin* plugin_ = nullptr;
  PJRT_Client* client_ = nullptr;
  std::string platform_;
  std::vector<PJRT_Device*> devices_;
  std::vector<int64_t> device_ids_;
  std::vector<std::string> device_strings_;
  int global_devices_ = 0;
  std::shared_ptr<KeyValueStore> kv_store_;  // the plugin may call it while the client lives

  struct CacheEntry {
    std::mutex mu;  // held while compiling: other ranks asking for the same program wait
    bool done = false;
    absl::Status status;
    Executable executable;
  };
  std::mutex cache_mu_;
  std::map<std::string, std::shared_ptr<CacheEntry>> cache_;
  struct KeyedEntry {
    const Executable* exe = nullptr;
    std::string text;  // with FSDP_PJRT_CHECK_KEYS=1 only
  };
  std::mutex keyed_mu_;
  std::unordered_map<std::string, KeyedEntry> keyed_;
  std::atomic<int64_t> compiles_{0};
  std::atomic<int64_t> compile_ns_{0};
};

}  // namespace fsdp::pjrt
