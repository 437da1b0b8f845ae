// The op table of the CUDA backend: each op checks its views, then enqueues CUDA kernels
// (kernels/cuda/kernels.h) or cuBLASLt GEMMs (gemm.h) on its stream. A bad view or a failed
// launch fails the backend with the op's name (cuda_backend.h, "Errors"); after a failure ops
// issue nothing.
#include <cuda_runtime_api.h>

#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends/common/checked_ops.h"
#include "backends/cuda/cuda_internal.h"
#include "backends/cuda/gemm.h"
#include "kernels/cuda/kernels.h"

namespace fsdp::cuda_internal {
namespace {

namespace k = ::fsdp::kernels::cuda;

float* F32(const View& v) { return reinterpret_cast<float*>(Ptr(v)); }
const int32_t* I32(const View& v) { return reinterpret_cast<const int32_t*>(Ptr(v)); }
uint16_t* U16(const View& v) { return reinterpret_cast<uint16_t*>(Ptr(v)); }
double* F64(const View& v) { return reinterpret_cast<double*>(Ptr(v)); }

int KernelDType(DType d) { return d == DType::kBF16 ? 1 : d == DType::kF16 ? 2 : 0; }

class CudaOps final : public Ops {
 public:
  explicit CudaOps(CudaBackend* b) : b_(b) {}

  // ---- Linear ----------------------------------------------------------------------------------
  // Row-major out[M,N] = inp[M,K] . W[N,K]^T is column-major out^T[N,M] = W^T... as cuBLASLt
  // sees the same bytes: D (N x M, ld N) = op(A) op(B) with A = W stored K x N (op T) and
  // B = inp stored K x M (op N).
  void MatmulForward(Stream s, View out, View inp, View weight, View bias, int64_t M, int64_t K,
                     int64_t N) override {
    if (!Begin(__func__, s, {out, inp, weight, bias})) return;
    const DType d = weight.dtype;
    Scratch rounded;
    const void* b_operand = Ptr(inp);
    if (d != DType::kF32 && inp.dtype != d) {  // else a kept copy in d, read as is
      if (!Round(__func__, s, inp, M * K, d, &rounded)) return;
      b_operand = rounded.get();
    }
    if (!bias.empty()) k::bias_broadcast(stream(s), F32(out), Ptr(bias), KernelDType(d), M, N);
    GemmShape g{.trans_a = true, .trans_b = false, .m = N, .n = M, .k = K, .lda = K, .ldb = K,
                .ldd = N, .ab = d, .accumulate = !bias.empty()};
    RunGemm(__func__, s, g, Ptr(weight), b_operand, F32(out));
    End(__func__);
  }
  // dinp^T (K x M) += W^T (stored K x N, op N) . dout^T (stored N x M, op N);
  // dweight^T (K x N) += inp^T (stored K x M, op N) . dout (stored N x M, op T).
  void MatmulBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                      View weight, int64_t M, int64_t K, int64_t N) override {
    if (!Begin(__func__, s, {dinp, dweight, dbias, dout, inp, weight})) return;
    const DType d = weight.dtype;
    Scratch dout_r, inp_r;
    const void* go = Ptr(dout);
    const void* in = Ptr(inp);
    if (d != DType::kF32) {
      if (!Round(__func__, s, dout, M * N, d, &dout_r)) return;
      go = dout_r.get();
      if (!dweight.empty() && inp.dtype != d) {  // else a kept copy in d, read as is
        if (!Round(__func__, s, inp, M * K, d, &inp_r)) return;
        in = inp_r.get();
      }
    }
    if (!dinp.empty()) {
      GemmShape g{.trans_a = false, .trans_b = false, .m = K, .n = M, .k = N, .lda = K,
                  .ldb = N, .ldd = K, .ab = d, .accumulate = true};
      if (!RunGemm(__func__, s, g, Ptr(weight), go, F32(dinp))) return;
    }
    if (!dweight.empty()) {
      GemmShape g{.trans_a = false, .trans_b = true, .m = K, .n = N, .k = M, .lda = K,
                  .ldb = N, .ldd = K, .ab = d, .accumulate = true};
      if (!RunGemm(__func__, s, g, in, go, F32(dweight))) return;
    }
    if (!dbias.empty()) k::bias_backward(stream(s), F32(dbias), F32(dout), M, N);
    End(__func__);
  }

  // ---- normalisation and activations ---------------------------------------------------------
  void LayernormForward(Stream s, View out, View mean, View rstd, View inp, View weight,
                        View bias, int64_t N, int64_t C, float eps) override {
    if (!Begin(__func__, s, {out, mean, rstd, inp, weight, bias})) return;
    k::layernorm_forward(stream(s), F32(out), F32(mean), F32(rstd), F32(inp), F32(weight),
                         F32(bias), N, C, eps);
    End(__func__);
  }
  void LayernormBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                         View weight, View mean, View rstd, int64_t N, int64_t C) override {
    if (!Begin(__func__, s, {dinp, dweight, dbias, dout, inp, weight, mean, rstd})) return;
    k::layernorm_backward(stream(s), F32(dinp), F32(dweight), F32(dbias), F32(dout), F32(inp),
                          F32(weight), F32(mean), F32(rstd), N, C);
    End(__func__);
  }
  void GeluForward(Stream s, View out, View inp) override {
    if (!Begin(__func__, s, {out, inp})) return;
    Scratch wide;
    float* y = F32Out(__func__, out, wide);
    if (y == nullptr) return;
    k::gelu_forward(stream(s), y, F32(inp), inp.count);
    NarrowInto(s, out, y);
    End(__func__);
  }
  void GeluBackward(Stream s, View dinp, View inp, View dout) override {
    if (!Begin(__func__, s, {dinp, inp, dout})) return;
    Scratch widened;
    const float* x = WidenedF32(__func__, s, inp, widened);
    if (x == nullptr) return;
    k::gelu_backward(stream(s), F32(dinp), x, F32(dout), inp.count);
    End(__func__);
  }

  // ---- attention ---------------------------------------------------------------------------------
  void AttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T, int64_t C,
                        int64_t NH) override {
    GqaAttentionForward(s, out, lse, qkv, B, T, NH, NH, NH > 0 ? C / NH : 0);
  }
  void AttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse, int64_t B,
                         int64_t T, int64_t C, int64_t NH) override {
    GqaAttentionBackward(s, dqkv, dout, qkv, out, lse, B, T, NH, NH, NH > 0 ? C / NH : 0);
  }
  void GqaAttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t D) override {
    if (!Begin(__func__, s, {out, lse, qkv})) return;
    k::attention_forward(stream(s), F32(out), F32(lse), F32(qkv), B, T, NH, NKV, D);
    End(__func__);
  }
  void GqaAttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse,
                            int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D) override {
    if (!Begin(__func__, s, {dqkv, dout, qkv, out, lse})) return;
    Scratch qkv32, out32;  // kept bf16 / f16 copies, widened first
    const float* q = WidenedF32(__func__, s, qkv, qkv32);
    const float* o = q == nullptr ? nullptr : WidenedF32(__func__, s, out, out32);
    if (o == nullptr) return;
    absl::StatusOr<Scratch> ws = Scratch::Create(
        *b_, static_cast<size_t>(k::attention_backward_workspace_bytes(B, T, NH)));
    if (!ws.ok()) return Fail(__func__, ws.status());
    k::attention_backward(stream(s), F32(dqkv), F32(dout), q, o, F32(lse), B, T, NH, NKV, D,
                          ws->as<float>());
    End(__func__);
  }

  // ---- Llama layers ---------------------------------------------------------------------------
  void RmsnormForward(Stream s, View out, View rstd, View inp, View weight, int64_t N, int64_t C,
                      float eps) override {
    if (!Begin(__func__, s, {out, rstd, inp, weight})) return;
    k::rmsnorm_forward(stream(s), F32(out), F32(rstd), F32(inp), F32(weight), N, C, eps);
    End(__func__);
  }
  void RmsnormBackward(Stream s, View dinp, View dweight, View dout, View inp, View weight,
                       View rstd, int64_t N, int64_t C) override {
    if (!Begin(__func__, s, {dinp, dweight, dout, inp, weight, rstd})) return;
    k::rmsnorm_backward(stream(s), F32(dinp), F32(dweight), F32(dout), F32(inp), F32(weight),
                        F32(rstd), N, C);
    End(__func__);
  }
  void RopeForward(Stream s, View x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                   float theta) override {
    if (!Begin(__func__, s, {x})) return;
    k::rope_forward(stream(s), F32(x), B, T, W, NH, D, theta);
    End(__func__);
  }
  void RopeBackward(Stream s, View dx, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                    float theta) override {
    if (!Begin(__func__, s, {dx})) return;
    k::rope_backward(stream(s), F32(dx), B, T, W, NH, D, theta);
    End(__func__);
  }
  void SwigluForward(Stream s, View out, View gu, int64_t N, int64_t F) override {
    if (!Begin(__func__, s, {out, gu})) return;
    Scratch wide;
    float* y = F32Out(__func__, out, wide);
    if (y == nullptr) return;
    k::swiglu_forward(stream(s), y, F32(gu), N, F);
    NarrowInto(s, out, y);
    End(__func__);
  }
  void SwigluBackward(Stream s, View dgu, View dout, View gu, int64_t N, int64_t F) override {
    if (!Begin(__func__, s, {dgu, dout, gu})) return;
    Scratch widened;
    const float* g = WidenedF32(__func__, s, gu, widened);
    if (g == nullptr) return;
    k::swiglu_backward(stream(s), F32(dgu), F32(dout), g, N, F);
    End(__func__);
  }

  // ---- loss and embedding -----------------------------------------------------------------------
  void SoftmaxCrossEntropyForward(Stream s, View losses, View probs, View logits, View targets,
                                  int64_t N, int64_t V) override {
    if (!Begin(__func__, s, {losses, probs, logits, targets})) return;
    k::softmax_crossentropy_forward(stream(s), F32(losses), F32(probs), F32(logits),
                                    I32(targets), N, V);
    End(__func__);
  }
  void SoftmaxCrossEntropyBackward(Stream s, View dlogits, View probs, View targets, float dloss,
                                   int64_t N, int64_t V) override {
    if (!Begin(__func__, s, {dlogits, probs, targets})) return;
    k::softmax_crossentropy_backward(stream(s), F32(dlogits), F32(probs), I32(targets), dloss,
                                     N, V);
    End(__func__);
  }
  void EmbeddingForward(Stream s, View out, View idx, View table, int64_t N, int64_t C) override {
    if (!Begin(__func__, s, {out, idx, table})) return;
    k::embedding_forward(stream(s), F32(out), I32(idx), F32(table), N, C);
    End(__func__);
  }
  void EmbeddingBackward(Stream s, View dtable, View dout, View idx, int64_t N,
                         int64_t C) override {
    if (!Begin(__func__, s, {dtable, dout, idx})) return;
    k::embedding_backward(stream(s), F32(dtable), F32(dout), I32(idx), N, C);
    End(__func__);
  }

  // ---- element-wise ----------------------------------------------------------------------------
  void Add(Stream s, View out, View a, View b) override {
    if (!Begin(__func__, s, {out, a, b})) return;
    k::add(stream(s), F32(out), F32(a), F32(b), out.count);
    End(__func__);
  }
  void AddBackward(Stream s, View da, View db, View dout) override {
    if (!Begin(__func__, s, {da, db, dout})) return;
    k::add_backward(stream(s), F32(da), F32(db), F32(dout), dout.count);
    End(__func__);
  }
  void Cast(Stream s, View out, View in) override {
    if (!Begin(__func__, s, {out, in})) return;
    const DType to = out.dtype, from = in.dtype;
    const int64_t n = in.count;
    if (from == to) {
      const absl::Status st = CudaStatus(
          cudaMemcpyAsync(Ptr(out), Ptr(in), static_cast<size_t>(in.bytes()),
                          cudaMemcpyDeviceToDevice, stream(s)),
          "cudaMemcpyAsync");
      if (!st.ok()) return Fail(__func__, st);
    } else if (from == DType::kF32 && to == DType::kBF16) {
      k::cast_f32_to_bf16(stream(s), U16(out), F32(in), n);
    } else if (from == DType::kF32 && to == DType::kF16) {
      k::cast_f32_to_f16(stream(s), U16(out), F32(in), n);
    } else if (from == DType::kBF16 && to == DType::kF32) {
      k::cast_bf16_to_f32(stream(s), F32(out), U16(in), n);
    } else if (from == DType::kF16 && to == DType::kF32) {
      k::cast_f16_to_f32(stream(s), F32(out), U16(in), n);
    } else {
      return Fail(__func__, absl::InvalidArgumentError(absl::StrCat(
                                "no cast from ", std::string(DTypeName(from)), " to ",
                                std::string(DTypeName(to)), " (f32 <-> bf16 / f16 only)")));
    }
    End(__func__);
  }
  void Scale(Stream s, View x, float factor) override {
    if (!Begin(__func__, s, {x})) return;
    k::scale(stream(s), F32(x), factor, x.count);
    End(__func__);
  }
  void ScaleBy(Stream s, View x, View factor) override {
    if (!Begin(__func__, s, {x, factor})) return;
    k::scale_by(stream(s), F32(x), F32(factor), x.count);
    End(__func__);
  }
  void Reduce(Stream s, View out, std::span<const View> ins, ReduceOp op) override {
    if (!Begin(__func__, s, {out})) return;
    if (ins.size() > 16) {
      return Fail(__func__, absl::InvalidArgumentError(absl::StrCat(
                                ins.size(), " inputs: the cuda Reduce takes at most 16")));
    }
    std::vector<const void*> ptrs;
    for (const View& v : ins) {
      const absl::Status st = Check(v);
      if (!st.ok()) return Fail(__func__, st);
      ptrs.push_back(Ptr(v));
    }
    k::reduce(stream(s), Ptr(out), ptrs.data(), static_cast<int>(ptrs.size()), out.count,
              KernelDType(out.dtype), static_cast<int>(op));
    End(__func__);
  }

  // ---- optimizers ------------------------------------------------------------------------------
  void AdamW(Stream s, View param, View grad, View m, View v, const AdamWScalars& c) override {
    if (!Begin(__func__, s, {param, grad, m, v})) return;
    k::adamw_update(stream(s), F32(param), F32(grad), F32(m), F32(v), param.count, c);
    End(__func__);
  }
  void Sgd(Stream s, View param, View grad, View momentum_buf, float lr, float momentum,
           float dampening, float weight_decay, bool nesterov, bool first_step) override {
    if (!Begin(__func__, s, {param, grad, momentum_buf})) return;
    k::sgd_update(stream(s), F32(param), F32(grad), F32(momentum_buf), param.count, lr, momentum,
                  dampening, weight_decay, nesterov, first_step);
    End(__func__);
  }

  // ---- block quantization for the wire ---------------------------------------------------------
  bool supports_wire_format(WireFormat) const override { return true; }
  void QuantizeBlocks(Stream s, View codes, View scales, View x, int64_t block,
                      WireFormat format) override {
    if (!Begin(__func__, s, {codes, scales, x})) return;
    k::quantize_blocks(stream(s), reinterpret_cast<uint8_t*>(Ptr(codes)), F32(scales), F32(x),
                       x.count, block, static_cast<int>(format));
    End(__func__);
  }
  void DequantizeBlocks(Stream s, View out, View codes, View scales, int64_t block,
                        WireFormat format) override {
    if (!Begin(__func__, s, {out, codes, scales})) return;
    k::dequantize_blocks(stream(s), Ptr(out), KernelDType(out.dtype),
                         reinterpret_cast<const uint8_t*>(Ptr(codes)), F32(scales), out.count,
                         block, static_cast<int>(format));
    End(__func__);
  }

  // ---- reductions into device scalars ----------------------------------------------------------
  void SumSquares(Stream s, View out, View x) override {
    if (!Begin(__func__, s, {out, x})) return;
    absl::StatusOr<Scratch> partials =
        Scratch::Create(*b_, static_cast<size_t>(k::kSumSquaresPartials) * sizeof(double));
    if (!partials.ok()) return Fail(__func__, partials.status());
    k::sum_squares(stream(s), F64(out), F32(x), x.count, partials->as<double>());
    End(__func__);
  }
  void SplitF64(Stream s, View out, View in) override {
    if (!Begin(__func__, s, {out, in})) return;
    k::split_f64(stream(s), F32(out), F64(in));
    End(__func__);
  }
  void GlobalNormClip(Stream s, View total_sq, View factor, View partials, double kk,
                      float max_norm) override {
    if (!Begin(__func__, s, {total_sq, factor, partials})) return;
    const bool wide = partials.dtype == DType::kF64;
    const int64_t n = wide ? partials.count : partials.count / 2;
    k::global_norm_clip(stream(s), F64(total_sq), F32(factor), Ptr(partials), wide, n, kk,
                        max_norm);
    End(__func__);
  }
  void Mean(Stream s, View out, View x) override {
    if (!Begin(__func__, s, {out, x})) return;
    k::mean(stream(s), F32(out), F32(x), x.count);
    End(__func__);
  }

 private:
  cudaStream_t stream(Stream s) const { return StreamOf(*b_, s); }

  absl::Status Check(const View& v) const {
    if (v.count == 0) return absl::OkStatus();
    if (v.backend != b_) {
      return absl::InvalidArgumentError("a view is not memory of this cuda backend");
    }
    if (v.count < 0 || v.offset < 0 ||
        v.offset + v.bytes() > static_cast<int64_t>(v.allocation.bytes)) {
      return absl::InvalidArgumentError(absl::StrCat("a view (offset ", v.offset, ", ", v.bytes(),
                                                     " bytes) is outside its ",
                                                     v.allocation.bytes, "-byte allocation"));
    }
    return absl::OkStatus();
  }
  // False (and nothing is issued) when the backend has failed or a view is bad.
  bool Begin(const char* op, Stream, std::initializer_list<View> views) {
    if (FailureOf(*b_)->failed()) return false;
    for (const View& v : views) {
      const absl::Status st = Check(v);
      if (!st.ok()) {
        Fail(op, st);
        return false;
      }
    }
    const absl::Status st = UseDevice(*b_);
    if (!st.ok()) {
      Fail(op, st);
      return false;
    }
    // A non-sticky error some earlier call on this thread left behind (one that was handled
    // where it happened, or NCCL's and cuBLASLt's internal ones) is not this op's: End() must
    // see only the launches made from here. A sticky error comes back from the launches.
    (void)cudaGetLastError();
    return true;
  }
  void Fail(const char* op, const absl::Status& st) {
    FailureOf(*b_)->Set(absl::Status(st.code(), absl::StrCat("cuda op ", op, ": ", st.message())));
  }
  // The launch error of the kernels just issued, if any.
  void End(const char* op) {
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) Fail(op, CudaStatus(e, "kernel launch"));
  }
  // New stream-ordered f32 scratch of v.count elements, held by `holder`, for a view of a
  // 16-bit type (bf16 / f16; `what` names the view's role in the error otherwise). nullptr
  // after a failure (reported).
  float* F32ScratchFor(const char* op, const View& v, const char* what, Scratch& holder) {
    if (v.dtype != DType::kBF16 && v.dtype != DType::kF16) {
      Fail(op, absl::InvalidArgumentError(absl::StrCat(what, " is ",
                                                       std::string(DTypeName(v.dtype)),
                                                       "; this op takes f32, bf16 or f16 there")));
      return nullptr;
    }
    absl::StatusOr<Scratch> w = Scratch::Create(*b_, static_cast<size_t>(v.count) * 4);
    if (!w.ok()) {
      Fail(op, w.status());
      return nullptr;
    }
    holder = std::move(*w);
    return holder.as<float>();
  }
  // Where an op that may write a 16-bit output computes it in f32: `out` itself when f32, else
  // scratch (then NarrowInto rounds it into `out`). nullptr after a failure (reported).
  float* F32Out(const char* op, const View& out, Scratch& holder) {
    if (out.dtype == DType::kF32) return F32(out);
    return F32ScratchFor(op, out, "the output", holder);
  }
  // out (bf16 / f16) = y rounded; nothing when out is f32 (y is out).
  void NarrowInto(Stream s, const View& out, const float* y) {
    auto* o = reinterpret_cast<uint16_t*>(Ptr(out));
    if (out.dtype == DType::kBF16) {
      k::cast_f32_to_bf16(stream(s), o, y, out.count);
    } else if (out.dtype == DType::kF16) {
      k::cast_f32_to_f16(stream(s), o, y, out.count);
    }
  }
  // The f32 values of `v`: its own memory when f32, else (a kept bf16 / f16 copy) widened into
  // scratch held by `holder`. nullptr after a failure (reported).
  const float* WidenedF32(const char* op, Stream s, const View& v, Scratch& holder) {
    if (v.dtype == DType::kF32) return F32(v);
    if (F32ScratchFor(op, v, "an input", holder) == nullptr) return nullptr;
    const auto* in16 = reinterpret_cast<const uint16_t*>(Ptr(v));
    if (v.dtype == DType::kBF16) {
      k::cast_bf16_to_f32(stream(s), holder.as<float>(), in16, v.count);
    } else {
      k::cast_f16_to_f32(stream(s), holder.as<float>(), in16, v.count);
    }
    return holder.as<float>();
  }
  // `n` f32 elements of `v` rounded to `d` into new scratch.
  bool Round(const char* op, Stream s, const View& v, int64_t n, DType d, Scratch* out) {
    absl::StatusOr<Scratch> r = Scratch::Create(*b_, static_cast<size_t>(n) * DTypeSize(d));
    if (!r.ok()) {
      Fail(op, r.status());
      return false;
    }
    *out = std::move(*r);
    if (d == DType::kBF16) {
      k::cast_f32_to_bf16(stream(s), out->as<uint16_t>(), F32(v), n);
    } else {
      k::cast_f32_to_f16(stream(s), out->as<uint16_t>(), F32(v), n);
    }
    return true;
  }
  bool RunGemm(const char* op, Stream s, const GemmShape& g, const void* a, const void* b,
               float* d) {
    std::unique_lock<std::mutex> lock(gemm_mu_);
    if (gemm_ == nullptr) {
      absl::StatusOr<std::unique_ptr<Gemm>> created = Gemm::Create(b_->options().allow_tf32);
      if (!created.ok()) {
        Fail(op, created.status());
        return false;
      }
      gemm_ = std::move(*created);
    }
    lock.unlock();
    const absl::Status st = gemm_->Run(stream(s), static_cast<int>(s), g, a, b, d);
    if (!st.ok()) {
      Fail(op, st);
      return false;
    }
    return true;
  }

  CudaBackend* b_;
  std::mutex gemm_mu_;
  std::unique_ptr<Gemm> gemm_;
};

}  // namespace

std::unique_ptr<Ops> MakeCudaOps(CudaBackend* backend) {
  // Every call's views checked first (backends/common/checked_ops.h); a bad one fails the
  // backend as a failed launch does.
  return std::make_unique<backend_kit::CheckedOps>(
      std::make_unique<CudaOps>(backend),
      [backend](Stream, const char* op, const absl::Status& why) {
        FailureOf(*backend)->Set(
            absl::Status(why.code(), absl::StrCat("cuda op ", op, ": ", why.message())));
      });
}

}  // namespace fsdp::cuda_internal
