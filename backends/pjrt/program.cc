// The program builder of the PJRT backend's ops (program.h).
#include "backends/pjrt/program.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"

namespace fsdp::pjrt {
namespace {

constexpr char kParamsType[] = "@PARAMS@";  // tensor<P x i64>, filled in by Text()

std::string Tensor(const std::vector<int64_t>& dims, const std::string& type) {
  std::string s = "tensor<";
  for (int64_t d : dims) absl::StrAppend(&s, d, "x");
  return absl::StrCat(s, type, ">");
}

std::string List(const std::vector<int64_t>& v) { return absl::StrJoin(v, ", "); }

int64_t Product(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

bool IsFloatType(const std::string& t) {
  return t == "f32" || t == "f64" || t == "bf16" || t == "f16";
}

// A literal of `type` for dense<...>: exact (hex for infinities and NaN).
std::string Literal(double v, const std::string& type) {
  if (!IsFloatType(type)) {
    if (type == "i1") return v != 0 ? "true" : "false";
    return absl::StrCat(static_cast<int64_t>(v));
  }
  if (std::isfinite(v)) return absl::StrFormat("%.17e", v);
  if (type == "f64") {
    uint64_t bits;
    std::memcpy(&bits, &v, 8);
    return absl::StrFormat("0x%016X", bits);
  }
  const auto f = static_cast<float>(v);
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (type == "f32") return absl::StrFormat("0x%08X", bits);
  // bf16: the top half of the f32; f16 infinities only.
  if (type == "bf16") return absl::StrFormat("0x%04X", bits >> 16);
  return v > 0 ? "0x7C00" : v < 0 ? "0xFC00" : "0x7E00";
}

}  // namespace

std::string ElementTypeOf(DType d) {
  return d == DType::kU8 ? "ui8" : std::string(DTypeName(d));  // MLIR spells it ui8
}

int64_t Value::numel() const { return Product(dims); }
std::string Value::tensor() const { return Tensor(dims, type); }

std::string Program::Fresh() { return absl::StrCat("%v", next_++); }

Value Program::Emit(const std::string& rhs, std::vector<int64_t> dims, const std::string& type) {
  const int64_t num = next_;
  Value v{Fresh(), std::move(dims), type, num};
  absl::StrAppend(&body_, "    ", v.id, " = ", rhs, "\n");
  return v;
}

void Program::Put(const char* s) {
  // FNV-1a of the bytes, and the length.
  uint64_t h = 14695981039346656037ULL;
  int64_t n = 0;
  for (; s[n] != 0; ++n) h = (h ^ static_cast<uint8_t>(s[n])) * 1099511628211ULL;
  key_.push_back(n);
  key_.push_back(static_cast<int64_t>(h));
}

void Program::Put(const std::vector<int64_t>& v) {
  key_.push_back(static_cast<int64_t>(v.size()));
  key_.insert(key_.end(), v.begin(), v.end());
}

void Program::Put(const std::vector<Value>& vs) {
  key_.push_back(static_cast<int64_t>(vs.size()));
  for (const Value& v : vs) key_.push_back(v.num);
}

template <typename... T>
Value Program::Node(std::vector<int64_t> dims, const std::string& type, int64_t code,
                    const T&... parts) {
  key_.push_back(code);
  (Put(parts), ...);
  Put(dims);
  Put(type);
  return Value{std::string(), std::move(dims), type, next_++};
}

void Program::NoteView(const View& v, const char* role) {
  view_backends_.push_back({v.backend, op_});
  if (!bad_view_.empty()) return;
  const std::string of = op_ == nullptr ? std::string() : absl::StrCat(" of op ", op_);
  if (v.count <= 0 || v.allocation.storage == nullptr) {
    bad_view_ = absl::StrCat("an empty ", role, " view", of);
  } else if (v.offset < 0 || v.offset + v.bytes() > static_cast<int64_t>(v.allocation.bytes)) {
    bad_view_ = absl::StrCat("a ", role, " view", of, " (offset ", v.offset, ", ", v.bytes(),
                             " bytes) that does not fit in its allocation of ",
                             v.allocation.bytes, " bytes");
  }
}

absl::Status Program::CheckViews(const Backend* backend) const {
  std::string why = bad_view_;
  if (why.empty()) {
    for (const auto& [b, op] : view_backends_) {
      if (b != backend) {
        why = absl::StrCat("a view", op == nullptr ? "" : absl::StrCat(" of op ", op),
                           " that is not memory of this backend");
        break;
      }
    }
  }
  if (why.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("given ", why));
}

int Program::ArgIndex(const View& v) {
  for (size_t i = 0; i < args_.size(); ++i) {
    if (args_[i].storage == v.allocation.storage) return static_cast<int>(i);
  }
  Arg arg{v.allocation.storage, static_cast<int64_t>(v.allocation.bytes)};
  if (element_type_ != nullptr && v.allocation.storage != nullptr) arg.type = element_type_(v);
  if (arg.bytes % static_cast<int64_t>(DTypeSize(arg.type)) != 0) arg.type = DType::kU8;
  args_.push_back(arg);
  const auto i = static_cast<int64_t>(args_.size() - 1);
  // The argument itself: numbered -1 - i in a dry program's key.
  current_.push_back(Value{dry_ ? std::string() : absl::StrCat("%a", i), {arg.elements()},
                           ElementTypeOf(arg.type), -1 - i});
  return static_cast<int>(i);
}

Value Program::Param(int64_t index, const std::string& type) {
  if (dry_) {
    const Value s = Node({}, "i64", 'P', index);
    return type == "i64" ? s : Convert(Node({}, "f64", 'p', s), type);
  }
  Value one = Emit(absl::StrCat("\"stablehlo.slice\"(%params) {start_indices = array<i64: ", index,
                                ">, limit_indices = array<i64: ", index + 1,
                                ">, strides = array<i64: 1>} : (", kParamsType,
                                ") -> tensor<1xi64>"),
                   {1}, "i64");
  Value s = Reshape(one, {});
  if (type == "i64") return s;
  Value d = Emit(absl::StrCat("stablehlo.bitcast_convert ", s.id, " : (tensor<i64>) -> tensor<f64>"),
                 {}, "f64");
  return Convert(d, type);
}

Value Program::Scalar(double value, const std::string& type) {
  int64_t bits;
  std::memcpy(&bits, &value, 8);
  params_.push_back(bits);
  return Param(static_cast<int64_t>(params_.size()) - 1, type);
}

Value Program::HostF32(const std::vector<float>& values, std::vector<int64_t> dims) {
  const auto start = static_cast<int64_t>(params_.size());
  const auto k = static_cast<int64_t>(values.size());
  for (float f : values) {
    int32_t bits;
    std::memcpy(&bits, &f, 4);
    params_.push_back(bits);  // sign-extended: converts back to i32 exactly
  }
  if (dry_) return Node(std::move(dims), "f32", 'H', start, k);
  Value part = Emit(absl::StrCat("\"stablehlo.slice\"(%params) {start_indices = array<i64: ", start,
                                 ">, limit_indices = array<i64: ", start + k,
                                 ">, strides = array<i64: 1>} : (", kParamsType, ") -> ",
                                 Tensor({k}, "i64")),
                    {k}, "i64");
  Value bits = Convert(part, "i32");
  Value f = Emit(absl::StrCat("stablehlo.bitcast_convert ", bits.id, " : (", bits.tensor(), ") -> ",
                              Tensor({k}, "f32")),
                 {k}, "f32");
  return Reshape(f, std::move(dims));
}

Value Program::Offset(int64_t x) {
  params_.push_back(x);
  return Param(static_cast<int64_t>(params_.size()) - 1, "i64");
}

Value Program::DynamicSlice(const Value& a, const Value& offset, int64_t k) {
  if (dry_) return Node({k}, a.type, 'D', a, offset, k);
  return Emit(absl::StrCat("stablehlo.dynamic_slice ", a.id, ", ", offset.id, ", sizes = [", k,
                           "] : (", a.tensor(), ", tensor<i64>) -> ", Tensor({k}, a.type)),
              {k}, a.type);
}

Value Program::DynamicUpdate(const Value& a, const Value& update, const Value& offset) {
  if (dry_) return Node(a.dims, a.type, 'U', a, update, offset);
  return Emit(absl::StrCat("stablehlo.dynamic_update_slice ", a.id, ", ", update.id, ", ",
                           offset.id, " : (", a.tensor(), ", ", update.tensor(),
                           ", tensor<i64>) -> ", a.tensor()),
              a.dims, a.type);
}

namespace {
int64_t WidthOf(const std::string& type) {
  if (type == "ui8" || type == "i1") return 1;
  if (type == "bf16" || type == "f16") return 2;
  if (type == "f64" || type == "i64") return 8;
  return 4;
}
}  // namespace

Value Program::ToBytes(const Value& a) {
  if (a.type == "ui8") return a;
  const int64_t n = a.numel(), w = WidthOf(a.type);
  Value b;
  if (dry_) {
    b = Node({n, w}, "ui8", 'W', a);
  } else {
    b = Emit(absl::StrCat("stablehlo.bitcast_convert ", a.id, " : (", a.tensor(), ") -> ",
                          Tensor({n, w}, "ui8")),
             {n, w}, "ui8");
  }
  return Reshape(b, {n * w});
}

Value Program::FromBytes(const Value& bytes, const std::string& type) {
  if (type == "ui8") return bytes;
  const int64_t w = WidthOf(type), n = bytes.numel() / w;
  Value r = Reshape(bytes, {n, w});
  if (dry_) return Node({n}, type, 'N', r);
  return Emit(absl::StrCat("stablehlo.bitcast_convert ", r.id, " : (", r.tensor(), ") -> ",
                           Tensor({n}, type)),
              {n}, type);
}

Value Program::Load(const View& v, std::vector<int64_t> dims, const std::string& as) {
  NoteView(v, "input");
  const int a = ArgIndex(v);
  const Arg& arg = args_[a];
  const std::string dt = ElementTypeOf(v.dtype);
  const auto width = static_cast<int64_t>(DTypeSize(arg.type));
  Value typed;
  if (static_cast<int64_t>(DTypeSize(v.dtype)) == width && v.offset % width == 0) {
    // A slice of the typed array (bitcast when the view's type is another of that width).
    typed = DynamicSlice(current_[a], Offset(v.offset / width), v.count);
    if (typed.type != dt) typed = Bitcast(typed, dt);
  } else {
    // Through the array's bytes.
    typed = FromBytes(DynamicSlice(ToBytes(current_[a]), Offset(v.offset), v.bytes()), dt);
  }
  std::string want = as;
  if (want.empty()) want = (dt == "bf16" || dt == "f16") ? "f32" : dt;
  return Reshape(Convert(typed, want), std::move(dims));
}

void Program::Store(const View& v, const Value& x) {
  NoteView(v, "output");
  const int a = ArgIndex(v);
  const Arg& arg = args_[a];
  const std::string dt = ElementTypeOf(v.dtype);
  const auto width = static_cast<int64_t>(DTypeSize(arg.type));
  Value flat = Convert(Reshape(x, {v.count}), dt);
  // The value stored is what the op computes alone: XLA neither fuses it with the ops after it
  // in the program nor contracts across (so where a stream's programs begin and end, which
  // follows the runtime's schedule, does not change a bit of any result).
  if (dry_) {
    flat = Node(flat.dims, flat.type, 'O', flat);
  } else {
    flat = Emit(absl::StrCat("stablehlo.optimization_barrier ", flat.id, " : ", flat.tensor()),
                flat.dims, flat.type);
  }
  if (static_cast<int64_t>(DTypeSize(v.dtype)) == width && v.offset % width == 0) {
    if (flat.type != current_[a].type) flat = Bitcast(flat, current_[a].type);
    current_[a] = DynamicUpdate(current_[a], flat, Offset(v.offset / width));
  } else {
    const Value bytes = DynamicUpdate(ToBytes(current_[a]), ToBytes(flat), Offset(v.offset));
    current_[a] = FromBytes(bytes, current_[a].type);
  }
  args_[a].written = true;
}

Value Program::Input(std::vector<int64_t> dims, DType type) {
  const std::string t = ElementTypeOf(type);
  const auto i = static_cast<int64_t>(inputs_.size());
  Value v;
  if (dry_) {
    v = Node(std::move(dims), t, 'X', i);
  } else {
    v = Value{absl::StrCat("%x", i), std::move(dims), t, next_++};
  }
  inputs_.push_back(v);
  return v;
}

void Program::Output(const Value& x) {
  if (dry_) {
    key_.push_back('O');
    Put(x);
  }
  outputs_.push_back(x);
}

Value Program::Collective(const char* kind, const std::string& attributes, const char* op,
                          const Value& x, int64_t out_count, int ranks) {
  replicas_ = ranks;
  if (dry_) return Node({out_count}, x.type, 'K', kind, op == nullptr ? "" : op, ranks, x);
  std::vector<int64_t> r(static_cast<size_t>(ranks));
  for (int i = 0; i < ranks; ++i) r[static_cast<size_t>(i)] = i;
  const std::string groups = absl::StrCat("replica_groups = dense<[[", List(r),
                                          "]]> : tensor<1x", ranks, "xi64>");
  std::string region;
  if (op != nullptr) {
    const std::string s = Tensor({}, x.type);
    region = absl::StrCat(" ({\n    ^bb0(%lhs: ", s, ", %rhs: ", s, "):\n      %res = stablehlo.",
                          op, " %lhs, %rhs : ", s, "\n      stablehlo.return %res : ", s,
                          "\n    })");
  }
  return Emit(absl::StrCat("\"stablehlo.", kind, "\"(", x.id, ")", region, " {", attributes,
                           attributes.empty() ? "" : ", ", groups, "} : (", x.tensor(), ") -> ",
                           Tensor({out_count}, x.type)),
              {out_count}, x.type);
}

Value Program::AllGather(const Value& x, int ranks) {
  return Collective("all_gather", "all_gather_dim = 0 : i64", nullptr, x, x.numel() * ranks,
                    ranks);
}

Value Program::ReduceScatter(const Value& x, int ranks, const char* op) {
  return Collective("reduce_scatter", "scatter_dimension = 0 : i64", op, x, x.numel() / ranks,
                    ranks);
}

Value Program::AllReduce(const Value& x, int ranks, const char* op) {
  return Collective("all_reduce", "", op, x, x.numel(), ranks);
}

Value Program::AllToAll(const Value& x, int ranks) {
  return Collective("all_to_all",
                    absl::StrCat("split_dimension = 0 : i64, concat_dimension = 0 : i64, "
                                 "split_count = ", ranks, " : i64"),
                    nullptr, x, x.numel(), ranks);
}

Value Program::Constant(double value, const std::string& type, std::vector<int64_t> dims) {
  if (dry_) {
    int64_t bits;
    std::memcpy(&bits, &value, 8);
    return Node(std::move(dims), type, 'C', bits);
  }
  const std::string t = Tensor(dims, type);
  return Emit(absl::StrCat("stablehlo.constant dense<", Literal(value, type), "> : ", t),
              std::move(dims), type);
}

Value Program::Iota(std::vector<int64_t> dims, int64_t dim, const std::string& type) {
  if (dry_) return Node(std::move(dims), type, 'I', dim);
  const std::string t = Tensor(dims, type);
  return Emit(absl::StrCat("stablehlo.iota dim = ", dim, " : ", t), std::move(dims), type);
}

Value Program::Unary(const char* op, const Value& a) {
  if (dry_) return Node(a.dims, a.type, 'u', op, a);
  return Emit(absl::StrCat("stablehlo.", op, " ", a.id, " : ", a.tensor()), a.dims, a.type);
}

Value Program::Binary(const char* op, const Value& a, const Value& b) {
  if (dry_) return Node(a.dims, a.type, 'b', op, a, b);
  return Emit(absl::StrCat("stablehlo.", op, " ", a.id, ", ", b.id, " : ", a.tensor()), a.dims,
              a.type);
}

Value Program::Compare(const char* direction, const Value& a, const Value& b) {
  if (dry_) return Node(a.dims, "i1", 'c', direction, a, b);
  return Emit(absl::StrCat("stablehlo.compare  ", direction, ", ", a.id, ", ", b.id, " : (",
                           a.tensor(), ", ", b.tensor(), ") -> ", Tensor(a.dims, "i1")),
              a.dims, "i1");
}

Value Program::Select(const Value& pred, const Value& a, const Value& b) {
  if (dry_) return Node(a.dims, a.type, 's', pred, a, b);
  return Emit(absl::StrCat("\"stablehlo.select\"(", pred.id, ", ", a.id, ", ", b.id, ") : (",
                           pred.tensor(), ", ", a.tensor(), ", ", b.tensor(), ") -> ", a.tensor()),
              a.dims, a.type);
}

Value Program::Convert(const Value& a, const std::string& type) {
  if (a.type == type) return a;
  if (dry_) return Node(a.dims, type, 'v', a);
  return Emit(absl::StrCat("stablehlo.convert ", a.id, " : (", a.tensor(), ") -> ",
                           Tensor(a.dims, type)),
              a.dims, type);
}

Value Program::Bitcast(const Value& a, const std::string& type) {
  if (dry_) return Node(a.dims, type, 'B', a);
  return Emit(absl::StrCat("stablehlo.bitcast_convert ", a.id, " : (", a.tensor(), ") -> ",
                           Tensor(a.dims, type)),
              a.dims, type);
}

Value Program::RoundTo(const Value& a, DType d) {
  if (d == DType::kF32) return a;
  return Convert(Convert(a, ElementTypeOf(d)), a.type);
}

Value Program::Reshape(const Value& a, std::vector<int64_t> dims) {
  if (a.dims == dims) return a;
  if (dry_) return Node(std::move(dims), a.type, 'r', a);
  return Emit(absl::StrCat("stablehlo.reshape ", a.id, " : (", a.tensor(), ") -> ",
                           Tensor(dims, a.type)),
              dims, a.type);
}

Value Program::Broadcast(const Value& a, std::vector<int64_t> dims, std::vector<int64_t> map) {
  if (dry_) return Node(std::move(dims), a.type, 'x', a, map);
  return Emit(absl::StrCat("stablehlo.broadcast_in_dim ", a.id, ", dims = [", List(map), "] : (",
                           a.tensor(), ") -> ", Tensor(dims, a.type)),
              dims, a.type);
}

Value Program::BroadcastPrefix(const Value& a, const std::vector<int64_t>& dims) {
  if (a.dims == dims) return a;
  std::vector<int64_t> map(a.dims.size());
  for (size_t i = 0; i < map.size(); ++i) map[i] = static_cast<int64_t>(i);
  return Broadcast(a, dims, map);
}

Value Program::Transpose(const Value& a, std::vector<int64_t> perm) {
  std::vector<int64_t> dims(perm.size());
  for (size_t i = 0; i < perm.size(); ++i) dims[i] = a.dims[perm[i]];
  if (dry_) return Node(std::move(dims), a.type, 't', a, perm);
  return Emit(absl::StrCat("stablehlo.transpose ", a.id, ", dims = [", List(perm), "] : (",
                           a.tensor(), ") -> ", Tensor(dims, a.type)),
              dims, a.type);
}

Value Program::Slice(const Value& a, std::vector<int64_t> start, std::vector<int64_t> limit) {
  std::vector<int64_t> dims(start.size()), strides(start.size(), 1);
  for (size_t i = 0; i < start.size(); ++i) dims[i] = limit[i] - start[i];
  if (dims == a.dims) return a;
  if (dry_) return Node(std::move(dims), a.type, 'l', a, start, limit);
  return Emit(absl::StrCat("\"stablehlo.slice\"(", a.id, ") {start_indices = array<i64: ",
                           List(start), ">, limit_indices = array<i64: ", List(limit),
                           ">, strides = array<i64: ", List(strides), ">} : (", a.tensor(),
                           ") -> ", Tensor(dims, a.type)),
              dims, a.type);
}

Value Program::Concat(const std::vector<Value>& parts, int64_t dim) {
  if (parts.size() == 1) return parts[0];
  std::vector<int64_t> dims = parts[0].dims;
  dims[dim] = 0;
  for (const Value& p : parts) dims[dim] += p.dims[dim];
  if (dry_) return Node(std::move(dims), parts[0].type, 'k', parts, dim);
  std::vector<std::string> ids, types;
  for (const Value& p : parts) {
    ids.push_back(p.id);
    types.push_back(p.tensor());
  }
  return Emit(absl::StrCat("stablehlo.concatenate ", absl::StrJoin(ids, ", "), ", dim = ", dim,
                           " : (", absl::StrJoin(types, ", "), ") -> ",
                           Tensor(dims, parts[0].type)),
              dims, parts[0].type);
}

Value Program::Reduce(const Value& a, std::vector<int64_t> dims, const char* op) {
  const bool max = std::string(op) == "maximum";
  const Value init = Constant(max ? -INFINITY : 0.0, a.type);
  std::vector<int64_t> out;
  for (size_t i = 0; i < a.dims.size(); ++i) {
    bool reduced = false;
    for (int64_t d : dims) reduced |= d == static_cast<int64_t>(i);
    if (!reduced) out.push_back(a.dims[i]);
  }
  if (dry_) return Node(std::move(out), a.type, 'R', op, a, init, dims);
  return Emit(absl::StrCat("stablehlo.reduce(", a.id, " init: ", init.id, ") applies stablehlo.",
                           op, " across dimensions = [", List(dims), "] : (", a.tensor(), ", ",
                           init.tensor(), ") -> ", Tensor(out, a.type)),
              out, a.type);
}

Value Program::Dot(const Value& a, const Value& b, std::vector<int64_t> batch_a,
                   std::vector<int64_t> batch_b, std::vector<int64_t> contract_a,
                   std::vector<int64_t> contract_b) {
  auto in = [](const std::vector<int64_t>& v, int64_t x) {
    for (int64_t y : v) {
      if (y == x) return true;
    }
    return false;
  };
  std::vector<int64_t> dims;
  for (int64_t d : batch_a) dims.push_back(a.dims[d]);
  for (size_t i = 0; i < a.dims.size(); ++i) {
    const auto d = static_cast<int64_t>(i);
    if (!in(batch_a, d) && !in(contract_a, d)) dims.push_back(a.dims[i]);
  }
  for (size_t i = 0; i < b.dims.size(); ++i) {
    const auto d = static_cast<int64_t>(i);
    if (!in(batch_b, d) && !in(contract_b, d)) dims.push_back(b.dims[i]);
  }
  if (dry_) return Node(std::move(dims), a.type, 'D', a, b, batch_a, batch_b, contract_a, contract_b);
  std::string rhs = absl::StrCat("stablehlo.dot_general ", a.id, ", ", b.id, ", ");
  if (!batch_a.empty()) {
    absl::StrAppend(&rhs, "batching_dims = [", List(batch_a), "] x [", List(batch_b), "], ");
  }
  absl::StrAppend(&rhs, "contracting_dims = [", List(contract_a), "] x [", List(contract_b),
                  "], precision = [HIGHEST, HIGHEST] : (", a.tensor(), ", ", b.tensor(), ") -> ",
                  Tensor(dims, a.type));
  return Emit(rhs, dims, a.type);
}

Value Program::Gather(const Value& table, const Value& idx) {
  const int64_t N = idx.numel(), C = table.dims[1];
  const Value i2 = Reshape(idx, {N, 1});
  if (dry_) return Node({N, C}, table.type, 'G', table, i2);
  return Emit(absl::StrCat("\"stablehlo.gather\"(", table.id, ", ", i2.id,
                           ") {dimension_numbers = #stablehlo.gather<offset_dims = [1], "
                           "collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = "
                           "1>, indices_are_sorted = false, slice_sizes = array<i64: 1, ",
                           C, ">} : (", table.tensor(), ", ", i2.tensor(), ") -> ",
                           Tensor({N, C}, table.type)),
              {N, C}, table.type);
}

Value Program::ScatterAdd(const Value& table, const Value& idx, const Value& upd) {
  const int64_t N = idx.numel();
  const Value i2 = Reshape(idx, {N, 1});
  if (dry_) return Node(table.dims, table.type, 'A', table, i2, upd);
  const std::string s = Tensor({}, table.type);
  return Emit(absl::StrCat("\"stablehlo.scatter\"(", table.id, ", ", i2.id, ", ", upd.id,
                           ") ({\n    ^bb0(%x: ", s, ", %y: ", s, "):\n      %z = stablehlo.add "
                           "%x, %y : ", s, "\n      stablehlo.return %z : ", s,
                           "\n    }) {indices_are_sorted = false, scatter_dimension_numbers = "
                           "#stablehlo.scatter<update_window_dims = [1], inserted_window_dims = "
                           "[0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, "
                           "unique_indices = false} : (",
                           table.tensor(), ", ", i2.tensor(), ", ", upd.tensor(), ") -> ",
                           table.tensor()),
              table.dims, table.type);
}

std::string Program::Key() const {
  std::vector<int64_t> k = key_;
  k.push_back(static_cast<int64_t>(params_.size()));
  k.push_back(replicas_);
  for (size_t i = 0; i < args_.size(); ++i) {
    k.push_back(args_[i].bytes);
    k.push_back(static_cast<int64_t>(args_[i].type));
    k.push_back(args_[i].written ? current_[i].num : -2);
  }
  std::string out = absl::StrCat(name_, ":");
  out.append(reinterpret_cast<const char*>(k.data()), k.size() * sizeof(int64_t));
  return out;
}

std::string Program::Text() const {
  std::vector<std::string> sig, ret_ids, ret_types;
  int out = 0;
  for (size_t i = 0; i < args_.size(); ++i) {
    const std::string t = Tensor({args_[i].elements()}, ElementTypeOf(args_[i].type));
    if (args_[i].written) {
      sig.push_back(absl::StrCat("%a", i, ": ", t, " {tf.aliasing_output = ", out++, " : i32}"));
      ret_ids.push_back(current_[i].id);
      ret_types.push_back(t);
    } else {
      sig.push_back(absl::StrCat("%a", i, ": ", t));
    }
  }
  for (const Value& x : inputs_) sig.push_back(absl::StrCat(x.id, ": ", x.tensor()));
  for (const Value& y : outputs_) {
    ret_ids.push_back(y.id);
    ret_types.push_back(y.tensor());
  }
  const std::string params_t = Tensor({static_cast<int64_t>(params_.size())}, "i64");
  sig.push_back(absl::StrCat("%params: ", params_t));
  std::string body = absl::StrReplaceAll(body_, {{kParamsType, params_t}});
  return absl::StrCat(
      "module @fsdp_", name_, " attributes {mhlo.num_replicas = ", replicas_,
      " : i32, mhlo.num_partitions = 1 : i32} {\n"
      "  func.func public @main(",
      absl::StrJoin(sig, ", "), ") -> (", absl::StrJoin(ret_types, ", "), ") {\n", body,
      "    return ", absl::StrJoin(ret_ids, ", "), " : ", absl::StrJoin(ret_types, ", "),
      "\n  }\n}\n");
}

}  // namespace fsdp::pjrt
