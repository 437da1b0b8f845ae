// CUDA element-wise arithmetic, casts, the multi-input reduce and the bias gradient
// (kernels.h), with the semantics of the CPU kernels (elementwise.cc, casts.cc, reductions.cc),
// the host op table (backends/host/host_ops.h: ScaleBy) and ReduceBuffers
// (collectives/reduce.cc).
//
// Design: one thread per element in grid-stride loops (elementwise_utils.cuh), which read
// every input of an element before writing its output, so `out` may be one of the inputs.
// These results are bit-identical to the CPU: one IEEE operation per element, the casts are
// the integer conversions of dtype.h, and reduce combines its inputs in order in f32 and
// rounds once. bias_backward is the exception: each block owns 32 columns, its 32 x 32
// threads sum the rows of a column with a stride of 32, and the 32 partial sums are added in
// a fixed order, so the result is deterministic but rounded differently from the CPU's
// row-by-row sum.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "kernels/cuda/elementwise_utils.cuh"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

namespace fsdp::kernels::cuda {
namespace {

using ew::FirstIndex;
using ew::GridFor;
using ew::GridStride;
using ew::kThreads;

// No __restrict__ on these pointers: `out` may alias an input.
__global__ void AddKernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) out[i] = __fadd_rn(a[i], b[i]);
}

__global__ void AddBackwardKernel(float* da, float* db, const float* dout, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    if (da != nullptr) da[i] = __fadd_rn(da[i], dout[i]);
    if (db != nullptr) db[i] = __fadd_rn(db[i], dout[i]);
  }
}

__global__ void AccumulateKernel(float* dst, const float* src, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) dst[i] = __fadd_rn(dst[i], src[i]);
}

__global__ void CastF32ToBf16Kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) out[i] = ew::FloatToBf16(in[i]);
}

__global__ void CastBf16ToF32Kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) out[i] = ew::Bf16ToFloat(in[i]);
}

__global__ void CastF32ToF16Kernel(uint16_t* out, const float* in, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) out[i] = ew::FloatToF16(in[i]);
}

__global__ void CastF16ToF32Kernel(float* out, const uint16_t* in, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) out[i] = ew::F16ToFloat(in[i]);
}

__global__ void ScaleKernel(float* x, float factor, int64_t n) {
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) x[i] = __fmul_rn(x[i], factor);
}

// As HostOps::ScaleBy: nothing is written when the factor is 1 (a NaN factor scales).
__global__ void ScaleByKernel(float* x, const float* factor, int64_t n) {
  const float f = *factor;
  if (f == 1.0f) return;
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) x[i] = __fmul_rn(x[i], f);
}

// ---- reduce --------------------------------------------------------------------------------

constexpr int kMaxReduceInputs = 16;

// The input pointers, passed by value in the kernel's parameters.
struct ReduceInputs {
  const void* p[kMaxReduceInputs];
};

// Element i of a buffer of dtype D (0 f32, 1 bf16, 2 f16) as f32, and the store back.
template <int D>
__device__ __forceinline__ float Load(const void* p, int64_t i) {
  if constexpr (D == 0) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (D == 1) {
    return ew::Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return ew::F16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

template <int D>
__device__ __forceinline__ void Store(void* p, int64_t i, float v) {
  if constexpr (D == 0) {
    static_cast<float*>(p)[i] = v;
  } else if constexpr (D == 1) {
    static_cast<uint16_t*>(p)[i] = ew::FloatToBf16(v);
  } else {
    static_cast<uint16_t*>(p)[i] = ew::FloatToF16(v);
  }
}

// ReduceRange of collectives/reduce.cc: acc = in[0]; acc = acc op in[q] for q = 1.., with
// max as (v > acc ? v : acc) (a NaN accumulator stays, a NaN input is skipped); avg divides
// the sum by n_in in f32. Op: 0 sum, 1 avg, 2 max.
template <int D, int Op>
__global__ void ReduceKernel(void* out, ReduceInputs ins, int n_in, int64_t n) {
  const float divisor = static_cast<float>(n_in);
  for (int64_t i = FirstIndex(); i < n; i += GridStride()) {
    float acc = Load<D>(ins.p[0], i);
    for (int q = 1; q < n_in; ++q) {
      const float v = Load<D>(ins.p[q], i);
      if constexpr (Op == 2) {
        acc = v > acc ? v : acc;
      } else {
        acc = __fadd_rn(acc, v);
      }
    }
    if constexpr (Op == 1) acc = __fdiv_rn(acc, divisor);
    Store<D>(out, i, acc);
  }
}

template <int D>
void LaunchReduce(cudaStream_t s, void* out, const ReduceInputs& ins, int n_in, int64_t n,
                  int op) {
  switch (op) {
    case 0:
      FSDP_LAUNCH((ReduceKernel<D, 0>), GridFor(n), kThreads, 0, s)(out, ins, n_in, n);
      return;
    case 1:
      FSDP_LAUNCH((ReduceKernel<D, 1>), GridFor(n), kThreads, 0, s)(out, ins, n_in, n);
      return;
    case 2:
      FSDP_LAUNCH((ReduceKernel<D, 2>), GridFor(n), kThreads, 0, s)(out, ins, n_in, n);
      return;
    default: return;
  }
}

// ---- bias_backward -------------------------------------------------------------------------

// Columns per block, and the row lanes that share a column.
constexpr int kBiasCols = 32;
constexpr int kBiasLanes = 32;

// Block (kBiasCols, kBiasLanes). For each block of 32 columns (grid-stride over column
// blocks): thread (x, y) sums rows y, y + 32, ... of column c = 32 * block + x (a warp reads
// 32 consecutive floats of a row), then thread (x, 0) adds the 32 lane sums in lane order and
// adds the total to dbias[c].
__global__ void BiasBackwardKernel(float* dbias, const float* dout, int64_t M, int64_t N) {
  __shared__ float partial[kBiasLanes][kBiasCols + 1];
  const int x = static_cast<int>(threadIdx.x), y = static_cast<int>(threadIdx.y);
  const int64_t col_blocks = (N + kBiasCols - 1) / kBiasCols;
  for (int64_t cb = blockIdx.x; cb < col_blocks; cb += gridDim.x) {  // uniform per block
    const int64_t c = cb * kBiasCols + x;
    float acc = 0.0f;
    if (c < N) {
      for (int64_t r = y; r < M; r += kBiasLanes) acc = __fadd_rn(acc, dout[r * N + c]);
    }
    partial[y][x] = acc;
    __syncthreads();
    if (y == 0 && c < N) {
      float total = partial[0][x];
      for (int l = 1; l < kBiasLanes; ++l) total = __fadd_rn(total, partial[l][x]);
      dbias[c] = __fadd_rn(dbias[c], total);
    }
    __syncthreads();  // partial is rewritten by the next column block
  }
}

}  // namespace

void add(cudaStream_t s, float* out, const float* a, const float* b, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(AddKernel, GridFor(n), kThreads, 0, s)(out, a, b, n);
}

void add_backward(cudaStream_t s, float* da, float* db, const float* dout, int64_t n) {
  if (n <= 0 || (da == nullptr && db == nullptr)) return;
  FSDP_LAUNCH(AddBackwardKernel, GridFor(n), kThreads, 0, s)(da, db, dout, n);
}

void accumulate(cudaStream_t s, float* dst, const float* src, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(AccumulateKernel, GridFor(n), kThreads, 0, s)(dst, src, n);
}

void cast_f32_to_bf16(cudaStream_t s, uint16_t* out, const float* in, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(CastF32ToBf16Kernel, GridFor(n), kThreads, 0, s)(out, in, n);
}

void cast_bf16_to_f32(cudaStream_t s, float* out, const uint16_t* in, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(CastBf16ToF32Kernel, GridFor(n), kThreads, 0, s)(out, in, n);
}

void cast_f32_to_f16(cudaStream_t s, uint16_t* out, const float* in, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(CastF32ToF16Kernel, GridFor(n), kThreads, 0, s)(out, in, n);
}

void cast_f16_to_f32(cudaStream_t s, float* out, const uint16_t* in, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(CastF16ToF32Kernel, GridFor(n), kThreads, 0, s)(out, in, n);
}

void scale(cudaStream_t s, float* x, float factor, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(ScaleKernel, GridFor(n), kThreads, 0, s)(x, factor, n);
}

void scale_by(cudaStream_t s, float* x, const float* factor, int64_t n) {
  if (n <= 0) return;
  FSDP_LAUNCH(ScaleByKernel, GridFor(n), kThreads, 0, s)(x, factor, n);
}

void reduce(cudaStream_t s, void* out, const void* const* ins, int n_in, int64_t n, int dtype,
            int op) {
  // Outside the contract (no input, more than 16, an unknown dtype or op): nothing is launched.
  if (n <= 0 || n_in < 1 || n_in > kMaxReduceInputs) return;
  ReduceInputs in{};
  for (int q = 0; q < n_in; ++q) in.p[q] = ins[q];
  switch (dtype) {
    case 0: LaunchReduce<0>(s, out, in, n_in, n, op); return;
    case 1: LaunchReduce<1>(s, out, in, n_in, n, op); return;
    case 2: LaunchReduce<2>(s, out, in, n_in, n, op); return;
    default: return;
  }
}

void bias_backward(cudaStream_t s, float* dbias, const float* dout, int64_t M, int64_t N) {
  if (M <= 0 || N <= 0 || dbias == nullptr) return;
  const int64_t col_blocks = (N + kBiasCols - 1) / kBiasCols;
  const unsigned int grid = static_cast<unsigned int>(std::min<int64_t>(col_blocks, ew::kMaxBlocks));
  FSDP_LAUNCH(BiasBackwardKernel, grid, dim3(kBiasCols, kBiasLanes), 0, s)(dbias, dout, M, N);
}

}  // namespace fsdp::kernels::cuda
