// StableHLO program text and compile options of the PJRT backend (stablehlo.h).
#include "backends/pjrt/stablehlo.h"

#include "absl/strings/str_cat.h"

namespace fsdp::pjrt {
namespace {

// Protocol buffer wire format, for the few fields of xla.CompileOptionsProto we set.
struct Proto {
  std::string bytes;
  void Varint(uint64_t v) {
    while (v >= 0x80) {
      bytes.push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    bytes.push_back(static_cast<char>(v));
  }
  void Int(int field, int64_t v) {
    Varint(static_cast<uint64_t>(field) << 3);
    Varint(static_cast<uint64_t>(v));
  }
  void Bytes(int field, const std::string& b) {
    Varint((static_cast<uint64_t>(field) << 3) | 2);
    Varint(b.size());
    bytes += b;
  }
  void Message(int field, const Proto& m) { Bytes(field, m.bytes); }
};

// CompileOptionsProto.env_option_overrides: map<string, OptionOverrideProto> (field 7), an
// entry per option: key (1), value (2: OptionOverrideProto, bool_field = 2).
void AddOverrides(Proto* options, const XlaOverrides& overrides) {
  for (const auto& [name, value] : overrides) {
    Proto v;
    v.Int(2, value ? 1 : 0);
    Proto entry;
    entry.Bytes(1, name);
    entry.Message(2, v);
    options->Message(7, entry);
  }
}

std::string Bytes(int64_t n) { return absl::StrCat("tensor<", n, "xui8>"); }

std::string Module(const std::string& name, int replicas, const std::string& signature,
                   const std::string& body) {
  return absl::StrCat("module @", name, " attributes {mhlo.num_replicas = ", replicas,
                      " : i32, mhlo.num_partitions = 1 : i32} {\n  func.func public @main(",
                      signature, " {\n", body, "  }\n}\n");
}

}  // namespace

std::string CompileOptions(const std::vector<int64_t>& device_ids,
                           const XlaOverrides& overrides) {
  const auto replicas = static_cast<int64_t>(device_ids.size());
  Proto ids;
  for (int64_t id : device_ids) ids.Varint(static_cast<uint64_t>(id));
  Proto computation;            // DeviceAssignmentProto.ComputationDevice
  computation.Message(1, ids);  // replica_device_ids, packed
  Proto assignment;             // DeviceAssignmentProto
  assignment.Int(1, replicas);  // replica_count
  assignment.Int(2, 1);         // computation_count
  assignment.Message(3, computation);
  Proto build;             // ExecutableBuildOptionsProto
  build.Int(1, -1);        // device_ordinal: unset
  build.Int(4, replicas);  // num_replicas
  build.Int(5, 1);         // num_partitions
  build.Message(9, assignment);
  Proto options;              // CompileOptionsProto
  options.Message(3, build);  // executable_build_options
  AddOverrides(&options, overrides);
  return options.bytes;
}

std::string PortableCompileOptions(const XlaOverrides& overrides) {
  Proto build;        // ExecutableBuildOptionsProto
  build.Int(1, -1);   // device_ordinal: unset
  build.Int(4, 1);    // num_replicas
  build.Int(5, 1);    // num_partitions
  Proto options;      // CompileOptionsProto
  options.Message(3, build);
  options.Int(4, 1);  // compile_portable_executable
  AddOverrides(&options, overrides);
  return options.bytes;
}

std::string SliceProgram(int64_t n, int64_t k) {
  return Module(
      "fsdp_slice", 1, absl::StrCat("%src: ", Bytes(n), ", %off: tensor<i64>) -> ", Bytes(k)),
      absl::StrCat("    %out = stablehlo.dynamic_slice %src, %off, sizes = [", k, "] : (", Bytes(n),
                   ", tensor<i64>) -> ", Bytes(k), "\n", "    return %out : ", Bytes(k), "\n"));
}

}  // namespace fsdp::pjrt
