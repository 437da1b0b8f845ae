// Column-major GEMMs through cuBLASLt for the Linear ops: D = alpha * op(A) op(B) + beta * D,
// A and B in f32, bf16 or f16, D in f32, products accumulated in f32 (TF32 for f32 inputs
// only when allowed). Plans (descriptors, layouts and the heuristic's algorithm) are cached
// per shape, so a step's GEMMs after the first run without a heuristic query.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "fsdp/dtype.h"
#include "fsdp/status.h"

namespace fsdp::cuda_internal {

struct GemmShape {
  bool trans_a = false;  // op(A) = A^T
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;  // op(A) is m x k, op(B) is k x n, D is m x n
  int64_t lda = 0, ldb = 0, ldd = 0;
  DType ab = DType::kF32;  // A and B
  bool accumulate = false;  // beta = 1 (else 0)
  // Alignment of the A, B and D pointers in bytes (a power of two up to 16), set by Run: the
  // heuristic must not pick a kernel that needs more than the views give.
  int align_a = 16, align_b = 16, align_d = 16;
  auto key() const {
    return std::tie(trans_a, trans_b, m, n, k, lda, ldb, ldd, ab, accumulate, align_a, align_b,
                    align_d);
  }
  bool operator<(const GemmShape& o) const { return key() < o.key(); }
};

class Gemm {
 public:
  // A handle and a workspace on the calling thread's current device.
  static absl::StatusOr<std::unique_ptr<Gemm>> Create(bool allow_tf32);
  ~Gemm();
  // Enqueues D = op(A) op(B) (+ D when shape.accumulate) on `stream`, which is lane 0 or 1
  // (each lane has its own workspace, so GEMMs on the two streams may run at once).
  absl::Status Run(cudaStream_t stream, int lane, const GemmShape& shape, const void* a,
                   const void* b, float* d);

 private:
  struct Plan;
  Gemm() = default;
  absl::StatusOr<const Plan*> PlanFor(const GemmShape& shape);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_[2] = {nullptr, nullptr};
  size_t workspace_bytes_ = 0;
  bool allow_tf32_ = false;
  std::mutex mu_;
  std::map<GemmShape, std::unique_ptr<Plan>> plans_;
};

}  // namespace fsdp::cuda_internal
