// A stub PJRT plugin for the multi-process client's plumbing (pjrt_mpi_test.cc): no device
// runs anything, but PJRT_Client_Create behaves as a plugin that spans processes does. It reads
// the create options "node_id" and "num_nodes" (and "stub_devices", its devices per process,
// default 2), publishes this node's devices through the caller's kv_put callback, reads every
// other node's with kv_get (10 s), checks that kv_try_get of an absent key is NOT_FOUND, and
// then reports the global topology: num_nodes x stub_devices devices, this node's addressable,
// with ids node * stub_devices + i. The platform name records what it saw:
// "stub node 1 of 2, peers 0:2 1:2". Every other function of the table fails with
// UNIMPLEMENTED.
#include <cstring>
#include <string>
#include <vector>

#include "pjrt_c_api.h"

struct PJRT_Error {
  PJRT_Error_Code code;
  std::string message;
};
struct PJRT_DeviceDescription {
  int id;
  std::string text;
};
struct PJRT_Device {
  PJRT_DeviceDescription description;
};
struct PJRT_Client {
  std::string platform;
  std::vector<PJRT_Device> devices;  // global
  std::vector<PJRT_Device*> all, addressable;
};

namespace {

PJRT_Error* MakeError(PJRT_Error_Code code, const char* message, size_t size) {
  return new PJRT_Error{code, std::string(message, size)};
}
PJRT_Error* Fail(PJRT_Error_Code code, const std::string& m) { return new PJRT_Error{code, m}; }

template <typename Args>
PJRT_Error* Unimplemented(Args*) {
  return Fail(PJRT_Error_Code_UNIMPLEMENTED, "the stub plugin does not implement this");
}

void ErrorDestroy(PJRT_Error_Destroy_Args* a) { delete a->error; }
void ErrorMessage(PJRT_Error_Message_Args* a) {
  a->message = a->error->message.data();
  a->message_size = a->error->message.size();
}
PJRT_Error* ErrorGetCode(PJRT_Error_GetCode_Args* a) {
  a->code = a->error->code;
  return nullptr;
}
PJRT_Error* PluginInitialize(PJRT_Plugin_Initialize_Args*) { return nullptr; }

PJRT_Error* ClientCreate(PJRT_Client_Create_Args* a) {
  int64_t node = 0, nodes = 1, per = 2;
  for (size_t i = 0; i < a->num_options; ++i) {
    const PJRT_NamedValue& v = a->create_options[i];
    const std::string name(v.name, v.name_size);
    if (v.type != PJRT_NamedValue_kInt64) continue;
    if (name == "node_id") node = v.int64_value;
    if (name == "num_nodes") nodes = v.int64_value;
    if (name == "stub_devices") per = v.int64_value;
  }
  std::string peers;
  if (nodes > 1) {
    if (a->kv_put_callback == nullptr || a->kv_get_callback == nullptr ||
        a->kv_try_get_callback == nullptr) {
      return Fail(PJRT_Error_Code_INVALID_ARGUMENT,
                  "stub plugin: num_nodes > 1 needs the key-value callbacks");
    }
    PJRT_CallbackError make = &MakeError;
    const std::string key = "stub/node/" + std::to_string(node);
    const std::string value = std::to_string(node) + ":" + std::to_string(per);
    PJRT_KeyValuePutCallback_Args put{};
    put.struct_size = PJRT_KeyValuePutCallback_Args_STRUCT_SIZE;
    put.key = key.data();
    put.key_size = key.size();
    put.value = value.data();
    put.value_size = value.size();
    put.callback_error = &make;
    put.user_arg = a->kv_put_user_arg;
    if (PJRT_Error* e = a->kv_put_callback(&put)) return e;
    PJRT_KeyValueTryGetCallback_Args tg{};
    tg.struct_size = PJRT_KeyValueTryGetCallback_Args_STRUCT_SIZE;
    const std::string absent = "stub/absent";
    tg.key = absent.data();
    tg.key_size = absent.size();
    tg.callback_error = &make;
    tg.user_arg = a->kv_try_get_user_arg;
    PJRT_Error* e = a->kv_try_get_callback(&tg);
    if (e == nullptr || e->code != PJRT_Error_Code_NOT_FOUND) {
      delete e;
      return Fail(PJRT_Error_Code_INTERNAL, "stub plugin: kv_try_get of an absent key is not NOT_FOUND");
    }
    delete e;
    for (int64_t q = 0; q < nodes; ++q) {
      const std::string k = "stub/node/" + std::to_string(q);
      PJRT_KeyValueGetCallback_Args get{};
      get.struct_size = PJRT_KeyValueGetCallback_Args_STRUCT_SIZE;
      get.key = k.data();
      get.key_size = k.size();
      get.timeout_in_ms = 10000;
      get.callback_error = &make;
      get.user_arg = a->kv_get_user_arg;
      if (PJRT_Error* ge = a->kv_get_callback(&get)) return ge;
      peers.append(" ").append(get.value, get.value_size);
      get.value_deleter_callback(get.value);
    }
  }
  auto* c = new PJRT_Client;
  c->platform = "stub node ";
  c->platform.append(std::to_string(node)).append(" of ").append(std::to_string(nodes));
  if (!peers.empty()) c->platform.append(", peers").append(peers);
  c->devices.resize(static_cast<size_t>(nodes * per));
  for (size_t i = 0; i < c->devices.size(); ++i) {
    c->devices[i].description = {static_cast<int>(i), "stub device " + std::to_string(i)};
  }
  for (size_t i = 0; i < c->devices.size(); ++i) {
    c->all.push_back(&c->devices[i]);
    if (static_cast<int64_t>(i) / per == node) c->addressable.push_back(&c->devices[i]);
  }
  a->client = c;
  return nullptr;
}
PJRT_Error* ClientDestroy(PJRT_Client_Destroy_Args* a) {
  delete a->client;
  return nullptr;
}
PJRT_Error* ClientPlatformName(PJRT_Client_PlatformName_Args* a) {
  a->platform_name = a->client->platform.data();
  a->platform_name_size = a->client->platform.size();
  return nullptr;
}
PJRT_Error* ClientDevices(PJRT_Client_Devices_Args* a) {
  a->devices = a->client->all.data();
  a->num_devices = a->client->all.size();
  return nullptr;
}
PJRT_Error* ClientAddressableDevices(PJRT_Client_AddressableDevices_Args* a) {
  a->addressable_devices = a->client->addressable.data();
  a->num_addressable_devices = a->client->addressable.size();
  return nullptr;
}
PJRT_Error* DeviceGetDescription(PJRT_Device_GetDescription_Args* a) {
  a->device_description = &a->device->description;
  return nullptr;
}
PJRT_Error* DescriptionId(PJRT_DeviceDescription_Id_Args* a) {
  a->id = a->device_description->id;
  return nullptr;
}
PJRT_Error* DescriptionToString(PJRT_DeviceDescription_ToString_Args* a) {
  a->to_string = a->device_description->text.data();
  a->to_string_size = a->device_description->text.size();
  return nullptr;
}

PJRT_Api MakeApi() {
  PJRT_Api api{};
  api.struct_size = PJRT_Api_STRUCT_SIZE;
  api.pjrt_api_version.struct_size = PJRT_Api_Version_STRUCT_SIZE;
  api.pjrt_api_version.major_version = PJRT_API_MAJOR;
  api.pjrt_api_version.minor_version = PJRT_API_MINOR;
  api.PJRT_Error_Destroy = &ErrorDestroy;
  api.PJRT_Error_Message = &ErrorMessage;
  api.PJRT_Error_GetCode = &ErrorGetCode;
  api.PJRT_Plugin_Initialize = &PluginInitialize;
  api.PJRT_Client_Create = &ClientCreate;
  api.PJRT_Client_Destroy = &ClientDestroy;
  api.PJRT_Client_PlatformName = &ClientPlatformName;
  api.PJRT_Client_Devices = &ClientDevices;
  api.PJRT_Client_AddressableDevices = &ClientAddressableDevices;
  api.PJRT_Device_GetDescription = &DeviceGetDescription;
  api.PJRT_DeviceDescription_Id = &DescriptionId;
  api.PJRT_DeviceDescription_ToString = &DescriptionToString;
#define FSDP_STUB_UNIMPLEMENTED(fn) api.fn = &Unimplemented<fn##_Args>;
  FSDP_STUB_UNIMPLEMENTED(PJRT_Event_Destroy)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Event_Await)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Client_Compile)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Client_BufferFromHostBuffer)
  FSDP_STUB_UNIMPLEMENTED(PJRT_LoadedExecutable_Destroy)
  FSDP_STUB_UNIMPLEMENTED(PJRT_LoadedExecutable_Execute)
  FSDP_STUB_UNIMPLEMENTED(PJRT_LoadedExecutable_GetExecutable)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Executable_NumOutputs)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Executable_Destroy)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Buffer_Destroy)
  FSDP_STUB_UNIMPLEMENTED(PJRT_Buffer_ToHostBuffer)
#undef FSDP_STUB_UNIMPLEMENTED
  return api;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) const PJRT_Api* GetPjrtApi() {
  static const PJRT_Api api = MakeApi();
  return &api;
}
