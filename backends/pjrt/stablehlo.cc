// StableHLO program text and compile options of the PJRT backend (stablehlo.h).
#include "backends/pjrt/stablehlo.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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
  void Message(int field, const Proto& m) {
    Varint((static_cast<uint64_t>(field) << 3) | 2);
    Varint(m.bytes.size());
    bytes += m.bytes;
  }
};

std::string Bytes(int64_t n) { return absl::StrCat("tensor<", n, "xui8>"); }

std::string ElementType(DType d) {
  return d == DType::kU8 ? "ui8" : std::string(DTypeName(d));  // MLIR spells it ui8
}

std::string Module(const std::string& name, int replicas, const std::string& signature,
                   const std::string& body) {
  return absl::StrCat("module @", name, " attributes {mhlo.num_replicas = ", replicas,
                      " : i32, mhlo.num_partitions = 1 : i32} {\n  func.func public @main(",
                      signature, " {\n", body, "  }\n}\n");
}

std::string Groups(int ranks) {
  std::vector<int> r(ranks);
  for (int i = 0; i < ranks; ++i) r[i] = i;
  return absl::StrCat("replica_groups = dense<[[", absl::StrJoin(r, ", "), "]]> : tensor<1x", ranks,
                      "xi64>");
}

// Lines turning %in (ui8[count*es]) into %x (tensor<count x f32>, converted when needed).
std::string BytesToF32(int64_t count, DType d) {
  const int64_t es = static_cast<int64_t>(DTypeSize(d));
  const std::string t = ElementType(d);
  std::string s =
      absl::StrCat("    %r = stablehlo.reshape %in : (", Bytes(count * es), ") -> tensor<", count,
                   "x", es, "xui8>\n", "    %t = stablehlo.bitcast_convert %r : (tensor<", count,
                   "x", es, "xui8>) -> tensor<", count, "x", t, ">\n");
  if (d == DType::kF32) {
    absl::StrAppend(&s, "    %x = stablehlo.reshape %t : (tensor<", count, "xf32>) -> tensor<",
                    count, "xf32>\n");
  } else {
    absl::StrAppend(&s, "    %x = stablehlo.convert %t : (tensor<", count, "x", t, ">) -> tensor<",
                    count, "xf32>\n");
  }
  return s;
}

// Lines turning %y (tensor<count x f32>) into %out (ui8[count*es]), rounding once.
std::string F32ToBytes(int64_t count, DType d) {
  const int64_t es = static_cast<int64_t>(DTypeSize(d));
  const std::string t = ElementType(d);
  std::string s = absl::StrCat("    %yt = stablehlo.convert %y : (tensor<", count,
                               "xf32>) -> tensor<", count, "x", t, ">\n");
  absl::StrAppend(&s, "    %yb = stablehlo.bitcast_convert %yt : (tensor<", count, "x", t,
                  ">) -> tensor<", count, "x", es, "xui8>\n",
                  "    %out = stablehlo.reshape %yb : (tensor<", count, "x", es, "xui8>) -> ",
                  Bytes(count * es), "\n");
  return s;
}

std::string Combiner(ReduceOp op) {
  const char* fn = op == ReduceOp::kMax ? "stablehlo.maximum" : "stablehlo.add";
  return absl::StrCat("({\n    ^bb0(%a: tensor<f32>, %b: tensor<f32>):\n      %c = ", fn,
                      " %a, %b : tensor<f32>\n      stablehlo.return %c : tensor<f32>\n    })");
}

// Lines turning %z (tensor<count x f32>, the reduction) into %y (divided for avg).
std::string Average(int ranks, int64_t count, ReduceOp op) {
  const std::string t = absl::StrCat("tensor<", count, "xf32>");
  if (op != ReduceOp::kAvg) {
    return absl::StrCat("    %y = stablehlo.reshape %z : (", t, ") -> ", t, "\n");
  }
  return absl::StrCat("    %n = stablehlo.constant dense<", ranks, ".0> : ", t, "\n",
                      "    %y = stablehlo.divide %z, %n : ", t, "\n");
}

}  // namespace

std::string CompileOptions(const std::vector<int64_t>& device_ids) {
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
  return options.bytes;
}

std::string PortableCompileOptions() {
  Proto build;        // ExecutableBuildOptionsProto
  build.Int(1, -1);   // device_ordinal: unset
  build.Int(4, 1);    // num_replicas
  build.Int(5, 1);    // num_partitions
  Proto options;      // CompileOptionsProto
  options.Message(3, build);
  options.Int(4, 1);  // compile_portable_executable
  return options.bytes;
}

std::string OnAllocations(const std::string& program, int64_t in_bytes, int64_t out_bytes,
                          int64_t send_bytes, int64_t recv_bytes, bool same) {
  // program: "module ... @main(%in: <in>) -> <out> {\n" BODY "    return %out : <out>\n  }\n}\n"
  const std::string open = "func.func public @main(";
  const size_t head_end = program.find(open);
  const size_t body_start = program.find(" {\n", head_end) + 3;
  const size_t body_end = program.rfind("    return %out");
  const std::string head = program.substr(0, head_end + open.size());
  const std::string body = program.substr(body_start, body_end - body_start);
  const std::string S = Bytes(send_bytes), R = Bytes(same ? send_bytes : recv_bytes);
  std::string sig = same ? absl::StrCat("%s: ", S, " {tf.aliasing_output = 0 : i32}")
                         : absl::StrCat("%s: ", S, ", %d: ", R, " {tf.aliasing_output = 0 : i32}");
  absl::StrAppend(&sig, ", %off: tensor<2xi64>) -> ", R);
  std::string pre;
  for (int i = 0; i < 2; ++i) {
    absl::StrAppend(&pre, "    %o", i, "s = \"stablehlo.slice\"(%off) {start_indices = array<i64: ", i,
                    ">, limit_indices = array<i64: ", i + 1,
                    ">, strides = array<i64: 1>} : (tensor<2xi64>) -> tensor<1xi64>\n", "    %o", i,
                    " = stablehlo.reshape %o", i, "s : (tensor<1xi64>) -> tensor<i64>\n");
  }
  absl::StrAppend(&pre, "    %in = stablehlo.dynamic_slice %s, %o0, sizes = [", in_bytes, "] : (", S,
                  ", tensor<i64>) -> ", Bytes(in_bytes), "\n");
  const std::string post = absl::StrCat(
      "    %res = stablehlo.dynamic_update_slice ", same ? "%s" : "%d", ", %out, %o1 : (", R, ", ",
      Bytes(out_bytes), ", tensor<i64>) -> ", R, "\n    return %res : ", R, "\n");
  return absl::StrCat(head, sig, " {\n", pre, body, post, "  }\n}\n");
}

std::string SliceProgram(int64_t n, int64_t k) {
  return Module(
      "fsdp_slice", 1, absl::StrCat("%src: ", Bytes(n), ", %off: tensor<i64>) -> ", Bytes(k)),
      absl::StrCat("    %out = stablehlo.dynamic_slice %src, %off, sizes = [", k, "] : (", Bytes(n),
                   ", tensor<i64>) -> ", Bytes(k), "\n", "    return %out : ", Bytes(k), "\n"));
}

std::string UpdateProgram(int64_t n, int64_t k) {
  return Module("fsdp_update", 1,
                absl::StrCat("%dst: ", Bytes(n), " {tf.aliasing_output = 0 : i32}, %src: ",
                             Bytes(k), ", %off: tensor<i64>) -> ", Bytes(n)),
                absl::StrCat("    %out = stablehlo.dynamic_update_slice %dst, %src, %off : (",
                             Bytes(n), ", ", Bytes(k), ", tensor<i64>) -> ", Bytes(n), "\n",
                             "    return %out : ", Bytes(n), "\n"));
}

std::string AllGatherProgram(int ranks, int64_t count, DType dtype) {
  const int64_t b = count * static_cast<int64_t>(DTypeSize(dtype));
  return Module("fsdp_all_gather", ranks,
                absl::StrCat("%in: ", Bytes(b), ") -> ", Bytes(ranks * b)),
                absl::StrCat("    %out = \"stablehlo.all_gather\"(%in) {all_gather_dim = 0 : i64, ",
                             Groups(ranks), "} : (", Bytes(b), ") -> ", Bytes(ranks * b), "\n",
                             "    return %out : ", Bytes(ranks * b), "\n"));
}

std::string ReduceScatterProgram(int ranks, int64_t count, DType dtype, ReduceOp op) {
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  const int64_t shard = count / ranks;
  std::string body = BytesToF32(count, dtype);
  absl::StrAppend(&body, "    %z = \"stablehlo.reduce_scatter\"(%x) ", Combiner(op),
                  " {scatter_dimension = 0 : i64, ", Groups(ranks), "} : (tensor<", count,
                  "xf32>) -> tensor<", shard, "xf32>\n");
  absl::StrAppend(&body, Average(ranks, shard, op), F32ToBytes(shard, dtype),
                  "    return %out : ", Bytes(shard * es), "\n");
  return Module("fsdp_reduce_scatter", ranks,
                absl::StrCat("%in: ", Bytes(count * es), ") -> ", Bytes(shard * es)), body);
}

std::string AllReduceProgram(int ranks, int64_t count, DType dtype, ReduceOp op) {
  const int64_t es = static_cast<int64_t>(DTypeSize(dtype));
  std::string body = BytesToF32(count, dtype);
  absl::StrAppend(&body, "    %z = \"stablehlo.all_reduce\"(%x) ", Combiner(op), " {",
                  Groups(ranks), "} : (tensor<", count, "xf32>) -> tensor<", count, "xf32>\n");
  absl::StrAppend(&body, Average(ranks, count, op), F32ToBytes(count, dtype),
                  "    return %out : ", Bytes(count * es), "\n");
  return Module("fsdp_all_reduce", ranks,
                absl::StrCat("%in: ", Bytes(count * es), ") -> ", Bytes(count * es)), body);
}

std::string AllToAllProgram(int ranks, int64_t count, DType dtype) {
  const int64_t b = count * static_cast<int64_t>(DTypeSize(dtype));
  return Module("fsdp_all_to_all", ranks, absl::StrCat("%in: ", Bytes(b), ") -> ", Bytes(b)),
                absl::StrCat("    %out = \"stablehlo.all_to_all\"(%in) {split_dimension = 0 : i64, "
                             "concat_dimension = 0 : i64, split_count = ",
                             ranks, " : i64, ", Groups(ranks), "} : (", Bytes(b), ") -> ",
                             Bytes(b), "\n", "    return %out : ", Bytes(b), "\n"));
}

}  // namespace fsdp::pjrt
