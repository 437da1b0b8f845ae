// The generic parts of the device contract (fsdp/backend.h): views, buffers, events and the
// counted host synchronisations.
#include "fsdp/backend.h"
#include "fsdp/ops.h"

#include <cassert>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace fsdp {

std::string_view StreamName(Stream s) { return s == Stream::kCompute ? "compute" : "comm"; }

std::string_view ModelOpName(ModelOp op) {
  switch (op) {
    case ModelOp::kMatmul: return "matmul";
    case ModelOp::kLayernorm: return "layernorm";
    case ModelOp::kGelu: return "gelu";
    case ModelOp::kAttention: return "attention";
    case ModelOp::kGqaAttention: return "gqa_attention";
    case ModelOp::kRmsnorm: return "rmsnorm";
    case ModelOp::kRope: return "rope";
    case ModelOp::kSwiglu: return "swiglu";
    case ModelOp::kSoftmaxCrossEntropy: return "softmax_cross_entropy";
    case ModelOp::kEmbedding: return "embedding";
    case ModelOp::kElementwise: return "elementwise";
  }
  return "unknown";
}

namespace {
[[noreturn]] void NoWireFormat(const char* op, WireFormat format) {
  std::fprintf(stderr,
               "fsdp: RuntimeOps::%s(%s) on a backend that does not support that wire format: "
               "check supports_wire_format() first\n",
               op, std::string(WireFormatName(format)).c_str());
  std::abort();
}
}  // namespace

void RuntimeOps::QuantizeBlocks(Stream, View, View, View, int64_t, WireFormat format) {
  NoWireFormat("QuantizeBlocks", format);
}
void RuntimeOps::DequantizeBlocks(Stream, View, View, View, int64_t, WireFormat format) {
  NoWireFormat("DequantizeBlocks", format);
}

Ops& Backend::ops() {
  Ops* o = model_ops();
  if (o == nullptr) {
    std::fprintf(stderr,
                 "fsdp: Backend::ops() on the %s backend, which is runtime-only (no model ops): "
                 "check model_ops() first\n",
                 std::string(name()).c_str());
    std::abort();
  }
  return *o;
}

View View::Slice(int64_t begin, int64_t n) const {
  assert(begin >= 0 && n >= 0 && begin + n <= count);
  View v = *this;
  v.offset = offset + begin * static_cast<int64_t>(DTypeSize(dtype));
  v.count = n;
  return v;
}

View View::As(DType d) const {
  View v = *this;
  v.dtype = d;
  v.count = bytes() / static_cast<int64_t>(DTypeSize(d));
  assert(v.bytes() == bytes());
  return v;
}

void* View::host() const {
  if (backend == nullptr || !backend->is_host() || allocation.storage == nullptr) return nullptr;
  return static_cast<char*>(allocation.storage) + offset;
}

absl::StatusOr<Buffer> Buffer::Create(Backend* backend, size_t bytes) {
  if (backend == nullptr) return absl::InvalidArgumentError("Buffer::Create: backend is null");
  Buffer b;
  FSDP_ASSIGN_OR_RETURN(b.allocation_, backend->Allocate(bytes));
  b.backend_ = backend;
  return b;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    Reset();
    backend_ = o.backend_;
    allocation_ = o.allocation_;
    o.backend_ = nullptr;
    o.allocation_ = Allocation{};
  }
  return *this;
}

void Buffer::Reset() {
  if (backend_ != nullptr && allocation_.address != nullptr) backend_->Free(allocation_);
  backend_ = nullptr;
  allocation_ = Allocation{};
}

View Buffer::view(DType dtype) const {
  View v;
  v.backend = backend_;
  v.allocation = allocation_;
  v.dtype = dtype;
  v.count = static_cast<int64_t>(allocation_.bytes / DTypeSize(dtype));
  return v;
}

void* Buffer::data() const {
  return backend_ != nullptr && backend_->is_host() ? allocation_.storage : nullptr;
}

std::optional<std::chrono::steady_clock::time_point> Event::completed_at() const {
  if (state_ == nullptr || !state_->Done()) return std::nullopt;
  return state_->completed_at();
}

absl::StatusOr<View> WrapHostMemory(Backend* backend, void* p, int64_t count, DType dtype) {
  if (backend == nullptr || !backend->is_host()) {
    return absl::FailedPreconditionError(
        "WrapHostMemory: backend '" + std::string(backend == nullptr ? "null" : backend->name()) +
        "' is not a host backend; copy host data to its memory with Backend::CopyFromHost");
  }
  if (count < 0 || (count > 0 && p == nullptr)) {
    return absl::InvalidArgumentError("WrapHostMemory: null pointer or negative count");
  }
  View v;
  v.backend = backend;
  v.allocation.address = p;
  v.allocation.storage = p;
  v.allocation.bytes = static_cast<size_t>(count) * DTypeSize(dtype);
  v.count = count;
  v.dtype = dtype;
  return v;
}

absl::StatusOr<View> Backend::WrapNativeMemory(void* p, int64_t count, DType dtype) {
  if (is_host()) return WrapHostMemory(this, p, count, dtype);
  return absl::UnimplementedError(absl::StrCat(
      "the ", std::string(name()),
      " backend cannot adopt memory allocated outside it; copy into its buffers with "
      "CopyFromHost"));
}

absl::Status Backend::CopyToHost(void* dst, View src, Stream s) {
  CountHostSync();
  return DoCopyToHost(dst, src, s);
}

absl::Status Backend::CopyToHostAsync(void* dst, View src, Stream s) {
  return CopyToHost(dst, src, s);
}

absl::Status Backend::CopyFromHostAsync(View dst, const void* src, Stream s) {
  return CopyFromHost(dst, src, s);
}

absl::Status Backend::PinHostMemory(void* /*p*/, size_t /*bytes*/) { return absl::OkStatus(); }

void Backend::UnpinHostMemory(void* /*p*/) {}

absl::Status Backend::Sync(const Event& e) {
  CountHostSync();
  return e.Wait();
}

absl::Status Backend::Synchronize() {
  CountHostSync();
  const Event compute = Record(Stream::kCompute), comm = Record(Stream::kComm);
  absl::Status s = compute.Wait();
  absl::Status c = comm.Wait();
  return s.ok() ? c : s;
}

}  // namespace fsdp
