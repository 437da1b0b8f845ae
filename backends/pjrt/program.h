// Builds one StableHLO program of the PJRT backend's ops from their views: one op's, or the
// ops a stream ran back to back (pjrt_ops.h), added one after the other.
//
// Device memory is a typed 1-D array per allocation: f32[n], bf16[n], ... (ui8[bytes] only for
// memory first reached as bytes); the backend says which (ElementTypeFn). A Program takes
// every allocation its views touch as one argument (views of the same allocation share it),
// and one i64 array of run-time values: the offset of each view (in elements of the array
// where the view's dtype has the array's width and starts on an element, else in bytes) and
// the ops' float scalars (as the bits of a double). So the program text depends on sizes,
// types and which views share an allocation, not on offsets or scalar values, and the client's
// cache compiles it once per structure.
//
// Load() reads a view as a typed tensor (the allocation's latest value in the program: after
// the stores of the ops before); Store() converts a tensor to the view's dtype and writes it.
// A view of the array's element type is a dynamic slice of it; one of another type of the same
// width is that slice bitcast; any other view goes through the array's bytes (bitcast to ui8
// and back inside the program). An allocation that is stored to is donated and returned: the
// backend replaces its buffer with the output.
//
// Input() and Output() are extra arguments and results (host copies of part of an
// allocation); the collectives make the program one of `ranks` replicas.
//
// The rest is a small typed emitter: each call appends one line and returns its SSA value. A
// dry program appends no text: it records the same arguments and run-time values, and its
// structure as integers (Key()), for finding the executable compiled before.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/status.h"

namespace fsdp::pjrt {

// The StableHLO element type of a dtype ("f32", "bf16", "f16", "f64", "i32", "i64", "ui8").
std::string ElementTypeOf(DType d);

// An SSA value: its name and tensor type.
struct Value {
  std::string id;  // empty in a dry program
  std::vector<int64_t> dims;
  std::string type;  // element type
  int64_t num = -1;  // its number in the program
  int64_t numel() const;
  std::string tensor() const;  // e.g. "tensor<4x8xf32>"
};

// The element type of the array that holds a view's allocation (the backend decides it once
// per allocation). Without one every allocation is ui8[bytes].
using ElementTypeFn = std::function<DType(const View&)>;

class Program {
 public:
  // A dry program builds no text: it records its arguments and run-time values, and its
  // structure as integers (Key()), which is all a launch of a program compiled before needs.
  explicit Program(std::string name, bool dry = false, ElementTypeFn element_type = nullptr)
      : name_(std::move(name)), dry_(dry), element_type_(std::move(element_type)) {}

  // Names the op whose views come next (for the message of a bad view in a program of
  // several ops).
  void BeginOp(const char* op) { op_ = op; }

  // ---- memory ------------------------------------------------------------------------------
  // The view's elements as a tensor of `dims` (their product must be the view's count),
  // converted to `as` (floats to f32 by default; i32 and f64 views keep their type).
  Value Load(const View& v, std::vector<int64_t> dims, const std::string& as = "");
  // Writes x (any shape, v.count elements) to the view, converted to its dtype.
  void Store(const View& v, const Value& x);
  // A float scalar given at run time (not part of the program text), as `type`.
  Value Scalar(double value, const std::string& type = "f32");
  // Host floats given at run time as an f32 tensor of `dims` (small tables, e.g. RoPE's).
  Value HostF32(const std::vector<float>& values, std::vector<int64_t> dims);
  // An extra argument of `dims` and `type`, after the allocations (the caller passes its
  // buffer: Input i is the launch's argument args().size() + i).
  Value Input(std::vector<int64_t> dims, DType type);
  // An extra result, after the written allocations.
  void Output(const Value& x);

  // ---- collectives over `ranks` replicas (replica r = rank r; the program becomes one of
  // `ranks` replicas). 1-D operands. op: "add" or "maximum".
  Value AllGather(const Value& x, int ranks);
  Value ReduceScatter(const Value& x, int ranks, const char* op);
  Value AllReduce(const Value& x, int ranks, const char* op);
  Value AllToAll(const Value& x, int ranks);

  // ---- values ------------------------------------------------------------------------------
  Value Constant(double value, const std::string& type, std::vector<int64_t> dims = {});
  Value Iota(std::vector<int64_t> dims, int64_t dim, const std::string& type);
  Value Unary(const char* op, const Value& a);            // "exponential", "tanh", "sqrt", ...
  Value Binary(const char* op, const Value& a, const Value& b);  // same shapes: "add", ...
  Value Add(const Value& a, const Value& b) { return Binary("add", a, b); }
  Value Sub(const Value& a, const Value& b) { return Binary("subtract", a, b); }
  Value Mul(const Value& a, const Value& b) { return Binary("multiply", a, b); }
  Value Div(const Value& a, const Value& b) { return Binary("divide", a, b); }
  Value Max(const Value& a, const Value& b) { return Binary("maximum", a, b); }
  Value Compare(const char* direction, const Value& a, const Value& b);  // "LT", "EQ", ...
  Value Select(const Value& pred, const Value& a, const Value& b);
  Value Convert(const Value& a, const std::string& type);
  // The same bits as another element type of the same width (ui8 <-> f8E4M3FN).
  Value Bitcast(const Value& a, const std::string& type);
  // Rounds f32 to `type` (bf16 / f16, nearest even) and back: the value a kernel computing in
  // that dtype reads. f32 returns a.
  Value RoundTo(const Value& a, DType d);
  Value Reshape(const Value& a, std::vector<int64_t> dims);
  // a broadcast to `dims`; a's dimension i becomes dimension map[i].
  Value Broadcast(const Value& a, std::vector<int64_t> dims, std::vector<int64_t> map);
  // A scalar (rank 0) or a value broadcast along trailing / leading dims as needed: a of dims
  // equal to a prefix of `dims` is broadcast along the rest.
  Value BroadcastPrefix(const Value& a, const std::vector<int64_t>& dims);
  Value Transpose(const Value& a, std::vector<int64_t> perm);
  Value Slice(const Value& a, std::vector<int64_t> start, std::vector<int64_t> limit);
  Value Concat(const std::vector<Value>& parts, int64_t dim);
  // Sums (or maxima) over `dims`, in a's type. "add" or "maximum".
  Value Reduce(const Value& a, std::vector<int64_t> dims, const char* op = "add");
  // dot_general at HIGHEST precision: batch dims, then a's free dims, then b's free dims.
  Value Dot(const Value& a, const Value& b, std::vector<int64_t> batch_a,
            std::vector<int64_t> batch_b, std::vector<int64_t> contract_a,
            std::vector<int64_t> contract_b);
  // a[idx[n], :] for a of [V, C] and idx of [N] i32: [N, C].
  Value Gather(const Value& table, const Value& idx);
  // table with table[idx[n], :] += upd[n, :] (a of [V, C], idx [N] i32, upd [N, C]).
  Value ScatterAdd(const Value& table, const Value& idx, const Value& upd);

  // ---- the program ---------------------------------------------------------------------------
  // The module text (one function @main(args..., params) -> written args). Not of a dry
  // program.
  std::string Text() const;
  // The program's structure: every node with its operands, attributes, shapes and types, the
  // arguments' sizes and which are written, the number of run-time values; two programs with
  // the same key have the same text, whatever their offsets and scalars. Of a dry program.
  std::string Key() const;
  struct Arg {
    void* storage;      // Allocation::storage
    int64_t bytes;      // the allocation's size
    DType type = DType::kU8;  // of its array: type[bytes / size of type]
    bool written = false;
    int64_t elements() const { return bytes / static_cast<int64_t>(DTypeSize(type)); }
  };
  const std::vector<Arg>& args() const { return args_; }
  const std::vector<int64_t>& params() const { return params_; }
  const std::string& name() const { return name_; }
  // The first bad view given to Load or Store (not memory of `backend`, or outside its
  // allocation); OK when every view is good.
  absl::Status CheckViews(const Backend* backend) const;

 private:
  std::string Fresh();
  Value Emit(const std::string& rhs, std::vector<int64_t> dims, const std::string& type);
  // A node of a dry program: a code, then its operands and attributes, into key_.
  template <typename... T>
  Value Node(std::vector<int64_t> dims, const std::string& type, int64_t code, const T&... parts);
  void Put(int64_t x) { key_.push_back(x); }
  void Put(const char* s);
  void Put(const std::string& s) { Put(s.c_str()); }
  void Put(const std::vector<int64_t>& v);
  void Put(const Value& v) { key_.push_back(v.num); }
  void Put(const std::vector<Value>& vs);
  int ArgIndex(const View& v);
  Value Param(int64_t index, const std::string& type);  // params[index] as a scalar
  // The run-time value `x` as an i64 scalar.
  Value Offset(int64_t x);
  Value DynamicSlice(const Value& a, const Value& offset, int64_t k);
  Value DynamicUpdate(const Value& a, const Value& update, const Value& offset);
  Value ToBytes(const Value& a);  // 1-D a as ui8[a.numel() * width]
  Value FromBytes(const Value& bytes, const std::string& type);  // the inverse
  Value Collective(const char* kind, const std::string& attributes, const char* op,
                   const Value& x, int64_t out_count, int ranks);

  void NoteView(const View& v, const char* role);

  std::string name_;
  const bool dry_;
  const ElementTypeFn element_type_;
  const char* op_ = nullptr;
  int replicas_ = 1;
  std::vector<int64_t> key_;            // a dry program's structure
  std::vector<Arg> args_;
  std::vector<Value> inputs_, outputs_;
  std::vector<std::pair<const Backend*, const char*>> view_backends_;  // and the op
  std::string bad_view_;
  std::vector<Value> current_;  // each argument's latest value (after stores)
  std::vector<int64_t> params_;
  std::string body_;
  int next_ = 0;
};

}  // namespace fsdp::pjrt
