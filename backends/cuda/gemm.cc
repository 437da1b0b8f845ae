#include "backends/cuda/gemm.h"

#include "absl/strings/str_cat.h"
#include "backends/cuda/cuda_internal.h"

namespace fsdp::cuda_internal {
namespace {

absl::Status LtStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("cuBLASLt ", what, ": ", cublasLtGetStatusName(s), ": ",
                                          cublasLtGetStatusString(s)));
}

cudaDataType_t CudaType(DType d) {
  switch (d) {
    case DType::kBF16:
      return CUDA_R_16BF;
    case DType::kF16:
      return CUDA_R_16F;
    default:
      return CUDA_R_32F;
  }
}

constexpr size_t kWorkspaceBytes = size_t{32} << 20;

int Alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int align = 16;
  while (align > 1 && a % static_cast<uintptr_t>(align) != 0) align /= 2;
  return align;
}

}  // namespace

struct Gemm::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (a != nullptr) cublasLtMatrixLayoutDestroy(a);
    if (b != nullptr) cublasLtMatrixLayoutDestroy(b);
    if (d != nullptr) cublasLtMatrixLayoutDestroy(d);
    if (desc != nullptr) cublasLtMatmulDescDestroy(desc);
  }
};

absl::StatusOr<std::unique_ptr<Gemm>> Gemm::Create(bool allow_tf32) {
  std::unique_ptr<Gemm> g(new Gemm());
  g->allow_tf32_ = allow_tf32;
  FSDP_RETURN_IF_ERROR(LtStatus(cublasLtCreate(&g->handle_), "create"));
  for (void*& w : g->workspace_) {
    FSDP_RETURN_IF_ERROR(CudaStatus(cudaMalloc(&w, kWorkspaceBytes), "cuBLASLt workspace"));
  }
  g->workspace_bytes_ = kWorkspaceBytes;
  return g;
}

Gemm::~Gemm() {
  plans_.clear();
  for (void* w : workspace_) {
    if (w != nullptr) cudaFree(w);
  }
  if (handle_ != nullptr) cublasLtDestroy(handle_);
}

absl::StatusOr<const Gemm::Plan*> Gemm::PlanFor(const GemmShape& s) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(s);
  if (it != plans_.end()) return it->second.get();
  auto plan = std::make_unique<Plan>();
  const cublasComputeType_t compute =
      s.ab == DType::kF32 && allow_tf32_ ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  FSDP_RETURN_IF_ERROR(LtStatus(cublasLtMatmulDescCreate(&plan->desc, compute, CUDA_R_32F), "matmul desc"));
  const cublasOperation_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  FSDP_RETURN_IF_ERROR(LtStatus(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)),
      "transa"));
  FSDP_RETURN_IF_ERROR(LtStatus(
      cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)),
      "transb"));
  const cudaDataType_t ab = CudaType(s.ab);
  // Stored shapes (column-major): A is m x k, or k x m when transposed; likewise B.
  FSDP_RETURN_IF_ERROR(LtStatus(cublasLtMatrixLayoutCreate(&plan->a, ab, s.trans_a ? s.k : s.m,
                                                           s.trans_a ? s.m : s.k, s.lda),
                                "layout A"));
  FSDP_RETURN_IF_ERROR(LtStatus(cublasLtMatrixLayoutCreate(&plan->b, ab, s.trans_b ? s.n : s.k,
                                                           s.trans_b ? s.k : s.n, s.ldb),
                                "layout B"));
  FSDP_RETURN_IF_ERROR(
      LtStatus(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_32F, s.m, s.n, s.ldd), "layout D"));
  cublasLtMatmulPreference_t pref = nullptr;
  FSDP_RETURN_IF_ERROR(LtStatus(cublasLtMatmulPreferenceCreate(&pref), "preference"));
  size_t ws = workspace_bytes_;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                       sizeof(ws));
  const uint32_t align[3] = {static_cast<uint32_t>(s.align_a), static_cast<uint32_t>(s.align_b),
                             static_cast<uint32_t>(s.align_d)};
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align[0],
                                       sizeof(uint32_t));
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align[1],
                                       sizeof(uint32_t));
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &align[2], sizeof(uint32_t));
  }
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t hs = cublasLtMatmulAlgoGetHeuristic(handle_, plan->desc, plan->a, plan->b,
                                                           plan->d, plan->d, pref, 1, &result,
                                                           &found);
  cublasLtMatmulPreferenceDestroy(pref);
  FSDP_RETURN_IF_ERROR(LtStatus(hs, "heuristic"));
  if (found == 0) {
    return absl::InternalError(absl::StrCat("cuBLASLt has no algorithm for a ", std::string(DTypeName(s.ab)),
                                            " GEMM of m=", s.m, " n=", s.n, " k=", s.k));
  }
  plan->algo = result.algo;
  const Plan* p = plan.get();
  plans_.emplace(s, std::move(plan));
  return p;
}

absl::Status Gemm::Run(cudaStream_t stream, int lane, const GemmShape& shape, const void* a,
                       const void* b, float* d) {
  GemmShape s = shape;
  s.align_a = Alignment(a);
  s.align_b = Alignment(b);
  s.align_d = Alignment(d);
  if (s.m == 0 || s.n == 0) return absl::OkStatus();
  if (s.k == 0) {
    if (s.accumulate) return absl::OkStatus();
    // D = 0: an empty product.
    return CudaStatus(cudaMemset2DAsync(d, static_cast<size_t>(s.ldd) * sizeof(float), 0,
                                        static_cast<size_t>(s.m) * sizeof(float),
                                        static_cast<size_t>(s.n), stream),
                      "GEMM with k = 0");
  }
  FSDP_ASSIGN_OR_RETURN(const Plan* plan, PlanFor(s));
  const float alpha = 1.0f;
  const float beta = s.accumulate ? 1.0f : 0.0f;
  return LtStatus(cublasLtMatmul(handle_, plan->desc, &alpha, a, plan->a, b, plan->b, &beta, d,
                                 plan->d, d, plan->d, &plan->algo, workspace_[lane & 1], workspace_bytes_,
                                 stream),
                  "matmul");
}

}  // namespace fsdp::cuda_internal
