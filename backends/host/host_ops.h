// The op table of a backend whose memory the host CPU can execute on: the CPU backend (ops run
// at once on the calling thread) and the simulated accelerator (ops run on the stream's worker
// thread). Each op resolves its Views to the storage pointers and calls the CPU reference
// kernel; `Exec` decides where and when: it provides
//   template <class F> void Run(Stream s, const char* op, F&& work);
// A backend wraps the table in backends/common/checked_ops.h, which checks each call's views
// first: the kernels here trust them.
#pragma once

#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "collectives/reduce.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/ops.h"
#include "fsdp/optim_scalars.h"

namespace fsdp::internal {

// The bytes of a view of a host-executing backend (nullptr for an empty view).
inline char* Bytes(const View& v) {
  return v.count == 0 ? nullptr : static_cast<char*>(v.allocation.storage) + v.offset;
}
inline float* F32(const View& v) { return reinterpret_cast<float*>(Bytes(v)); }
inline int32_t* I32(const View& v) { return reinterpret_cast<int32_t*>(Bytes(v)); }
inline uint16_t* U16(const View& v) { return reinterpret_cast<uint16_t*>(Bytes(v)); }
inline double* F64(const View& v) { return reinterpret_cast<double*>(Bytes(v)); }

template <class Exec>
class HostOps final : public Ops {
 public:
  explicit HostOps(Exec* exec) : exec_(exec) {}

  void MatmulForward(Stream s, View out, View inp, View weight, View bias, int64_t M, int64_t K,
                     int64_t N) override {
    const DType d = weight.dtype;
    const DType id = inp.dtype;  // f32, or the weight's dtype (a kept copy)
    float* o = F32(out);
    const void* i = Bytes(inp);
    const void* w = Bytes(weight);
    const void* b = Bytes(bias);
    exec_->Run(s, __func__, [=] {
      if (d == DType::kF32) {
        kernels::cpu::matmul_forward(o, static_cast<const float*>(i),
                                     static_cast<const float*>(w), static_cast<const float*>(b),
                                     M, K, N);
      } else {
        kernels::cpu::matmul_forward_lowp(o, i, w, b, M, K, N, d, id);
      }
    });
  }
  void MatmulBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                      View weight, int64_t M, int64_t K, int64_t N) override {
    const DType d = weight.dtype;
    const DType id = inp.dtype;  // f32, or the weight's dtype (a kept copy)
    float *di = F32(dinp), *dw = F32(dweight), *db = F32(dbias);
    const float* go = F32(dout);
    const void* i = Bytes(inp);
    const void* w = Bytes(weight);
    exec_->Run(s, __func__, [=] {
      if (d == DType::kF32) {
        kernels::cpu::matmul_backward(di, dw, db, go, static_cast<const float*>(i),
                                      static_cast<const float*>(w), M, K, N);
      } else {
        kernels::cpu::matmul_backward_lowp(di, dw, db, go, i, w, M, K, N, d, id);
      }
    });
  }
  void LayernormForward(Stream s, View out, View mean, View rstd, View inp, View weight,
                        View bias, int64_t N, int64_t C, float eps) override {
    float *o = F32(out), *m = F32(mean), *r = F32(rstd);
    const float *i = F32(inp), *w = F32(weight), *b = F32(bias);
    exec_->Run(s, __func__, [=] { kernels::cpu::layernorm_forward(o, m, r, i, w, b, N, C, eps); });
  }
  void LayernormBackward(Stream s, View dinp, View dweight, View dbias, View dout, View inp,
                         View weight, View mean, View rstd, int64_t N, int64_t C) override {
    float *di = F32(dinp), *dw = F32(dweight), *db = F32(dbias);
    const float *go = F32(dout), *i = F32(inp), *w = F32(weight), *m = F32(mean), *r = F32(rstd);
    exec_->Run(s, __func__, [=] { kernels::cpu::layernorm_backward(di, dw, db, go, i, w, m, r, N, C); });
  }
  void GeluForward(Stream s, View out, View inp) override {
    void* o = Bytes(out);
    const DType od = out.dtype;  // f32, or bf16 / f16: rounded as written
    const float* i = F32(inp);
    const int64_t n = inp.count;
    exec_->Run(s, __func__, [=] {
      if (od == DType::kF32) {
        kernels::cpu::gelu_forward(static_cast<float*>(o), i, n);
      } else {
        kernels::cpu::gelu_forward_lowp(static_cast<uint16_t*>(o), i, n, od);
      }
    });
  }
  void GeluBackward(Stream s, View dinp, View inp, View dout) override {
    float* di = F32(dinp);
    const float* go = F32(dout);
    const void* i = Bytes(inp);
    const DType d = inp.dtype;  // f32, or a kept bf16 / f16 copy
    const int64_t n = inp.count;
    exec_->Run(s, __func__, [=] {
      if (d == DType::kF32) {
        kernels::cpu::gelu_backward(di, static_cast<const float*>(i), go, n);
      } else {
        kernels::cpu::gelu_backward_lowp(di, static_cast<const uint16_t*>(i), go, n, d);
      }
    });
  }
  void AttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T, int64_t C,
                        int64_t NH) override {
    float *o = F32(out), *l = F32(lse);
    const float* q = F32(qkv);
    exec_->Run(s, __func__, [=] { kernels::cpu::attention_forward(o, l, q, B, T, C, NH); });
  }
  void AttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse, int64_t B,
                         int64_t T, int64_t C, int64_t NH) override {
    float* dq = F32(dqkv);
    const float *go = F32(dout), *l = F32(lse);
    const void *q = Bytes(qkv), *o = Bytes(out);  // each f32, or a kept bf16 / f16 copy
    const DType qd = qkv.dtype, od = out.dtype;
    const int64_t D = NH > 0 ? C / NH : 0;  // attention_backward's heads, as grouped-query
    exec_->Run(s, __func__, [=] {
      kernels::cpu::gqa_attention_backward_kept(dq, go, q, qd, o, od, l, B, T, NH, NH, D);
    });
  }
  void GqaAttentionForward(Stream s, View out, View lse, View qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t D) override {
    float *o = F32(out), *l = F32(lse);
    const float* q = F32(qkv);
    exec_->Run(s, __func__,
               [=] { kernels::cpu::gqa_attention_forward(o, l, q, B, T, NH, NKV, D); });
  }
  void GqaAttentionBackward(Stream s, View dqkv, View dout, View qkv, View out, View lse,
                            int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D) override {
    float* dq = F32(dqkv);
    const float *go = F32(dout), *l = F32(lse);
    const void *q = Bytes(qkv), *o = Bytes(out);  // each f32, or a kept bf16 / f16 copy
    const DType qd = qkv.dtype, od = out.dtype;
    exec_->Run(s, __func__, [=] {
      kernels::cpu::gqa_attention_backward_kept(dq, go, q, qd, o, od, l, B, T, NH, NKV, D);
    });
  }
  void RmsnormForward(Stream s, View out, View rstd, View inp, View weight, int64_t N, int64_t C,
                      float eps) override {
    float *o = F32(out), *r = F32(rstd);
    const float *i = F32(inp), *w = F32(weight);
    exec_->Run(s, __func__, [=] { kernels::cpu::rmsnorm_forward(o, r, i, w, N, C, eps); });
  }
  void RmsnormBackward(Stream s, View dinp, View dweight, View dout, View inp, View weight,
                       View rstd, int64_t N, int64_t C) override {
    float *di = F32(dinp), *dw = F32(dweight);
    const float *go = F32(dout), *i = F32(inp), *w = F32(weight), *r = F32(rstd);
    exec_->Run(s, __func__, [=] { kernels::cpu::rmsnorm_backward(di, dw, go, i, w, r, N, C); });
  }
  void RopeForward(Stream s, View x, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                   float theta) override {
    float* p = F32(x);
    exec_->Run(s, __func__, [=] { kernels::cpu::rope_forward(p, B, T, W, NH, D, theta); });
  }
  void RopeBackward(Stream s, View dx, int64_t B, int64_t T, int64_t W, int64_t NH, int64_t D,
                    float theta) override {
    float* p = F32(dx);
    exec_->Run(s, __func__, [=] { kernels::cpu::rope_backward(p, B, T, W, NH, D, theta); });
  }
  void SwigluForward(Stream s, View out, View gu, int64_t N, int64_t F) override {
    void* o = Bytes(out);
    const DType od = out.dtype;  // f32, or bf16 / f16: rounded as written
    const float* g = F32(gu);
    exec_->Run(s, __func__, [=] {
      if (od == DType::kF32) {
        kernels::cpu::swiglu_forward(static_cast<float*>(o), g, N, F);
      } else {
        kernels::cpu::swiglu_forward_lowp(static_cast<uint16_t*>(o), g, N, F, od);
      }
    });
  }
  void SwigluBackward(Stream s, View dgu, View dout, View gu, int64_t N, int64_t F) override {
    float* dg = F32(dgu);
    const float* go = F32(dout);
    const void* g = Bytes(gu);
    const DType d = gu.dtype;  // f32, or a kept bf16 / f16 copy
    exec_->Run(s, __func__, [=] {
      if (d == DType::kF32) {
        kernels::cpu::swiglu_backward(dg, go, static_cast<const float*>(g), N, F);
      } else {
        kernels::cpu::swiglu_backward_lowp(dg, go, static_cast<const uint16_t*>(g), N, F, d);
      }
    });
  }
  void SoftmaxCrossEntropyForward(Stream s, View losses, View probs, View logits, View targets,
                                  int64_t N, int64_t V) override {
    float *l = F32(losses), *p = F32(probs);
    const float* lg = F32(logits);
    const int32_t* t = I32(targets);
    exec_->Run(s, __func__, [=] { kernels::cpu::softmax_crossentropy_forward(l, p, lg, t, N, V); });
  }
  void SoftmaxCrossEntropyBackward(Stream s, View dlogits, View probs, View targets, float dloss,
                                   int64_t N, int64_t V) override {
    float* dl = F32(dlogits);
    const float* p = F32(probs);
    const int32_t* t = I32(targets);
    exec_->Run(s, __func__, [=] { kernels::cpu::softmax_crossentropy_backward(dl, p, t, dloss, N, V); });
  }
  void EmbeddingForward(Stream s, View out, View idx, View table, int64_t N, int64_t C) override {
    float* o = F32(out);
    const int32_t* ix = I32(idx);
    const float* tb = F32(table);
    exec_->Run(s, __func__, [=] { kernels::cpu::embedding_forward(o, ix, tb, N, C); });
  }
  void EmbeddingBackward(Stream s, View dtable, View dout, View idx, int64_t N,
                         int64_t C) override {
    float* dt = F32(dtable);
    const float* go = F32(dout);
    const int32_t* ix = I32(idx);
    exec_->Run(s, __func__, [=] { kernels::cpu::embedding_backward(dt, go, ix, N, C); });
  }
  void Add(Stream s, View out, View a, View b) override {
    float* o = F32(out);
    const float *x = F32(a), *y = F32(b);
    const int64_t n = out.count;
    exec_->Run(s, __func__, [=] { kernels::cpu::residual_forward(o, x, y, n); });
  }
  void AddBackward(Stream s, View da, View db, View dout) override {
    float *x = F32(da), *y = F32(db);
    const float* go = F32(dout);
    const int64_t n = dout.count;
    exec_->Run(s, __func__, [=] { kernels::cpu::residual_backward(x, y, go, n); });
  }
  void Cast(Stream s, View out, View in) override {
    const DType to = out.dtype, from = in.dtype;
    const int64_t n = in.count;
    char* o = Bytes(out);
    const char* i = Bytes(in);
    exec_->Run(s, __func__, [=] {
      if (from == to) {
        coll::CopyBytes(o, i, static_cast<size_t>(n) * DTypeSize(to));
      } else if (from == DType::kF32 && to == DType::kBF16) {
        kernels::cpu::cast_f32_to_bf16(reinterpret_cast<uint16_t*>(o),
                                       reinterpret_cast<const float*>(i), n);
      } else if (from == DType::kF32 && to == DType::kF16) {
        kernels::cpu::cast_f32_to_f16(reinterpret_cast<uint16_t*>(o),
                                      reinterpret_cast<const float*>(i), n);
      } else if (from == DType::kBF16 && to == DType::kF32) {
        kernels::cpu::cast_bf16_to_f32(reinterpret_cast<float*>(o),
                                       reinterpret_cast<const uint16_t*>(i), n);
      } else if (from == DType::kF16 && to == DType::kF32) {
        kernels::cpu::cast_f16_to_f32(reinterpret_cast<float*>(o),
                                      reinterpret_cast<const uint16_t*>(i), n);
      }
    });
  }
  void CastKeepingRounded(Stream s, View low, View x) override {
    if (low.dtype != DType::kBF16) {
      Ops::CastKeepingRounded(s, low, x);
      return;
    }
    auto* l = reinterpret_cast<uint16_t*>(Bytes(low));
    float* f = F32(x);
    const int64_t n = x.count;
    exec_->Run(s, __func__, [=] { kernels::cpu::round_f32_keeping_bf16(l, f, n); });
  }
  void Scale(Stream s, View x, float factor) override {
    float* p = F32(x);
    const int64_t n = x.count;
    exec_->Run(s, __func__, [=] { kernels::cpu::scale_inplace(p, factor, n); });
  }
  void ScaleBy(Stream s, View x, View factor) override {
    float* p = F32(x);
    const float* f = F32(factor);
    const int64_t n = x.count;
    exec_->Run(s, __func__, [=] {
      if (*f != 1.0f) kernels::cpu::scale_inplace(p, *f, n);
    });
  }
  void Reduce(Stream s, View out, std::span<const View> ins, ReduceOp op) override {
    std::vector<const void*> srcs;
    for (const View& v : ins) srcs.push_back(Bytes(v));
    void* o = Bytes(out);
    const DType d = out.dtype;
    const int64_t n = out.count;
    exec_->Run(s, __func__, [=, srcs = std::move(srcs)] {
      coll::ReduceBuffers(d, op, srcs.data(), static_cast<int>(srcs.size()), o, n,
                          static_cast<int>(srcs.size()));
    });
  }
  void AdamW(Stream s, View param, View grad, View m, View v, const AdamWScalars& k) override {
    float *p = F32(param), *mm = F32(m), *vv = F32(v);
    const float* g = F32(grad);
    const int64_t n = param.count;
    exec_->Run(s, __func__, [=] { kernels::cpu::adamw_update(p, g, mm, vv, n, k); });
  }
  void Sgd(Stream s, View param, View grad, View momentum_buf, float lr, float momentum,
           float dampening, float weight_decay, bool nesterov, bool first_step) override {
    float *p = F32(param), *buf = F32(momentum_buf);
    const float* g = F32(grad);
    const int64_t n = param.count;
    exec_->Run(s, __func__, [=] {
      kernels::cpu::sgd_update(p, g, buf, n, lr, momentum, dampening, weight_decay, nesterov,
                               first_step);
    });
  }
  void SumSquares(Stream s, View out, View x) override {
    double* o = F64(out);
    const float* p = F32(x);
    const int64_t n = x.count;
    exec_->Run(s, __func__, [=] { *o += kernels::cpu::sum_squares(p, n); });
  }
  void SplitF64(Stream s, View out, View in) override {
    float* o = F32(out);
    const double* i = F64(in);
    exec_->Run(s, __func__, [=] {
      const double v = *i;
      o[0] = static_cast<float>(v);
      o[1] = static_cast<float>(v - o[0]);
    });
  }
  void GlobalNormClip(Stream s, View total_sq, View factor, View partials, double k,
                      float max_norm) override {
    double* total = F64(total_sq);
    float* f = F32(factor);
    const bool wide = partials.dtype == DType::kF64;
    const void* p = Bytes(partials);
    const int64_t n = wide ? partials.count : partials.count / 2;
    exec_->Run(s, __func__, [=] {
      double sum = 0;
      for (int64_t r = 0; r < n; ++r) {
        sum += wide ? static_cast<const double*>(p)[r]
                    : static_cast<double>(static_cast<const float*>(p)[2 * r]) +
                          static_cast<const float*>(p)[2 * r + 1];
      }
      *total = sum;
      *f = static_cast<float>(ClipCoefficient(std::sqrt(sum) / k, max_norm) / k);
    });
  }
  bool supports_wire_format(WireFormat) const override { return true; }
  void QuantizeBlocks(Stream s, View codes, View scales, View x, int64_t block,
                      WireFormat format) override {
    uint8_t* c = reinterpret_cast<uint8_t*>(Bytes(codes));
    float* sc = F32(scales);
    const float* in = F32(x);
    const int64_t n = x.count;
    exec_->Run(s, __func__, [=] { kernels::cpu::quantize_blocks(c, sc, in, n, block, format); });
  }
  void DequantizeBlocks(Stream s, View out, View codes, View scales, int64_t block,
                        WireFormat format) override {
    void* o = Bytes(out);
    const DType d = out.dtype;
    const uint8_t* c = reinterpret_cast<const uint8_t*>(Bytes(codes));
    const float* sc = F32(scales);
    const int64_t n = out.count;
    exec_->Run(s, __func__,
               [=] { kernels::cpu::dequantize_blocks(o, d, c, sc, n, block, format); });
  }
  void Mean(Stream s, View out, View x) override {
    float* o = F32(out);
    const float* p = F32(x);
    const int64_t n = x.count;
    exec_->Run(s, __func__, [=] {
      double sum = 0;
      for (int64_t i = 0; i < n; ++i) sum += p[i];
      *o = static_cast<float>(sum / static_cast<double>(n));
    });
  }

 private:
  Exec* exec_;
};

}  // namespace fsdp::internal
