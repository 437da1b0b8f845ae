// The causal attention the CPU kernels had before they kept the log-sum-exp instead of the
// probabilities: forward writes att[B,NH,T,T] (the full T x T probabilities of every head,
// zero above the diagonal) and backward reads it, with a T x T d(scores) scratch per thread.
// Kept here, outside the library, only as kernels_bench's baseline for the blocked kernels of
// kernels/cpu/attention.cc (same blocking, same GEMMs and softmax, the matrix in memory).
#include "bench/attention_full_square.h"

#include <omp.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::bench {
namespace {

using kernels::cpu::internal::Dot;
using kernels::cpu::internal::Gemm;
using kernels::cpu::internal::Operand;

// Where query head h of batch b lives: q[b, 0, h*D] in qkv, its key and value heads at
// k[b, 0, (NH+g)*D] and v[b, 0, (NH+NKV+g)*D] (g = h / (NH/NKV), row stride (NH+2NKV)*D),
// out[b, 0, h*D] (row stride NH*D), and att[b, h, 0, 0] (T x T, row stride T). Offsets in
// elements.
struct Head {
  int64_t q, k, v, out, att;
};

Head HeadAt(int64_t b, int64_t h, int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  const int64_t ld = (NH + 2 * NKV) * D, g = h / (NH / NKV), row0 = b * T * ld;
  return {row0 + h * D, row0 + (NH + g) * D, row0 + (NH + NKV + g) * D, b * T * NH * D + h * D,
          (b * NH + h) * T * T};
}

}  // namespace

void FullSquareAttentionForward(float* out, float* att, const float* qkv, int64_t B, int64_t T,
                                int64_t NH, int64_t NKV, int64_t D, int64_t block) {
  assert(NH > 0 && NKV > 0 && NH % NKV == 0 && D > 0 && block > 0);
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);  // this task's GEMMs run on its own thread: heads are the split
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * NH; ++bh) {
      const Head hd = HeadAt(bh / NH, bh % NH, T, NH, NKV, D);
      const float *q = qkv + hd.q, *k = qkv + hd.k, *v = qkv + hd.v;
      float* p = att + hd.att;
      for (int64_t r0 = 0; r0 < T; r0 += block) {
        const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
        float* pb = p + r0 * T;
        // scores[r0:r1, 0:r1] = q[r0:r1] k[0:r1]^T (scaled inside the softmax)
        Gemm(pb, T, Operand{q + r0 * ld, ld, false}, Operand{k, ld, true}, nullptr, rows, D, r1,
             false);
        for (int64_t t = r0; t < r1; ++t) {
          float* row = p + t * T;
          kernels::cpu::internal::Softmax(row, row, t + 1, scale);
          std::fill(row + t + 1, row + T, 0.0f);
        }
        // out[r0:r1] = att[r0:r1, 0:r1] v[0:r1]
        Gemm(out + hd.out + r0 * ldo, ldo, Operand{pb, T, false}, Operand{v, ld, false}, nullptr,
             rows, r1, D, false);
      }
    }
  }
}

void FullSquareAttentionBackward(float* dqkv, const float* dout, const float* qkv,
                                 const float* att, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                 int64_t D, int64_t block) {
  assert(NH > 0 && NKV > 0 && NH % NKV == 0 && D > 0 && block > 0);
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D, group = NH / NKV;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);
    // Per-thread scratch: d(scores) of one query head. Only the blocks on and below the
    // diagonal are written and read; inside a diagonal block the part above the diagonal is
    // zeroed.
    std::vector<float> ds(static_cast<size_t>(T * T));
#pragma omp for schedule(static)
    for (int64_t bg = 0; bg < B * NKV; ++bg) {
      const int64_t b = bg / NKV, g = bg % NKV;
      // The query heads of kv head g, in order: each adds its share to dk and dv.
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const Head hd = HeadAt(b, h, T, NH, NKV, D);
        const float *q = qkv + hd.q, *k = qkv + hd.k, *v = qkv + hd.v;
        const float* p = att + hd.att;
        const float* dy = dout + hd.out;
        float *dq = dqkv + hd.q, *dk = dqkv + hd.k, *dv = dqkv + hd.v;
        // Query blocks: d(scores) and dq.
        for (int64_t r0 = 0; r0 < T; r0 += block) {
          const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
          float* dsb = ds.data() + r0 * T;
          // datt[r0:r1, 0:r1] = dy[r0:r1] v[0:r1]^T
          Gemm(dsb, T, Operand{dy + r0 * ldo, ldo, false}, Operand{v, ld, true}, nullptr, rows,
               D, r1, false);
          // Softmax backward per row: ds = p (datt - sum(p datt)) scale, zero above the
          // diagonal.
          for (int64_t t = r0; t < r1; ++t) {
            const float* pr = p + t * T;
            float* dr = ds.data() + t * T;
            const float dot = Dot(pr, dr, t + 1);
#pragma omp simd
            for (int64_t s = 0; s <= t; ++s) dr[s] = scale * pr[s] * (dr[s] - dot);
            std::fill(dr + t + 1, dr + r1, 0.0f);
          }
          // dq[r0:r1] += ds[r0:r1, 0:r1] k[0:r1]
          Gemm(dq + r0 * ld, ld, Operand{dsb, T, false}, Operand{k, ld, false}, nullptr, rows,
               r1, D, true);
        }
        // Key blocks: dk and dv from the queries that see them, [c0, T).
        for (int64_t c0 = 0; c0 < T; c0 += block) {
          const int64_t c1 = std::min(T, c0 + block), cols = c1 - c0, rows = T - c0;
          // dv[c0:c1] += att[c0:T, c0:c1]^T dy[c0:T]
          Gemm(dv + c0 * ld, ld, Operand{p + c0 * T + c0, T, true},
               Operand{dy + c0 * ldo, ldo, false}, nullptr, cols, rows, D, true);
          // dk[c0:c1] += ds[c0:T, c0:c1]^T q[c0:T]
          Gemm(dk + c0 * ld, ld, Operand{ds.data() + c0 * T + c0, T, true},
               Operand{q + c0 * ld, ld, false}, nullptr, cols, rows, D, true);
        }
      }
    }
  }
}

}  // namespace fsdp::bench
