// The PJRT plugin loader and client (pjrt_client.h): dlopen, version checks, errors as
// absl::Status, devices, the compile cache, host transfers and single-device launches.
#include "fsdp/pjrt_client.h"

#include <dlfcn.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "pjrt_c_api.h"

namespace fsdp::pjrt {
namespace {

// Every PJRT_Api function this layer calls: a plugin whose table is too short for one of
// them (built against an older header) is refused at load time.
// clang-format off
#define FSDP_PJRT_FUNCTIONS(X) \
  X(PJRT_Error_Destroy) X(PJRT_Error_Message) X(PJRT_Error_GetCode) X(PJRT_Plugin_Initialize) \
  X(PJRT_Event_Destroy) X(PJRT_Event_Await) X(PJRT_Client_Create) X(PJRT_Client_Destroy) \
  X(PJRT_Client_PlatformName) X(PJRT_Client_AddressableDevices) X(PJRT_Client_Compile) \
  X(PJRT_Client_Devices) \
  X(PJRT_Client_BufferFromHostBuffer) X(PJRT_Device_GetDescription) \
  X(PJRT_DeviceDescription_Id) X(PJRT_DeviceDescription_ToString) \
  X(PJRT_LoadedExecutable_Destroy) X(PJRT_LoadedExecutable_Execute) \
  X(PJRT_LoadedExecutable_GetExecutable) X(PJRT_Executable_NumOutputs) \
  X(PJRT_Executable_Destroy) X(PJRT_Buffer_Destroy) X(PJRT_Buffer_ToHostBuffer)
// clang-format on

absl::Status CheckTable(const std::string& path, const PJRT_Api* api) {
#define FSDP_PJRT_CHECK_FN(fn)                                                                     \
  if (api->struct_size < offsetof(PJRT_Api, fn) + sizeof(api->fn) || api->fn == nullptr) {         \
    return absl::FailedPreconditionError(                                                          \
        absl::StrCat("PJRT plugin '", path, "' (C API ", api->pjrt_api_version.major_version, ".", \
                     api->pjrt_api_version.minor_version,                                          \
                     ") does not provide " #fn "; use a plugin built against PJRT C API ",         \
                     PJRT_API_MAJOR, ".", PJRT_API_MINOR, " or newer"));                           \
  }
  FSDP_PJRT_FUNCTIONS(FSDP_PJRT_CHECK_FN)
#undef FSDP_PJRT_CHECK_FN
  return absl::OkStatus();
}

// The key-value callbacks of PJRT_Client_Create: user_arg is the KeyValueStore.
PJRT_Error* KvError(PJRT_CallbackError* make, const absl::Status& s) {
  PJRT_Error_Code code = PJRT_Error_Code_INTERNAL;
  switch (s.code()) {
    case absl::StatusCode::kNotFound: code = PJRT_Error_Code_NOT_FOUND; break;
    case absl::StatusCode::kDeadlineExceeded: code = PJRT_Error_Code_DEADLINE_EXCEEDED; break;
    case absl::StatusCode::kAlreadyExists: code = PJRT_Error_Code_ALREADY_EXISTS; break;
    case absl::StatusCode::kInvalidArgument: code = PJRT_Error_Code_INVALID_ARGUMENT; break;
    default: break;
  }
  const std::string m(s.message());
  return (*make)(code, m.data(), m.size());
}
void DeleteValue(char* v) { delete[] v; }
template <typename Args>
PJRT_Error* ReturnValue(Args* args, const absl::StatusOr<std::string>& v) {
  if (!v.ok()) return KvError(args->callback_error, v.status());
  args->value = new char[v->size() + 1];
  std::memcpy(args->value, v->data(), v->size());
  args->value[v->size()] = '\0';
  args->value_size = v->size();
  args->value_deleter_callback = &DeleteValue;
  return nullptr;
}
PJRT_Error* KvGet(PJRT_KeyValueGetCallback_Args* args) {
  auto* store = static_cast<KeyValueStore*>(args->user_arg);
  return ReturnValue(args, store->Get(std::string(args->key, args->key_size),
                                      absl::Milliseconds(args->timeout_in_ms)));
}
PJRT_Error* KvTryGet(PJRT_KeyValueTryGetCallback_Args* args) {
  auto* store = static_cast<KeyValueStore*>(args->user_arg);
  return ReturnValue(args, store->TryGet(std::string(args->key, args->key_size)));
}
PJRT_Error* KvPut(PJRT_KeyValuePutCallback_Args* args) {
  auto* store = static_cast<KeyValueStore*>(args->user_arg);
  const absl::Status s = store->Put(std::string(args->key, args->key_size),
                                    std::string(args->value, args->value_size));
  return s.ok() ? nullptr : KvError(args->callback_error, s);
}

std::mutex g_plugins_mu;
std::map<std::string, const Plugin*>& Plugins() {
  static auto* plugins = new std::map<std::string, const Plugin*>();
  return *plugins;
}

void DestroyEvent(const PJRT_Api* api, PJRT_Event* ev) {
  PJRT_Event_Destroy_Args d{};
  d.struct_size = PJRT_Event_Destroy_Args_STRUCT_SIZE;
  d.event = ev;
  api->PJRT_Event_Destroy(&d);
}

}  // namespace

absl::Status Plugin::ToStatus(PJRT_Error* error, absl::string_view what) const {
  if (error == nullptr) return absl::OkStatus();
  PJRT_Error_Message_Args m{};
  m.struct_size = PJRT_Error_Message_Args_STRUCT_SIZE;
  m.error = error;
  api_->PJRT_Error_Message(&m);
  std::string msg = absl::StrCat("PJRT ", what, ": ", absl::string_view(m.message, m.message_size));
  PJRT_Error_GetCode_Args c{};
  c.struct_size = PJRT_Error_GetCode_Args_STRUCT_SIZE;
  c.error = error;
  absl::StatusCode code = absl::StatusCode::kUnknown;
  if (PJRT_Error* e2 = api_->PJRT_Error_GetCode(&c); e2 == nullptr) {
    // PJRT_Error_Code follows absl's codes; OK from a failed call would lose the error.
    if (c.code > PJRT_Error_Code_OK && c.code <= PJRT_Error_Code_UNAUTHENTICATED) {
      code = static_cast<absl::StatusCode>(c.code);
    }
  } else {
    PJRT_Error_Destroy_Args d{};
    d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
    d.error = e2;
    api_->PJRT_Error_Destroy(&d);
  }
  PJRT_Error_Destroy_Args d{};
  d.struct_size = PJRT_Error_Destroy_Args_STRUCT_SIZE;
  d.error = error;
  api_->PJRT_Error_Destroy(&d);
  return absl::Status(code, msg);
}

absl::StatusOr<const Plugin*> Plugin::Load(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_plugins_mu);
  if (auto it = Plugins().find(path); it != Plugins().end()) return it->second;
  if (path.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no PJRT plugin given: set $", kPluginEnv,
                     " or PjrtClientOptions::plugin_path to a "
                     "plugin library (scripts/fetch_pjrt_plugin.sh fetches the XLA CPU plugin)"));
  }
  if (!std::filesystem::exists(path)) {
    return absl::NotFoundError(absl::StrCat(
        "PJRT plugin '", path, "' does not exist; check $", kPluginEnv,
        " (scripts/fetch_pjrt_plugin.sh DEST fetches the XLA CPU plugin to DEST/xla_cpu_pjrt.so)"));
  }
  void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("could not load PJRT plugin '", path, "': ", why ? why : "dlopen failed",
                     "; it must be a shared library exporting GetPjrtApi"));
  }
  using GetPjrtApiFn = const PJRT_Api* (*)();
  auto get_api = reinterpret_cast<GetPjrtApiFn>(dlsym(handle, "GetPjrtApi"));
  if (get_api == nullptr) {
    dlclose(handle);
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' is not a PJRT plugin: it does not export GetPjrtApi"));
  }
  const PJRT_Api* api = get_api();
  if (api == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("PJRT plugin '", path, "': GetPjrtApi returned no table"));
  }
  if (api->pjrt_api_version.major_version != PJRT_API_MAJOR) {
    return absl::FailedPreconditionError(absl::StrCat(
        "PJRT plugin '", path, "' implements PJRT C API ", api->pjrt_api_version.major_version, ".",
        api->pjrt_api_version.minor_version, ", this build speaks ", PJRT_API_MAJOR, ".",
        PJRT_API_MINOR, ": the major versions must match"));
  }
  FSDP_RETURN_IF_ERROR(CheckTable(path, api));
  auto* plugin = new Plugin(path, api);  // never unloaded
  PJRT_Plugin_Initialize_Args init{};
  init.struct_size = PJRT_Plugin_Initialize_Args_STRUCT_SIZE;
  FSDP_RETURN_IF_ERROR(plugin->ToStatus(api->PJRT_Plugin_Initialize(&init),
                                        absl::StrCat("PJRT_Plugin_Initialize of '", path, "'")));
  Plugins()[path] = plugin;
  return plugin;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    client_ = o.client_;
    buf_ = o.release();
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (buf_ == nullptr) return;
  PJRT_Buffer_Destroy_Args d{};
  d.struct_size = PJRT_Buffer_Destroy_Args_STRUCT_SIZE;
  d.buffer = buf_;
  client_->ToStatus(client_->api()->PJRT_Buffer_Destroy(&d), "PJRT_Buffer_Destroy").IgnoreError();
  buf_ = nullptr;
}

absl::StatusOr<std::shared_ptr<Client>> Client::Create(PjrtClientOptions options) {
  std::string path = options.plugin_path;
  if (path.empty()) {
    if (const char* env = std::getenv(kPluginEnv)) path = env;
  }
  if (options.num_nodes < 0 || (options.num_nodes > 0 && (options.node_id < 0 ||
                                                          options.node_id >= options.num_nodes))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PJRT client: node_id ", options.node_id, " is not in [0, num_nodes = ",
        options.num_nodes, ")"));
  }
  if (options.num_nodes > 1 && options.kv_store == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "PJRT client: num_nodes = ", options.num_nodes,
        " needs a key-value store shared by the processes (PjrtClientOptions::kv_store, e.g. "
        "CreateCommKeyValueStore over the mpi world)"));
  }
  if (options.num_nodes > 0) {
    for (const char* name : {"node_id", "num_nodes"}) {
      if (options.create_options.count(name)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "PJRT client: the create option '", name,
            "' is set from PjrtClientOptions::node_id / num_nodes; do not give it twice"));
      }
    }
    options.create_options["node_id"] = int64_t{options.node_id};
    options.create_options["num_nodes"] = int64_t{options.num_nodes};
  }
  FSDP_ASSIGN_OR_RETURN(const Plugin* plugin, Plugin::Load(path));
  const PJRT_Api* api = plugin->api();

  std::vector<PJRT_NamedValue> values;
  for (const auto& [name, value] : options.create_options) {
    PJRT_NamedValue v{};
    v.struct_size = PJRT_NamedValue_STRUCT_SIZE;
    v.name = name.data();
    v.name_size = name.size();
    if (const auto* i = std::get_if<int64_t>(&value)) {
      v.type = PJRT_NamedValue_kInt64;
      v.int64_value = *i;
      v.value_size = 1;
    } else if (const auto* s = std::get_if<std::string>(&value)) {
      v.type = PJRT_NamedValue_kString;
      v.string_value = s->data();
      v.value_size = s->size();
    } else {
      v.type = PJRT_NamedValue_kBool;
      v.bool_value = std::get<bool>(value);
      v.value_size = 1;
    }
    values.push_back(v);
  }
  PJRT_Client_Create_Args cc{};
  cc.struct_size = PJRT_Client_Create_Args_STRUCT_SIZE;
  cc.create_options = values.data();
  cc.num_options = values.size();
  if (options.kv_store != nullptr) {
    cc.kv_get_callback = &KvGet;
    cc.kv_get_user_arg = options.kv_store.get();
    cc.kv_try_get_callback = &KvTryGet;
    cc.kv_try_get_user_arg = options.kv_store.get();
    cc.kv_put_callback = &KvPut;
    cc.kv_put_user_arg = options.kv_store.get();
  }
  FSDP_RETURN_IF_ERROR(plugin->ToStatus(api->PJRT_Client_Create(&cc),
                                        absl::StrCat("PJRT_Client_Create (plugin '", path, "')")));
  std::shared_ptr<Client> c(new Client());
  c->plugin_ = plugin;
  c->client_ = cc.client;
  c->kv_store_ = options.kv_store;

  PJRT_Client_PlatformName_Args pn{};
  pn.struct_size = PJRT_Client_PlatformName_Args_STRUCT_SIZE;
  pn.client = c->client_;
  FSDP_RETURN_IF_ERROR(c->ToStatus(api->PJRT_Client_PlatformName(&pn), "PJRT_Client_PlatformName"));
  c->platform_.assign(pn.platform_name, pn.platform_name_size);

  PJRT_Client_AddressableDevices_Args ad{};
  ad.struct_size = PJRT_Client_AddressableDevices_Args_STRUCT_SIZE;
  ad.client = c->client_;
  FSDP_RETURN_IF_ERROR(
      c->ToStatus(api->PJRT_Client_AddressableDevices(&ad), "PJRT_Client_AddressableDevices"));
  PJRT_Client_Devices_Args all{};
  all.struct_size = PJRT_Client_Devices_Args_STRUCT_SIZE;
  all.client = c->client_;
  FSDP_RETURN_IF_ERROR(c->ToStatus(api->PJRT_Client_Devices(&all), "PJRT_Client_Devices"));
  c->global_devices_ = static_cast<int>(all.num_devices);
  for (size_t i = 0; i < ad.num_addressable_devices; ++i) {
    PJRT_Device_GetDescription_Args g{};
    g.struct_size = PJRT_Device_GetDescription_Args_STRUCT_SIZE;
    g.device = ad.addressable_devices[i];
    FSDP_RETURN_IF_ERROR(
        c->ToStatus(api->PJRT_Device_GetDescription(&g), "PJRT_Device_GetDescription"));
    PJRT_DeviceDescription_Id_Args id{};
    id.struct_size = PJRT_DeviceDescription_Id_Args_STRUCT_SIZE;
    id.device_description = g.device_description;
    FSDP_RETURN_IF_ERROR(
        c->ToStatus(api->PJRT_DeviceDescription_Id(&id), "PJRT_DeviceDescription_Id"));
    PJRT_DeviceDescription_ToString_Args ts{};
    ts.struct_size = PJRT_DeviceDescription_ToString_Args_STRUCT_SIZE;
    ts.device_description = g.device_description;
    FSDP_RETURN_IF_ERROR(
        c->ToStatus(api->PJRT_DeviceDescription_ToString(&ts), "PJRT_DeviceDescription_ToString"));
    c->devices_.push_back(ad.addressable_devices[i]);
    c->device_ids_.push_back(id.id);
    c->device_strings_.emplace_back(ts.to_string, ts.to_string_size);
  }
  return c;
}

Client::~Client() {
  const PJRT_Api* a = api();
  for (auto& [key, entry] : cache_) {
    if (entry->executable.exe == nullptr) continue;
    PJRT_LoadedExecutable_Destroy_Args d{};
    d.struct_size = PJRT_LoadedExecutable_Destroy_Args_STRUCT_SIZE;
    d.executable = entry->executable.exe;
    ToStatus(a->PJRT_LoadedExecutable_Destroy(&d), "PJRT_LoadedExecutable_Destroy").IgnoreError();
  }
  PJRT_Client_Destroy_Args d{};
  d.struct_size = PJRT_Client_Destroy_Args_STRUCT_SIZE;
  d.client = client_;
  ToStatus(a->PJRT_Client_Destroy(&d), "PJRT_Client_Destroy").IgnoreError();
}

double Client::compile_seconds() const { return static_cast<double>(compile_ns_.load()) * 1e-9; }

absl::StatusOr<const Executable*> Client::CompileKeyed(const std::string& key,
                                                       const std::string& name,
                                                       const std::function<std::string()>& text,
                                                       const std::string& compile_options) {
  static const bool check = [] {
    const char* v = std::getenv("FSDP_PJRT_CHECK_KEYS");
    return v != nullptr && std::string(v) == "1";
  }();
  const std::string full_key = absl::StrCat(compile_options.size(), ":", compile_options, key);
  {
    std::lock_guard<std::mutex> lock(keyed_mu_);
    auto it = keyed_.find(full_key);
    if (it != keyed_.end()) {
      if (check) {
        if (std::string t = text(); t != it->second.text) {
          return absl::InternalError(absl::StrCat(
              "PJRT program '", name, "': two programs of different text have the same key (",
              key.size(), " bytes); the key misses part of the structure. First text:\n",
              it->second.text, "\nThis text:\n", t));
        }
      }
      return it->second.exe;
    }
  }
  std::string mlir = text();
  FSDP_ASSIGN_OR_RETURN(const Executable* exe, Compile(name, mlir, compile_options));
  std::lock_guard<std::mutex> lock(keyed_mu_);
  KeyedEntry& e = keyed_[full_key];
  e.exe = exe;
  if (check) e.text = std::move(mlir);
  return exe;
}

absl::StatusOr<const Executable*> Client::Compile(const std::string& name, const std::string& mlir,
                                                  const std::string& compile_options) {
  if (compile_options.empty()) {
    // An empty CompileOptionsProto makes some plugins abort the process (num_replicas = 0).
    return absl::InvalidArgumentError(
        absl::StrCat("PJRT compile of '", name, "': empty compile options"));
  }
  std::shared_ptr<CacheEntry> entry;
  {
    std::lock_guard<std::mutex> lock(cache_mu_);
    std::string key = absl::StrCat(compile_options.size(), ":", compile_options, mlir);
    std::shared_ptr<CacheEntry>& e = cache_[key];
    if (e == nullptr) e = std::make_shared<CacheEntry>();
    entry = e;
  }
  std::lock_guard<std::mutex> lock(entry->mu);
  if (entry->done) {
    if (!entry->status.ok()) return entry->status;
    return &entry->executable;
  }
  PJRT_Program prog{};
  prog.struct_size = PJRT_Program_STRUCT_SIZE;
  prog.code = const_cast<char*>(mlir.data());
  prog.code_size = mlir.size();
  static constexpr char kFormat[] = "mlir";
  prog.format = kFormat;
  prog.format_size = sizeof(kFormat) - 1;
  PJRT_Client_Compile_Args a{};
  a.struct_size = PJRT_Client_Compile_Args_STRUCT_SIZE;
  a.client = client_;
  a.program = &prog;
  a.compile_options = compile_options.data();
  a.compile_options_size = compile_options.size();
  const auto t0 = std::chrono::steady_clock::now();
  entry->status = ToStatus(api()->PJRT_Client_Compile(&a), absl::StrCat("compile of '", name, "'"));
  compile_ns_.fetch_add(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
          .count());
  compiles_.fetch_add(1);
  entry->done = true;
  if (!entry->status.ok()) return entry->status;
  entry->executable = Executable{a.executable, name, 0, -1};
  entry->status = Describe(&entry->executable);
  if (!entry->status.ok()) return entry->status;
  return &entry->executable;
}

int Plugin::major_version() const { return api_->pjrt_api_version.major_version; }
int Plugin::minor_version() const { return api_->pjrt_api_version.minor_version; }

absl::Status Client::Describe(Executable* exe) const {
  const PJRT_Api* a = api();
  PJRT_LoadedExecutable_GetExecutable_Args g{};
  g.struct_size = PJRT_LoadedExecutable_GetExecutable_Args_STRUCT_SIZE;
  g.loaded_executable = exe->exe;
  FSDP_RETURN_IF_ERROR(
      ToStatus(a->PJRT_LoadedExecutable_GetExecutable(&g), "PJRT_LoadedExecutable_GetExecutable"));
  PJRT_Executable_NumOutputs_Args n{};
  n.struct_size = PJRT_Executable_NumOutputs_Args_STRUCT_SIZE;
  n.executable = g.executable;
  absl::Status s = ToStatus(a->PJRT_Executable_NumOutputs(&n), "PJRT_Executable_NumOutputs");
  exe->num_outputs = n.num_outputs;
  // Optional (not in the table CheckTable requires): a plugin without it leaves -1.
  if (a->struct_size >= offsetof(PJRT_Api, PJRT_Executable_GetCompiledMemoryStats) +
                            sizeof(a->PJRT_Executable_GetCompiledMemoryStats) &&
      a->PJRT_Executable_GetCompiledMemoryStats != nullptr) {
    PJRT_Executable_GetCompiledMemoryStats_Args m{};
    m.struct_size = PJRT_Executable_GetCompiledMemoryStats_Args_STRUCT_SIZE;
    m.executable = g.executable;
    PJRT_Error* e = a->PJRT_Executable_GetCompiledMemoryStats(&m);
    if (e == nullptr) {
      exe->temp_bytes = m.temp_size_in_bytes;
    } else {
      ToStatus(e, "PJRT_Executable_GetCompiledMemoryStats").IgnoreError();
    }
  }
  PJRT_Executable_Destroy_Args ed{};
  ed.struct_size = PJRT_Executable_Destroy_Args_STRUCT_SIZE;
  ed.executable = g.executable;
  ToStatus(a->PJRT_Executable_Destroy(&ed), "PJRT_Executable_Destroy").IgnoreError();
  return s;
}

absl::StatusOr<DeviceBuffer> Client::FromHost(const void* data, int64_t bytes, int device) const {
  return Transfer(data, PJRT_Buffer_Type_U8, {bytes}, device);
}

absl::StatusOr<DeviceBuffer> Client::FromHost(const void* data, DType type, int64_t count,
                                              int device) const {
  int t = PJRT_Buffer_Type_U8;
  switch (type) {
    case DType::kF32: t = PJRT_Buffer_Type_F32; break;
    case DType::kBF16: t = PJRT_Buffer_Type_BF16; break;
    case DType::kF16: t = PJRT_Buffer_Type_F16; break;
    case DType::kF64: t = PJRT_Buffer_Type_F64; break;
    case DType::kI32: t = PJRT_Buffer_Type_S32; break;
    case DType::kI64: t = PJRT_Buffer_Type_S64; break;
    case DType::kU8: t = PJRT_Buffer_Type_U8; break;
  }
  return Transfer(data, t, {count}, device);
}

absl::StatusOr<DeviceBuffer> Client::Scalar(int64_t value, int device) const {
  return Transfer(&value, PJRT_Buffer_Type_S64, {}, device);
}

absl::StatusOr<DeviceBuffer> Client::I64Array(const int64_t* values, int64_t n,
                                              int device) const {
  return Transfer(values, PJRT_Buffer_Type_S64, {n}, device);
}

absl::StatusOr<DeviceBuffer> Client::Transfer(const void* data, int type,
                                              const std::vector<int64_t>& dims, int device) const {
  PJRT_Client_BufferFromHostBuffer_Args a{};
  a.struct_size = PJRT_Client_BufferFromHostBuffer_Args_STRUCT_SIZE;
  a.client = client_;
  a.data = data;
  a.type = static_cast<PJRT_Buffer_Type>(type);
  a.dims = dims.data();
  a.num_dims = dims.size();
  a.host_buffer_semantics = PJRT_HostBufferSemantics_kImmutableOnlyDuringCall;
  a.device = devices_[device];
  FSDP_RETURN_IF_ERROR(
      ToStatus(api()->PJRT_Client_BufferFromHostBuffer(&a), "PJRT_Client_BufferFromHostBuffer"));
  DeviceBuffer out(this, a.buffer);
  if (a.done_with_host_buffer != nullptr) {
    PJRT_Event_Await_Args w{};
    w.struct_size = PJRT_Event_Await_Args_STRUCT_SIZE;
    w.event = a.done_with_host_buffer;
    absl::Status s = ToStatus(api()->PJRT_Event_Await(&w), "host-to-device copy");
    DestroyEvent(api(), a.done_with_host_buffer);
    FSDP_RETURN_IF_ERROR(s);
  }
  return out;
}

absl::Status Client::ToHost(PJRT_Buffer* buf, void* dst, size_t dst_bytes) const {
  PJRT_Buffer_ToHostBuffer_Args a{};
  a.struct_size = PJRT_Buffer_ToHostBuffer_Args_STRUCT_SIZE;
  a.src = buf;
  a.dst = dst;
  a.dst_size = dst_bytes;
  FSDP_RETURN_IF_ERROR(ToStatus(api()->PJRT_Buffer_ToHostBuffer(&a), "PJRT_Buffer_ToHostBuffer"));
  if (a.event == nullptr) return absl::OkStatus();
  PJRT_Event_Await_Args w{};
  w.struct_size = PJRT_Event_Await_Args_STRUCT_SIZE;
  w.event = a.event;
  absl::Status s = ToStatus(api()->PJRT_Event_Await(&w), "device-to-host copy");
  DestroyEvent(api(), a.event);
  return s;
}

DeviceEvent& DeviceEvent::operator=(DeviceEvent&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) Await().IgnoreError();
    client_ = o.client_;
    event_ = std::exchange(o.event_, nullptr);
    what_ = std::move(o.what_);
  }
  return *this;
}

DeviceEvent::~DeviceEvent() {
  if (event_ != nullptr) Await().IgnoreError();
}

absl::Status DeviceEvent::Await() {
  if (event_ == nullptr) return absl::OkStatus();
  PJRT_Event_Await_Args w{};
  w.struct_size = PJRT_Event_Await_Args_STRUCT_SIZE;
  w.event = event_;
  absl::Status s = client_->ToStatus(client_->api()->PJRT_Event_Await(&w), what_);
  DestroyEvent(client_->api(), event_);
  event_ = nullptr;
  return s;
}

absl::StatusOr<std::vector<DeviceBuffer>> Client::Execute(const Executable& exe, int device,
                                                          const std::vector<PJRT_Buffer*>& args,
                                                          int launch_id) const {
  DeviceEvent done;
  FSDP_ASSIGN_OR_RETURN(std::vector<DeviceBuffer> result,
                        Launch(exe, device, args, &done, launch_id));
  FSDP_RETURN_IF_ERROR(done.Await());
  return result;
}

absl::StatusOr<std::vector<DeviceBuffer>> Client::Launch(const Executable& exe, int device,
                                                         const std::vector<PJRT_Buffer*>& args,
                                                         DeviceEvent* done_out,
                                                         int launch_id) const {
  const PJRT_Api* a = api();
  std::vector<PJRT_Buffer*> outs(exe.num_outputs, nullptr);
  PJRT_Buffer* const* arg_list = args.data();
  PJRT_Buffer** out_list = outs.data();
  PJRT_Event* done = nullptr;
  PJRT_ExecuteOptions opts{};
  opts.struct_size = PJRT_ExecuteOptions_STRUCT_SIZE;
  opts.launch_id = launch_id;
  PJRT_LoadedExecutable_Execute_Args e{};
  e.struct_size = PJRT_LoadedExecutable_Execute_Args_STRUCT_SIZE;
  e.executable = exe.exe;
  e.options = &opts;
  e.argument_lists = &arg_list;
  e.num_devices = 1;
  e.num_args = args.size();
  e.output_lists = &out_list;
  e.device_complete_events = &done;
  e.execute_device = devices_[device];
  FSDP_RETURN_IF_ERROR(
      ToStatus(a->PJRT_LoadedExecutable_Execute(&e), absl::StrCat("launch of '", exe.name, "'")));
  std::vector<DeviceBuffer> result;
  for (PJRT_Buffer* b : outs) result.emplace_back(this, b);
  *done_out = DeviceEvent(this, done, absl::StrCat("run of '", exe.name, "'"));
  return result;
}

}  // namespace fsdp::pjrt
