// Causal self-attention, forward and backward, with NH query heads sharing NKV key/value heads
// (grouped-query attention; multi-head attention is NKV = NH), with the semantics of the CPU
// kernels (kernels/cpu/attention.cc): raw scores s = q.k, probabilities
// p = exp((s - max) * scale) / sum over the causal part of the row, scale = 1 / sqrt(D)
// computed as there, and no T x T matrix in memory: forward keeps the output and one
// log-sum-exp per row, lse = max * scale + log(sum), and backward recomputes
// p = exp(s * scale - lse) tile by tile (FlashAttention-2's contract).
//
// The sequence is cut into tiles of kTile = 32 rows. A block of 256 threads works on one tile
// of rows; thread (r, c) = (tid / 8, tid % 8) owns row r of it and, with the other 7 threads
// of that row, splits the 32 rows of the opposite tile (rows c + 8i) and the D columns of the
// head (columns c + 8i). Tiles of q, k, v and dout sit in shared memory with rows padded to
// D + 1 floats (so that column walks hit distinct banks); scores, probabilities and their
// gradients stay in registers, or in a 32 x 33 tile when other threads need them. Only tile
// pairs on or below the diagonal are computed. Everything is f32; sums run in a fixed order,
// so results do not change from run to run.
//
// Forward: a block per (batch, query head, query tile). Pass 1 runs over the key tiles up to
// the diagonal with an online softmax (row max of the raw scores and sum of exp, the sum
// rescaled when the max grows) and writes lse; pass 2 recomputes the scores and adds p v into
// registers, then writes out.
// Backward: (1) a block per (batch, query head, query tile) puts dot[t] = dout[t] . out[t]
// (= sum_j p[t,j] dp[t,j], dp = dout v^T) into `workspace`, then over the key tiles recomputes
// p from q, k and lse, forms ds = scale * p * (dp - dot) and adds ds k into dq. (2) a block per
// (batch, kv head, key tile) loops over the query heads of the group and the query tiles from
// the diagonal on, recomputes p and ds for the tile pair and adds p^T dout into dv and ds^T q
// into dk; each element of dk and dv is summed by one thread, so there are no atomics.
//
// Head sizes D <= kMaxD = 256: the kernels are instantiated for D <= 32, 64, 128 and 256 (the
// bound sizes the per-thread accumulators). Shared memory is 4 * (64 (D + 1) + 1056) bytes
// (forward), 4 * (96 (D + 1) + 1056) (dq) and 4 * (96 (D + 1) + 2112) (dk, dv): above 48 KiB
// (D > 105 for dk, dv) the launcher opts the kernel in to what it needs (at most 105 KiB,
// D = 256). Unsupported shapes (D > kMaxD, NH not a multiple of NKV, a grid over 2^31 - 1
// blocks) launch nothing and leave cudaErrorInvalidConfiguration for the caller's
// cudaGetLastError().
#include <cmath>
#include <cstdint>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace fsdp::kernels::cuda {
namespace {

constexpr int kTile = 32;                  // rows of a query tile, and of a key tile
constexpr int kLanes = 8;                  // threads that share one row of a tile
constexpr int kThreads = kTile * kLanes;   // threads per block
constexpr int kPer = kTile / kLanes;       // rows of the opposite tile per thread: c + kLanes*i
constexpr int kPad = kTile + 1;            // row stride of a kTile x kTile tile in shared memory
constexpr int64_t kMaxD = 256;
constexpr int64_t kDefaultSmem = 48 * 1024;  // dynamic shared memory without opting in

// Blocks per SM the kernels are compiled for: 2 caps the registers at 128 a thread, which the
// accumulators of D <= 128 fit without spilling; D <= 256 needs more.
constexpr int MinBlocks(int dmax) { return dmax <= 128 ? 2 : 1; }

// Shared memory: `big` kTile x (D + 1) tiles and `small` kTile x kPad tiles.
int64_t SmemBytes(int64_t D, int big, int small) {
  return (big * kTile * (D + 1) + small * kTile * kPad) * static_cast<int64_t>(sizeof(float));
}

// ---- device helpers ------------------------------------------------------------------------

// Rows [row0, row0 + kTile) of a matrix with row stride ld, D columns from `base`, into
// tile[kTile][D + 1]; rows at or past T are zeros. A warp per row, its lanes along the row.
__device__ __forceinline__ void LoadTile(float* tile, const float* base, int64_t ld,
                                         int64_t row0, int64_t T, int D) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int r = warp; r < kTile; r += kThreads / 32) {
    const int64_t t = row0 + r;
    float* dst = tile + r * (D + 1);
    if (t < T) {
      const float* src = base + t * ld;
      for (int d = lane; d < D; d += 32) dst[d] = src[d];
    } else {
      for (int d = lane; d < D; d += 32) dst[d] = 0.0f;
    }
  }
}

// Sum / max over the kLanes threads of a row (lanes kLanes*k .. kLanes*k + kLanes-1 of a warp),
// by an xor butterfly: each of them gets the same value, bit for bit. Every thread of the warp
// must call it.
__device__ __forceinline__ float RowSum(float x) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffffu, x, offset);
  }
  return x;
}

__device__ __forceinline__ float RowMax(float x) {
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
  }
  return x;
}

// s[i] = sum over d in order of a[d] * rows[c + kLanes*i][d], rows a tile of row stride D + 1.
__device__ __forceinline__ void DotRows(float (&s)[kPer], const float* a, const float* rows,
                                        int c, int D) {
  const int ld = D + 1;
#pragma unroll
  for (int i = 0; i < kPer; ++i) s[i] = 0.0f;
#pragma unroll 4
  for (int d = 0; d < D; ++d) {
    const float x = a[d];
#pragma unroll
    for (int i = 0; i < kPer; ++i) s[i] = fmaf(x, rows[(c + kLanes * i) * ld + d], s[i]);
  }
}

// acc[i] += sum over j in order of p[j * stride] * rows[j][c + kLanes*i], for the kTile rows j
// of a tile of row stride D + 1 and the columns c + kLanes*i < D.
template <int DMax>
__device__ __forceinline__ void AccumulateRows(float (&acc)[DMax / kLanes], const float* p,
                                               int stride, const float* rows, int c, int D) {
  const int ld = D + 1;
#pragma unroll 2
  for (int j = 0; j < kTile; ++j) {
    const float pj = p[j * stride];
#pragma unroll
    for (int i = 0; i < DMax / kLanes; ++i) {
      const int d = c + kLanes * i;
      if (d < D) acc[i] = fmaf(pj, rows[j * ld + d], acc[i]);
    }
  }
}

// ---- kernels -------------------------------------------------------------------------------
// Grids are one-dimensional, block = i * BH + bh (bh = b * NH + h, or b * NKV + g), the tiles
// in order of decreasing work: query tile tiles - 1 - i, key tile i.

// Block (b, h, query tile qt): rows t = qt * kTile + r of out and lse.
template <int DMax>
__global__ void __launch_bounds__(kThreads, MinBlocks(DMax))
    AttentionForwardKernel(float* out, float* lse, const float* qkv, int64_t T, int64_t NH,
                           int64_t NKV, int D, float scale, int64_t BH, int64_t tiles) {
  FSDP_DYNAMIC_SHARED(float, smem);
  float* sq = smem;                    // [kTile][D + 1]: q rows of the tile
  float* skv = sq + kTile * (D + 1);   // [kTile][D + 1]: k, then v, rows of a key tile
  float* sp = skv + kTile * (D + 1);   // [kTile][kPad]: p of the tile pair

  const int64_t bh = blockIdx.x % BH, qt = tiles - 1 - blockIdx.x / BH;
  const int64_t b = bh / NH, h = bh % NH, g = h / (NH / NKV);
  const int64_t ld = (NH + 2 * NKV) * D;
  const float* q = qkv + b * T * ld + h * D;
  const float* k = qkv + b * T * ld + (NH + g) * D;
  const float* v = qkv + b * T * ld + (NH + NKV + g) * D;
  const int r = threadIdx.x / kLanes, c = threadIdx.x % kLanes;
  const int64_t q0 = qt * kTile, t = q0 + r;
  const bool row_ok = t < T;  // else a padding row: computed, not stored

  LoadTile(sq, q, ld, q0, T, D);
  float s[kPer];

  // Pass 1: m = max of the raw scores of row t, l = sum of exp((s - m) * scale). Key 0 is in
  // the first tile, so m is finite after it (for finite inputs).
  float m = -INFINITY, l = 0.0f;
  for (int64_t kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = kt * kTile;
    __syncthreads();  // the previous tile's readers are done
    LoadTile(skv, k, ld, k0, T, D);
    __syncthreads();
    DotRows(s, sq + r * (D + 1), skv, c, D);
    const bool diag = kt == qt;  // key k0 + jj <= t: jj <= r on the diagonal, all below it
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (!diag || c + kLanes * i <= r) mx = fmaxf(mx, s[i]);
    }
    const float m_new = fmaxf(m, RowMax(mx));
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      if (!diag || c + kLanes * i <= r) sum += expf((s[i] - m_new) * scale);
    }
    l = l * expf((m - m_new) * scale) + RowSum(sum);
    m = m_new;
  }
  if (row_ok && c == 0) lse[bh * T + t] = m * scale + logf(l);

  // Pass 2: p[t, j] = exp((s - m) * scale) / l for j <= t, else 0; o += p v.
  const float inv = 1.0f / l;
  float o[DMax / kLanes];
#pragma unroll
  for (int i = 0; i < DMax / kLanes; ++i) o[i] = 0.0f;
  for (int64_t kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = kt * kTile;
    __syncthreads();  // the previous tile's readers of skv and sp are done
    LoadTile(skv, k, ld, k0, T, D);
    __syncthreads();
    DotRows(s, sq + r * (D + 1), skv, c, D);
    const bool diag = kt == qt;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int jj = c + kLanes * i;
      sp[r * kPad + jj] = !diag || jj <= r ? expf((s[i] - m) * scale) * inv : 0.0f;
    }
    __syncthreads();  // sp is complete; the readers of k are done
    LoadTile(skv, v, ld, k0, T, D);
    __syncthreads();
    AccumulateRows<DMax>(o, sp + r * kPad, 1, skv, c, D);
  }
  if (row_ok) {
    float* y = out + (b * T + t) * NH * D + h * D;
#pragma unroll
    for (int i = 0; i < DMax / kLanes; ++i) {
      const int d = c + kLanes * i;
      if (d < D) y[d] = o[i];
    }
  }
}

// Block (b, h, query tile qt): dot[t] into workspace, then dq[t] += sum_j ds[t, j] k[j].
template <int DMax>
__global__ void __launch_bounds__(kThreads, MinBlocks(DMax))
    AttentionBackwardQueryKernel(float* dqkv, float* workspace, const float* dout,
                                 const float* qkv, const float* out, const float* lse,
                                 int64_t T, int64_t NH, int64_t NKV, int D, float scale,
                                 int64_t BH, int64_t tiles) {
  FSDP_DYNAMIC_SHARED(float, smem);
  float* sq = smem;                    // [kTile][D + 1]: q rows of the tile
  float* sy = sq + kTile * (D + 1);    // [kTile][D + 1]: dout rows of the tile
  float* skv = sy + kTile * (D + 1);   // [kTile][D + 1]: k, then v, then k, rows of a key tile
  float* sds = skv + kTile * (D + 1);  // [kTile][kPad]: ds of the tile pair

  const int64_t bh = blockIdx.x % BH, qt = tiles - 1 - blockIdx.x / BH;
  const int64_t b = bh / NH, h = bh % NH, g = h / (NH / NKV);
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D;
  const float* q = qkv + b * T * ld + h * D;
  const float* k = qkv + b * T * ld + (NH + g) * D;
  const float* v = qkv + b * T * ld + (NH + NKV + g) * D;
  const float* dy = dout + b * T * ldo + h * D;
  const int r = threadIdx.x / kLanes, c = threadIdx.x % kLanes;
  const int64_t q0 = qt * kTile, t = q0 + r;
  const bool row_ok = t < T;  // else a padding row: computed, not stored

  LoadTile(sq, q, ld, q0, T, D);
  LoadTile(sy, dy, ldo, q0, T, D);

  // dot = dout[t] . out[t], each of the row's threads over columns c + kLanes*i.
  float acc = 0.0f;
  if (row_ok) {
    const float* y = out + (b * T + t) * ldo + h * D;
    const float* gy = dy + t * ldo;
    for (int d = c; d < D; d += kLanes) acc = fmaf(gy[d], y[d], acc);
  }
  const float dot = RowSum(acc);
  const float m = row_ok ? lse[bh * T + t] : 0.0f;
  if (c == 0 && row_ok) workspace[bh * T + t] = dot;

  // ds = scale * p * (dp - dot) for j <= t, else 0; dq += ds k.
  float dq[DMax / kLanes];
#pragma unroll
  for (int i = 0; i < DMax / kLanes; ++i) dq[i] = 0.0f;
  float p[kPer], dp[kPer];
  for (int64_t kt = 0; kt <= qt; ++kt) {
    const int64_t k0 = kt * kTile;
    const bool diag = kt == qt;  // key k0 + jj <= t: jj <= r on the diagonal, all below it
    __syncthreads();  // the previous tile's readers of skv and sds are done
    LoadTile(skv, k, ld, k0, T, D);
    __syncthreads();
    DotRows(p, sq + r * (D + 1), skv, c, D);
#pragma unroll
    for (int i = 0; i < kPer; ++i) p[i] = expf(p[i] * scale - m);
    __syncthreads();  // the readers of k are done
    LoadTile(skv, v, ld, k0, T, D);
    __syncthreads();
    DotRows(dp, sy + r * (D + 1), skv, c, D);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int jj = c + kLanes * i;
      sds[r * kPad + jj] = row_ok && (!diag || jj <= r) ? scale * p[i] * (dp[i] - dot) : 0.0f;
    }
    __syncthreads();  // sds is complete; the readers of v are done
    LoadTile(skv, k, ld, k0, T, D);
    __syncthreads();
    AccumulateRows<DMax>(dq, sds + r * kPad, 1, skv, c, D);
  }
  if (row_ok) {
    float* gq = dqkv + (b * T + t) * ld + h * D;
#pragma unroll
    for (int i = 0; i < DMax / kLanes; ++i) {
      const int d = c + kLanes * i;
      if (d < D) gq[d] += dq[i];
    }
  }
}

// Block (b, kv head g, key tile kt): rows j = kt * kTile + r of dk and dv, summed over the query
// heads of the group (in order) and the query tiles qt >= kt (in order).
template <int DMax>
__global__ void __launch_bounds__(kThreads, MinBlocks(DMax))
    AttentionBackwardKeyKernel(float* dqkv, const float* workspace, const float* dout,
                               const float* qkv, const float* lse, int64_t T, int64_t NH,
                               int64_t NKV, int D, float scale, int64_t BG, int64_t tiles) {
  FSDP_DYNAMIC_SHARED(float, smem);
  float* sk = smem;                   // [kTile][D + 1]: k rows of the key tile
  float* sv = sk + kTile * (D + 1);   // [kTile][D + 1]: v rows of the key tile
  float* sx = sv + kTile * (D + 1);   // [kTile][D + 1]: q, then dout, then q, of a query tile
  float* sp = sx + kTile * (D + 1);   // [kTile][kPad]: p[q0 + tt, k0 + jj] at [tt][jj]
  float* sds = sp + kTile * kPad;     // [kTile][kPad]: ds, laid out as sp

  const int64_t bg = blockIdx.x % BG, kt = blockIdx.x / BG;
  const int64_t b = bg / NKV, g = bg % NKV, group = NH / NKV;
  const int64_t ld = (NH + 2 * NKV) * D, ldo = NH * D;
  const float* x0 = qkv + b * T * ld;  // row 0 of batch b
  const int r = threadIdx.x / kLanes, c = threadIdx.x % kLanes;
  const int64_t k0 = kt * kTile, j = k0 + r;  // j >= T: a padding row, computed, not stored

  LoadTile(sk, x0 + (NH + g) * D, ld, k0, T, D);
  LoadTile(sv, x0 + (NH + NKV + g) * D, ld, k0, T, D);
  float dk[DMax / kLanes], dv[DMax / kLanes];
#pragma unroll
  for (int i = 0; i < DMax / kLanes; ++i) dk[i] = dv[i] = 0.0f;
  float s[kPer], dp[kPer];
  for (int64_t h = g * group; h < (g + 1) * group; ++h) {
    const float* q = x0 + h * D;
    const float* dy = dout + b * T * ldo + h * D;
    const float* l = lse + (b * NH + h) * T;
    const float* dot = workspace + (b * NH + h) * T;
    for (int64_t qt = kt; qt < tiles; ++qt) {
      const int64_t q0 = qt * kTile;
      const int64_t rows = T - q0;  // query rows of the tile that exist: tt < rows
      const bool diag = qt == kt;   // query q0 + tt >= key k0 + jj: jj <= tt on the diagonal
      __syncthreads();  // the previous tile's readers of sx, sp and sds are done
      LoadTile(sx, q, ld, q0, T, D);
      __syncthreads();
      // s[i] = k[j] . q[t] for the query rows t = q0 + c + kLanes*i; p from lse.
      DotRows(s, sk + r * (D + 1), sx, c, D);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int tt = c + kLanes * i;
        sp[tt * kPad + r] =
            tt < rows && (!diag || r <= tt) ? expf(s[i] * scale - l[q0 + tt]) : 0.0f;
      }
      __syncthreads();  // sp is complete; the readers of q are done
      LoadTile(sx, dy, ldo, q0, T, D);
      __syncthreads();
      // dp[i] = dout[t] . v[j] for the same query rows.
      DotRows(dp, sv + r * (D + 1), sx, c, D);
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int tt = c + kLanes * i;
        sds[tt * kPad + r] = tt < rows && (!diag || r <= tt)
                                 ? scale * sp[tt * kPad + r] * (dp[i] - dot[q0 + tt])
                                 : 0.0f;
      }
      AccumulateRows<DMax>(dv, sp + r, kPad, sx, c, D);  // dv[j] += sum_t p[t, j] dout[t]
      __syncthreads();  // sds is complete; the readers of dout are done
      LoadTile(sx, q, ld, q0, T, D);
      __syncthreads();
      AccumulateRows<DMax>(dk, sds + r, kPad, sx, c, D);  // dk[j] += sum_t ds[t, j] q[t]
    }
  }
  if (j < T) {
    float* gk = dqkv + (b * T + j) * ld + (NH + g) * D;
    float* gv = dqkv + (b * T + j) * ld + (NH + NKV + g) * D;
#pragma unroll
    for (int i = 0; i < DMax / kLanes; ++i) {
      const int d = c + kLanes * i;
      if (d < D) {
        gk[d] += dk[i];
        gv[d] += dv[i];
      }
    }
  }
}

__global__ void UnsupportedShapeKernel() {}

// ---- launchers -----------------------------------------------------------------------------

// A launch of zero blocks: it fails with cudaErrorInvalidConfiguration, which the caller's
// cudaGetLastError() then reports.
void FailLaunch(cudaStream_t s) { FSDP_LAUNCH(UnsupportedShapeKernel, 0, 1, 0, s)(); }

// The accumulator bound for head size D: 32, 64, 128 or 256; 0 when D is not supported.
int DMaxFor(int64_t D) {
  if (D < 1 || D > kMaxD) return 0;
  return D <= 32 ? 32 : D <= 64 ? 64 : D <= 128 ? 128 : 256;
}

// Whether the shape is supported and `heads` * tiles blocks fit a one-dimensional grid.
bool Supported(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t D, int64_t heads) {
  if (B < 1 || T < 1 || NH < 1 || NKV < 1 || NH % NKV != 0 || DMaxFor(D) == 0) return false;
  const int64_t tiles = (T + kTile - 1) / kTile;
  return tiles <= INT32_MAX / (B * heads);
}

// Launches `kernel` with `bytes` of dynamic shared memory, opting in first when that is more
// than the default (the opt-in's error, if any, shows as the launch's).
template <typename Kernel, typename... Args>
void Launch(Kernel* kernel, int64_t blocks, int64_t bytes, cudaStream_t s, Args... args) {
  if (bytes > kDefaultSmem) {
    (void)cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               static_cast<int>(bytes));
  }
  FSDP_LAUNCH(kernel, static_cast<unsigned int>(blocks), kThreads, static_cast<size_t>(bytes), s)
  (args...);
}

template <int DMax>
void Forward(cudaStream_t s, float* out, float* lse, const float* qkv, int64_t B, int64_t T,
             int64_t NH, int64_t NKV, int64_t D, float scale) {
  const int64_t tiles = (T + kTile - 1) / kTile;
  Launch(AttentionForwardKernel<DMax>, tiles * B * NH, SmemBytes(D, 2, 1), s, out, lse, qkv, T,
         NH, NKV, static_cast<int>(D), scale, B * NH, tiles);
}

template <int DMax>
void Backward(cudaStream_t s, float* dqkv, const float* dout, const float* qkv,
              const float* out, const float* lse, int64_t B, int64_t T, int64_t NH,
              int64_t NKV, int64_t D, float scale, float* workspace) {
  const int64_t tiles = (T + kTile - 1) / kTile;
  Launch(AttentionBackwardQueryKernel<DMax>, tiles * B * NH, SmemBytes(D, 3, 1), s, dqkv,
         workspace, dout, qkv, out, lse, T, NH, NKV, static_cast<int>(D), scale, B * NH, tiles);
  Launch(AttentionBackwardKeyKernel<DMax>, tiles * B * NKV, SmemBytes(D, 3, 2), s, dqkv,
         static_cast<const float*>(workspace), dout, qkv, lse, T, NH, NKV, static_cast<int>(D),
         scale, B * NKV, tiles);
}

}  // namespace

void attention_forward(cudaStream_t s, float* out, float* lse, const float* qkv, int64_t B,
                       int64_t T, int64_t NH, int64_t NKV, int64_t D) {
  if (B * NH * T == 0) return;
  if (!Supported(B, T, NH, NKV, D, NH)) return FailLaunch(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));  // as the CPU kernels
  switch (DMaxFor(D)) {
    case 32: return Forward<32>(s, out, lse, qkv, B, T, NH, NKV, D, scale);
    case 64: return Forward<64>(s, out, lse, qkv, B, T, NH, NKV, D, scale);
    case 128: return Forward<128>(s, out, lse, qkv, B, T, NH, NKV, D, scale);
    default: return Forward<256>(s, out, lse, qkv, B, T, NH, NKV, D, scale);
  }
}

void attention_backward(cudaStream_t s, float* dqkv, const float* dout, const float* qkv,
                        const float* out, const float* lse, int64_t B, int64_t T, int64_t NH,
                        int64_t NKV, int64_t D, float* workspace) {
  if (B * NH * T == 0 || dqkv == nullptr) return;
  if (!Supported(B, T, NH, NKV, D, NH)) return FailLaunch(s);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  switch (DMaxFor(D)) {
#define FSDP_ATTENTION_BACKWARD(DMAX) \
  Backward<DMAX>(s, dqkv, dout, qkv, out, lse, B, T, NH, NKV, D, scale, workspace)
    case 32: return FSDP_ATTENTION_BACKWARD(32);
    case 64: return FSDP_ATTENTION_BACKWARD(64);
    case 128: return FSDP_ATTENTION_BACKWARD(128);
    default: return FSDP_ATTENTION_BACKWARD(256);
#undef FSDP_ATTENTION_BACKWARD
  }
}

}  // namespace fsdp::kernels::cuda
