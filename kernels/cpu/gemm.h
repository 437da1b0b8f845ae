// Private: the one GEMM of the CPU kernels, on the oneDNN matmul primitive. Operands are
// strided views (leading dimensions in elements); a transposed operand is the same memory
// described with swapped strides (format `ba` when dense), never a copy. Operands are f32, or
// bf16/f16 (raw 16-bit values) for the low-precision matmuls; C and the bias are always f32
// and the products accumulate in f32.
#pragma once

#include <cstdint>

#include "fsdp/dtype.h"

namespace fsdp::kernels::cpu::internal {

struct Operand {
  const void* data;  // elements of `dtype`
  int64_t ld;        // elements between consecutive rows of the stored matrix
  bool transposed;   // use the stored matrix transposed
  DType dtype = DType::kF32;
};

// C[M,N] = op(A)[M,K] . op(B)[K,N] (+ bias[N] if not null), or C += ... when `accumulate`
// (a oneDNN `sum` post-op, so no temporary). C has leading dimension ldc.
// Runs on the calling thread's OpenMP thread count; safe to call from several threads at
// once (each thread keeps its own oneDNN engine, stream and primitives).
void Gemm(float* c, int64_t ldc, Operand a, Operand b, const float* bias, int64_t M, int64_t K,
          int64_t N, bool accumulate);

// As Gemm, but returns false (computing nothing) when oneDNN has no matmul for these operand
// types on this CPU; the answer is cached per thread and shape. Other failures abort, as in
// Gemm.
bool TryGemm(float* c, int64_t ldc, Operand a, Operand b, const float* bias, int64_t M,
             int64_t K, int64_t N, bool accumulate);

}  // namespace fsdp::kernels::cpu::internal
