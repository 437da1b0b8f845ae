// Causal self-attention, forward and backward, with NH query heads sharing NKV key/value
// heads (grouped-query attention; the GPT's multi-head attention is NKV = NH), without the
// T x T probabilities: forward keeps the output and one f32 log-sum-exp per row, backward
// recomputes the probabilities block by block (FlashAttention-2's contract, Dao 2023).
//
// Forward, one OpenMP task per (batch, head): query block [r0, r1) of `block` rows only meets
// the keys [0, r1). Its scores are one single-threaded oneDNN GEMM on strided views of qkv into
// a per-thread scratch of block x T floats (O(T) memory, in cache), the row softmax a plain
// loop (vec_math.h) over the causal part of each row, which also gives the row's log-sum-exp,
// and out[r0:r1] one more GEMM.
// Backward, one task per (batch, kv head) so that the dk and dv of a kv head are summed by one
// thread in a fixed order: key block [c0, c1) meets the queries [c0, T) that see it. For each
// query head of the group, in order, it recomputes the transposed probabilities
// p^T = exp(scale k q^T - lse) and d(probabilities)^T = v dout^T (two GEMMs into block x T
// scratch), forms d(scores)^T = scale p^T (dp^T - dot) with dot[t] = dout[t] . out[t], and
// adds p^T dout into dv[c0:c1], d(scores)^T q into dk[c0:c1] (both with the long query range as
// the inner dimension, each written once per head) and d(scores) k into dq[c0:T]. Key-major
// order is 1.6x faster here than query-major (which writes dk and dv[0:r1] once per query
// block): five GEMMs a block, the masked half skipped block by block in both passes. A kept
// bf16 / f16 qkv (and out) is widened by each task into its own scratch (k, v and the group's
// q, T x D each), so no f32 copy of the whole tensor exists.
#include <omp.h>

#include <algorithm>
#include <bit>
#include <cassert>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/cpu/attention.h"

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

using internal::Gemm;
using internal::Operand;

// Where query head h of batch b lives: q[b, 0, h*D] in qkv, its key and value heads at
// k[b, 0, (NH+g)*D] and v[b, 0, (NH+NKV+g)*D] (g = h / (NH/NKV), row stride (NH+2NKV)*D),
// out[b, 0, h*D] (row stride NH*D), and lse[b, h, 0] (T values). Offsets in elements.
struct Head {
  int64_t q, k, v, out, lse;
};

Head HeadAt(int64_t b, int64_t h, int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  const int64_t ld = (NH + 2 * NKV) * D, g = h / (NH / NKV), row0 = b * T * ld;
  return {row0 + h * D, row0 + (NH + g) * D, row0 + (NH + NKV + g) * D, b * T * NH * D + h * D,
          (b * NH + h) * T};
}

// out[0:n] = the 16-bit values in[0:n] (bf16 or f16) widened to f32.
void WidenRow(float* out, const uint16_t* in, int64_t n, DType dtype) {
  if (dtype == DType::kBF16) {
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      out[j] = std::bit_cast<float>(static_cast<uint32_t>(in[j]) << 16);
    }
  } else {
    cast_f16_to_f32(out, in, n);  // serial at a row's length
  }
}

}  // namespace

namespace internal {

void AttentionForward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                      int64_t NH, int64_t NKV, int64_t D, int64_t block) {
  assert(NH > 0 && NKV > 0 && NH % NKV == 0 && D > 0 && block > 0);
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D, bs = std::min(block, T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);  // this task's GEMMs run on its own thread: heads are the split
    // Per-thread scratch: the probabilities of one query block, row stride T.
    std::vector<float> scratch(static_cast<size_t>(bs * T));
    float* p = scratch.data();
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * NH; ++bh) {
      const Head hd = HeadAt(bh / NH, bh % NH, T, NH, NKV, D);
      const float *q = qkv + hd.q, *k = qkv + hd.k, *v = qkv + hd.v;
      for (int64_t r0 = 0; r0 < T; r0 += block) {
        const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
        // scores[0:rows, 0:r1] = q[r0:r1] k[0:r1]^T (scaled inside the softmax)
        Gemm(p, T, Operand{q + r0 * ld, ld, false}, Operand{k, ld, true}, nullptr, rows, D, r1,
             false);
        for (int64_t t = r0; t < r1; ++t) {
          float* row = p + (t - r0) * T;
          const SoftmaxStats st = internal::Softmax(row, row, t + 1, scale);
          lse[hd.lse + t] = st.max + std::log(st.sum);
          std::fill(row + t + 1, row + r1, 0.0f);
        }
        // out[r0:r1] = p[0:rows, 0:r1] v[0:r1]
        Gemm(out + hd.out + r0 * ldo, ldo, Operand{p, T, false}, Operand{v, ld, false}, nullptr,
             rows, r1, D, false);
      }
    }
  }
}

void AttentionBackward(float* dqkv, const float* dout, const void* qkv, DType qkv_dtype,
                       const void* out, DType out_dtype, const float* lse, int64_t B, int64_t T,
                       int64_t NH, int64_t NKV, int64_t D, int64_t block) {
  assert(NH > 0 && NKV > 0 && NH % NKV == 0 && D > 0 && block > 0);
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D, group = NH / NKV, bs = std::min(block, T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  // A kept 16-bit qkv is widened per task: the task's k, v and the q of each head of its group
  // into per-thread f32 scratch (T x D each, rows D apart), which the GEMMs then read.
  const bool wide_qkv = qkv_dtype != DType::kF32;
  const int64_t ldi = wide_qkv ? D : ld;  // row stride of the q, k, v the GEMMs read
#pragma omp parallel
  {
    omp_set_num_threads(1);
    // Per-thread scratch for one key block (row stride T): the recomputed probabilities,
    // transposed (row j: key j against the queries t >= c0), and d(probabilities), turned into
    // d(scores) in place; the part left of the diagonal (queries before their key) is zeroed.
    // Then dot[t] = dout[t] . out[t] of each query head of the group, and one row of a
    // widened out.
    std::vector<float> scratch(static_cast<size_t>(2 * bs * T + group * T + D));
    float *pt = scratch.data(), *dst = pt + bs * T, *dots = dst + bs * T,
          *orow = dots + group * T;
    std::vector<float> widened(wide_qkv ? static_cast<size_t>((group + 2) * T * D) : 0);
#pragma omp for schedule(static)
    for (int64_t bg = 0; bg < B * NKV; ++bg) {
      const int64_t b = bg / NKV, g = bg % NKV;
      // Where this task reads q of the group's head i, and k and v: in qkv, or widened.
      auto q_of = [&](int64_t i) -> const float* {
        const Head hd = HeadAt(b, g * group + i, T, NH, NKV, D);
        return wide_qkv ? widened.data() + (2 + i) * T * D
                        : static_cast<const float*>(qkv) + hd.q;
      };
      const Head h0 = HeadAt(b, g * group, T, NH, NKV, D);
      const float* k = wide_qkv ? widened.data() : static_cast<const float*>(qkv) + h0.k;
      const float* v = wide_qkv ? widened.data() + T * D : static_cast<const float*>(qkv) + h0.v;
      if (wide_qkv) {
        const auto* q16 = static_cast<const uint16_t*>(qkv);
        for (int64_t t = 0; t < T; ++t) {
          WidenRow(widened.data() + t * D, q16 + h0.k + t * ld, D, qkv_dtype);
          WidenRow(widened.data() + (T + t) * D, q16 + h0.v + t * ld, D, qkv_dtype);
          for (int64_t i = 0; i < group; ++i) {
            const Head hd = HeadAt(b, g * group + i, T, NH, NKV, D);
            WidenRow(widened.data() + ((2 + i) * T + t) * D, q16 + hd.q + t * ld, D, qkv_dtype);
          }
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        const Head hd = HeadAt(b, g * group + i, T, NH, NKV, D);
        for (int64_t t = 0; t < T; ++t) {
          const float* o = orow;
          if (out_dtype == DType::kF32) {
            o = static_cast<const float*>(out) + hd.out + t * ldo;
          } else {
            WidenRow(orow, static_cast<const uint16_t*>(out) + hd.out + t * ldo, D, out_dtype);
          }
          dots[i * T + t] = Dot(dout + hd.out + t * ldo, o, D);
        }
      }
      // Key blocks [c0, c1), each meeting the queries [c0, T) that see it: dk and dv of the
      // block are summed here once, over the query heads of the group in order; dq[c0:T] of
      // each head gets the block's share.
      for (int64_t c0 = 0; c0 < T; c0 += block) {
        const int64_t c1 = std::min(T, c0 + block), cols = c1 - c0, n = T - c0;
        for (int64_t i = 0; i < group; ++i) {
          const Head hd = HeadAt(b, g * group + i, T, NH, NKV, D);
          const float *q = q_of(i) + c0 * ldi, *kc = k + c0 * ldi, *vc = v + c0 * ldi;
          const float *dy = dout + hd.out + c0 * ldo, *l = lse + hd.lse + c0,
                      *dot = dots + i * T + c0;
          float *dq = dqkv + hd.q + c0 * ld, *dk = dqkv + hd.k + c0 * ld,
                *dv = dqkv + hd.v + c0 * ld;
          // pt[0:cols, 0:n] = k[c0:c1] q[c0:T]^T; dst = v[c0:c1] dy[c0:T]^T
          Gemm(pt, T, Operand{kc, ldi, false}, Operand{q, ldi, true}, nullptr, cols, D, n, false);
          Gemm(dst, T, Operand{vc, ldi, false}, Operand{dy, ldo, true}, nullptr, cols, D, n,
               false);
          // Key c0 + jj meets the queries c0 + u, u >= jj: p = exp(scale s - lse[query]),
          // ds = scale p (dp - dot[query]).
          for (int64_t jj = 0; jj < cols; ++jj) {
            float *pr = pt + jj * T, *dr = dst + jj * T;
#pragma omp simd
            for (int64_t u = jj; u < n; ++u) {
              const float e = ExpF(pr[u] * scale - l[u]);
              pr[u] = e;
              dr[u] = scale * e * (dr[u] - dot[u]);
            }
            std::fill(pr, pr + jj, 0.0f);
            std::fill(dr, dr + jj, 0.0f);
          }
          // dv[c0:c1] += pt dy[c0:T]; dk[c0:c1] += dst q[c0:T]; dq[c0:T] += dst^T k[c0:c1]
          Gemm(dv, ld, Operand{pt, T, false}, Operand{dy, ldo, false}, nullptr, cols, n, D, true);
          Gemm(dk, ld, Operand{dst, T, false}, Operand{q, ldi, false}, nullptr, cols, n, D, true);
          Gemm(dq, ld, Operand{dst, T, true}, Operand{kc, ldi, false}, nullptr, n, cols, D, true);
        }
      }
    }
  }
}

}  // namespace internal

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH) {
  assert(NH > 0 && C % NH == 0);
  internal::AttentionForward(out, lse, qkv, B, T, NH, NH, C / NH, internal::kAttentionBlock);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                        const float* lse, int64_t B, int64_t T, int64_t C, int64_t NH) {
  assert(NH > 0 && C % NH == 0);
  internal::AttentionBackward(dqkv, dout, qkv, DType::kF32, out, DType::kF32, lse, B, T, NH, NH,
                              C / NH, internal::kAttentionBlock);
}

void gqa_attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t D) {
  internal::AttentionForward(out, lse, qkv, B, T, NH, NKV, D, internal::kAttentionBlock);
}

void gqa_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                            const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t D) {
  internal::AttentionBackward(dqkv, dout, qkv, DType::kF32, out, DType::kF32, lse, B, T, NH, NKV,
                              D, internal::kAttentionBlock);
}

void gqa_attention_backward_kept(float* dqkv, const float* dout, const void* qkv,
                                 DType qkv_dtype, const void* out, DType out_dtype,
                                 const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                 int64_t D) {
  internal::AttentionBackward(dqkv, dout, qkv, qkv_dtype, out, out_dtype, lse, B, T, NH, NKV, D,
                              internal::kAttentionBlock);
}

}  // namespace fsdp::kernels::cpu
