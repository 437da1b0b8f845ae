// Causal self-attention, forward and backward, with NH query heads sharing NKV key/value
// heads (grouped-query attention; the GPT's multi-head attention is NKV = NH), without the
// T x T probabilities: forward keeps the output and one f32 log-sum-exp per row, backward
// recomputes the probabilities block by block (FlashAttention-2's backward, Dao 2023).
//
// The sequence is cut into query blocks of `block` rows. Query block [r0, r1) only meets the
// keys [0, r1): its scores are one single-threaded oneDNN GEMM on strided views of qkv into a
// per-thread scratch of block x T floats (O(T) memory, in cache), the row softmax a plain loop
// (vec_math.h) over the causal part of each row, and out[r0:r1] one more GEMM. Forward is one
// OpenMP task per (batch, head) pair. Backward is one task per (batch, kv head), running the
// query heads of its group in order, so that the dk and dv of a kv head are summed by one
// thread in a fixed order; for each query block it recomputes the probabilities from the
// scores and the log-sum-exp, forms d(scores) = scale p (dp - dot) with dp = dout v^T and
// dot[t] = dout[t] . out[t], and adds d(scores) k into dq, d(scores)^T q into dk[0:r1] and
// p^T dout into dv[0:r1]: five GEMMs a block, the masked half skipped block by block.
#include <omp.h>

#include <algorithm>
#include <cassert>
#include <cmath>
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

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* out,
                       const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                       int64_t D, int64_t block) {
  assert(NH > 0 && NKV > 0 && NH % NKV == 0 && D > 0 && block > 0);
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D, group = NH / NKV, bs = std::min(block, T);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);
    // Per-thread scratch for one query block (row stride T): the recomputed probabilities p,
    // and d(probabilities), turned into d(scores) in place. Inside the diagonal block the part
    // above the diagonal is zeroed.
    std::vector<float> scratch(static_cast<size_t>(2 * bs * T));
    float *p = scratch.data(), *ds = p + bs * T;
#pragma omp for schedule(static)
    for (int64_t bg = 0; bg < B * NKV; ++bg) {
      const int64_t b = bg / NKV, g = bg % NKV;
      // The query heads of kv head g, in order: each adds its share to dk and dv.
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const Head hd = HeadAt(b, h, T, NH, NKV, D);
        const float *q = qkv + hd.q, *k = qkv + hd.k, *v = qkv + hd.v;
        const float *dy = dout + hd.out, *y = out + hd.out, *l = lse + hd.lse;
        float *dq = dqkv + hd.q, *dk = dqkv + hd.k, *dv = dqkv + hd.v;
        for (int64_t r0 = 0; r0 < T; r0 += block) {
          const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
          // p[0:rows, 0:r1] = exp(scale q[r0:r1] k[0:r1]^T - lse), zero above the diagonal
          Gemm(p, T, Operand{q + r0 * ld, ld, false}, Operand{k, ld, true}, nullptr, rows, D,
               r1, false);
          // dp[0:rows, 0:r1] = dy[r0:r1] v[0:r1]^T
          Gemm(ds, T, Operand{dy + r0 * ldo, ldo, false}, Operand{v, ld, true}, nullptr, rows,
               D, r1, false);
          for (int64_t t = r0; t < r1; ++t) {
            float *pr = p + (t - r0) * T, *dr = ds + (t - r0) * T;
            const float m = l[t];
            const float dot = Dot(dy + t * ldo, y + t * ldo, D);
#pragma omp simd
            for (int64_t s = 0; s <= t; ++s) {
              const float e = ExpF(pr[s] * scale - m);
              pr[s] = e;
              dr[s] = scale * e * (dr[s] - dot);
            }
            std::fill(pr + t + 1, pr + r1, 0.0f);
            std::fill(dr + t + 1, dr + r1, 0.0f);
          }
          // dq[r0:r1] += ds[0:rows, 0:r1] k[0:r1]
          Gemm(dq + r0 * ld, ld, Operand{ds, T, false}, Operand{k, ld, false}, nullptr, rows,
               r1, D, true);
          // dk[0:r1] += ds^T q[r0:r1]; dv[0:r1] += p^T dy[r0:r1]
          Gemm(dk, ld, Operand{ds, T, true}, Operand{q + r0 * ld, ld, false}, nullptr, r1, rows,
               D, true);
          Gemm(dv, ld, Operand{p, T, true}, Operand{dy + r0 * ldo, ldo, false}, nullptr, r1,
               rows, D, true);
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
  internal::AttentionBackward(dqkv, dout, qkv, out, lse, B, T, NH, NH, C / NH,
                              internal::kAttentionBlock);
}

void gqa_attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T,
                           int64_t NH, int64_t NKV, int64_t D) {
  internal::AttentionForward(out, lse, qkv, B, T, NH, NKV, D, internal::kAttentionBlock);
}

void gqa_attention_backward(float* dqkv, const float* dout, const float* qkv, const float* out,
                            const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                            int64_t D) {
  internal::AttentionBackward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, D,
                              internal::kAttentionBlock);
}

}  // namespace fsdp::kernels::cpu
