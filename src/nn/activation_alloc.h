// Allocates a model's activation buffers on a backend and counts their bytes, or, without a
// backend, only counts them: the same allocation code then gives the memory planner the exact
// figure the model would hold.
#pragma once

#include <cstdint>

#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"
#include "fsdp/status.h"

namespace fsdp::nn::internal {

class ActivationAllocator {
 public:
  // backend == nullptr: count only (buffers stay empty).
  ActivationAllocator(Backend* backend, const char* model, int64_t* bytes)
      : backend_(backend), model_(model), bytes_(bytes) {}
  // A buffer of n floats (or n int32).
  absl::Status operator()(Buffer& b, int64_t n) {
    const int64_t want = n * static_cast<int64_t>(sizeof(float));
    if (backend_ == nullptr) {
      *bytes_ += want;
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
