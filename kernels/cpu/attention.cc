// Causal multi-head self-attention, forward and backward. One (batch, head) pair is one
// OpenMP task; inside it the products are single-threaded oneDNN GEMMs on strided views of
// qkv, att and out (no copies). The products are blocked along the sequence so that the
// masked half is skipped: query block i (rows [r0, r1)) only meets keys [0, r1), and key
// block j only receives gradient from queries [c0, T). With blocks of `block` rows, the GEMMs
// compute nb(nb+1)/2 of the nb^2 blocks of the T x T square (nb = T / block), and att still
// holds the full probabilities (zero above the diagonal) for backward. Row softmax and its
// backward are plain loops (vec_math.h) over the causal part of each row.
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

// Where one (b, h) pair lives: q[b, 0, h*D] in qkv (k and v at +C and +2C, row stride 3C),
// out[b, 0, h*D] (row stride C), and att[b, h, 0, 0] (T x T, row stride T).
struct Head {
  int64_t qkv, out, att;
};

Head HeadAt(int64_t bh, int64_t T, int64_t C, int64_t NH) {
  const int64_t b = bh / NH, h = bh % NH, D = C / NH;
  return {b * T * 3 * C + h * D, b * T * C + h * D, bh * T * T};
}

}  // namespace

namespace internal {

void AttentionForward(float* out, float* att, const float* qkv, int64_t B, int64_t T,
                      int64_t C, int64_t NH, int64_t block) {
  assert(NH > 0 && C % NH == 0 && block > 0);
  const int64_t D = C / NH, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);  // this task's GEMMs run on its own thread: heads are the split
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * NH; ++bh) {
      const Head hd = HeadAt(bh, T, C, NH);
      const float* q = qkv + hd.qkv;
      float* p = att + hd.att;
      for (int64_t r0 = 0; r0 < T; r0 += block) {
        const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
        float* pb = p + r0 * T;
        // scores[r0:r1, 0:r1] = q[r0:r1] k[0:r1]^T (scaled inside the softmax)
        Gemm(pb, T, Operand{q + r0 * ld, ld, false}, Operand{q + C, ld, true}, nullptr, rows, D,
             r1, false);
        for (int64_t t = r0; t < r1; ++t) {
          float* row = p + t * T;
          internal::Softmax(row, row, t + 1, scale);
          std::fill(row + t + 1, row + T, 0.0f);
        }
        // out[r0:r1] = att[r0:r1, 0:r1] v[0:r1]
        Gemm(out + hd.out + r0 * C, C, Operand{pb, T, false}, Operand{q + 2 * C, ld, false},
             nullptr, rows, r1, D, false);
      }
    }
  }
}

void AttentionBackward(float* dqkv, const float* dout, const float* qkv, const float* att,
                       int64_t B, int64_t T, int64_t C, int64_t NH, int64_t block) {
  assert(NH > 0 && C % NH == 0 && block > 0);
  const int64_t D = C / NH, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);
    // Per-thread scratch: d(scores). Only the blocks on and below the diagonal are written
    // and read; inside a diagonal block the part above the diagonal is zeroed.
    std::vector<float> ds(static_cast<size_t>(T * T));
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * NH; ++bh) {
      const Head hd = HeadAt(bh, T, C, NH);
      const float* q = qkv + hd.qkv;
      const float* p = att + hd.att;
      const float* dy = dout + hd.out;
      float* dq = dqkv + hd.qkv;
      // Query blocks: d(scores) and dq.
      for (int64_t r0 = 0; r0 < T; r0 += block) {
        const int64_t r1 = std::min(T, r0 + block), rows = r1 - r0;
        float* dsb = ds.data() + r0 * T;
        // datt[r0:r1, 0:r1] = dy[r0:r1] v[0:r1]^T
        Gemm(dsb, T, Operand{dy + r0 * C, C, false}, Operand{q + 2 * C, ld, true}, nullptr, rows,
             D, r1, false);
        // Softmax backward per row: ds = p (datt - sum(p datt)) scale, zero above the diagonal.
        for (int64_t t = r0; t < r1; ++t) {
          const float* pr = p + t * T;
          float* dr = ds.data() + t * T;
          const float dot = Dot(pr, dr, t + 1);
#pragma omp simd
          for (int64_t s = 0; s <= t; ++s) dr[s] = scale * pr[s] * (dr[s] - dot);
          std::fill(dr + t + 1, dr + r1, 0.0f);
        }
        // dq[r0:r1] += ds[r0:r1, 0:r1] k[0:r1]
        Gemm(dq + r0 * ld, ld, Operand{dsb, T, false}, Operand{q + C, ld, false}, nullptr, rows,
             r1, D, true);
      }
      // Key blocks: dk and dv from the queries that see them, [c0, T).
      for (int64_t c0 = 0; c0 < T; c0 += block) {
        const int64_t c1 = std::min(T, c0 + block), cols = c1 - c0, rows = T - c0;
        // dv[c0:c1] += att[c0:T, c0:c1]^T dy[c0:T]
        Gemm(dq + 2 * C + c0 * ld, ld, Operand{p + c0 * T + c0, T, true},
             Operand{dy + c0 * C, C, false}, nullptr, cols, rows, D, true);
        // dk[c0:c1] += ds[c0:T, c0:c1]^T q[c0:T]
        Gemm(dq + C + c0 * ld, ld, Operand{ds.data() + c0 * T + c0, T, true},
             Operand{q + c0 * ld, ld, false}, nullptr, cols, rows, D, true);
      }
    }
  }
}

}  // namespace internal

void attention_forward(float* out, float* att, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH) {
  internal::AttentionForward(out, att, qkv, B, T, C, NH, internal::kAttentionBlock);
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        int64_t B, int64_t T, int64_t C, int64_t NH) {
  internal::AttentionBackward(dqkv, dout, qkv, att, B, T, C, NH, internal::kAttentionBlock);
}

}  // namespace fsdp::kernels::cpu
