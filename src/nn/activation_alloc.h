// Allocates a model's activation buffers on a backend and counts their bytes, or, without a
// backend, only counts them: the same allocation code then gives the memory planner the exact
// figure the model would hold.
#pragma once

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/backend.h"
#include "fsdp/dtype.h"
#include "fsdp/status.h"
#include "src/core/checked.h"

namespace fsdp::nn::internal {

class ActivationAllocator {
 public:
  // backend == nullptr: count only (buffers stay empty).
  ActivationAllocator(Backend* backend, const char* model, int64_t* bytes)
      : backend_(backend), model_(model), bytes_(bytes) {}
  // A buffer of n_1 x n_2 x ... floats (or int32). The product and the running total are
  // checked: sizes (a B x T x ... too large) whose bytes do not fit in int64 are an error, in
  // counting as in allocating, never a wrapped size.
  template <typename... N>
  absl::Status operator()(Buffer& b, N... factors) {
    return Typed(b, DType::kF32, factors...);
  }
  // The same for n_1 x n_2 x ... elements of `dtype`.
  template <typename... N>
  absl::Status Typed(Buffer& b, DType dtype, N... factors) {
    int64_t want = 0, total = 0;
    if (!fsdp::internal::CheckedProduct(
            {static_cast<int64_t>(DTypeSize(dtype)), static_cast<int64_t>(factors)...}, &want) ||
        !fsdp::internal::CheckedAdd(*bytes_, want, &total)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the ", model_, "'s activations come to more than 2^63 - 1 bytes (8 EiB) (",
          *bytes_, " bytes before a buffer of ", absl::StrJoin({static_cast<int64_t>(factors)...}, " x "),
          " elements); give a smaller batch or sequence"));
    }
    if (backend_ == nullptr) {
      *bytes_ = total;
      return absl::OkStatus();
    }
    auto r = Buffer::Create(backend_, static_cast<size_t>(want));
    if (!r.ok()) {
      return absl::Status(r.status().code(),
                          absl::StrCat("allocating the ", model_, "'s activations (", *bytes_,
                                       " bytes so far, this buffer ", want,
                                       "): ", r.status().message()));
    }
    b = std::move(*r);
    *bytes_ += static_cast<int64_t>(b.bytes());
    return absl::OkStatus();
  }
  bool counting_only() const { return backend_ == nullptr; }

 private:
  Backend* backend_;
  const char* model_;
  int64_t* bytes_;
};

}  // namespace fsdp::nn::internal
