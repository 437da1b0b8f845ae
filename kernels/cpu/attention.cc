// Causal multi-head self-attention, forward and backward. One (batch, head) pair is one
// OpenMP task; inside it the four T x T products are single-threaded oneDNN GEMMs on strided
// views of qkv, att and out (no copies). The products are full T x T: att is zero above the
// diagonal, so the mask costs only the wasted upper half, and a oneDNN GEMM still beats a
// triangular loop by far. Row softmax and its backward are plain loops (vec_math.h).
#include <omp.h>

#include <algorithm>
#include <cassert>
#include <cmath>
#include <vector>

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

void attention_forward(float* out, float* att, const float* qkv, int64_t B, int64_t T,
                       int64_t C, int64_t NH) {
  assert(NH > 0 && C % NH == 0);
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
      // scores = q k^T (scaled inside the softmax)
      Gemm(p, T, Operand{q, ld, false}, Operand{q + C, ld, true}, nullptr, T, D, T, false);
      for (int64_t t = 0; t < T; ++t) {
        float* row = p + t * T;
        internal::Softmax(row, row, t + 1, scale);
        std::fill(row + t + 1, row + T, 0.0f);
      }
      // out = att v
      Gemm(out + hd.out, C, Operand{p, T, false}, Operand{q + 2 * C, ld, false}, nullptr, T, T,
           D, false);
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att,
                        int64_t B, int64_t T, int64_t C, int64_t NH) {
  assert(NH > 0 && C % NH == 0);
  const int64_t D = C / NH, ld = 3 * C;
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
#pragma omp parallel
  {
    omp_set_num_threads(1);
    std::vector<float> ds(static_cast<size_t>(T * T));  // per-thread scratch: d(scores)
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * NH; ++bh) {
      const Head hd = HeadAt(bh, T, C, NH);
      const float* q = qkv + hd.qkv;
      const float* p = att + hd.att;
      const float* dy = dout + hd.out;
      float* dq = dqkv + hd.qkv;
      // dv += att^T dy
      Gemm(dq + 2 * C, ld, Operand{p, T, true}, Operand{dy, C, false}, nullptr, T, T, D, true);
      // datt = dy v^T
      Gemm(ds.data(), T, Operand{dy, C, false}, Operand{q + 2 * C, ld, true}, nullptr, T, D, T,
           false);
      // Softmax backward per row: ds = p (datt - sum(p datt)) scale; zero above the diagonal
      // so the full-size GEMMs below see the causal mask.
      for (int64_t t = 0; t < T; ++t) {
        const float* pr = p + t * T;
        float* dr = ds.data() + t * T;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t s = 0; s <= t; ++s) dot += pr[s] * dr[s];
#pragma omp simd
        for (int64_t s = 0; s <= t; ++s) dr[s] = scale * pr[s] * (dr[s] - dot);
        std::fill(dr + t + 1, dr + T, 0.0f);
      }
      // dq += ds k;  dk += ds^T q
      Gemm(dq, ld, Operand{ds.data(), T, false}, Operand{q + C, ld, false}, nullptr, T, T, D,
           true);
      Gemm(dq + C, ld, Operand{ds.data(), T, true}, Operand{q, ld, false}, nullptr, T, T, D,
           true);
    }
  }
}

}  // namespace fsdp::kernels::cpu
