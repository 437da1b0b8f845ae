// The memory loops of the collectives: copies and element-wise reductions over the buffers of
// several ranks. Bandwidth-bound, so: AVX2 where built for it, one pass that reads every
// source at once (accumulating in f32 registers), and streaming stores for large outputs so
// that a 64 MiB copy does not first read the destination into cache.
#pragma once

#include <cstddef>
#include <cstdint>

#include "fsdp/communicator.h"
#include "fsdp/dtype.h"

namespace fsdp::coll {

// memcpy, with streaming stores from kStreamBytes on.
inline constexpr size_t kStreamBytes = size_t{1} << 20;
void CopyBytes(void* dst, const void* src, size_t bytes);

// dst[i] = srcs[0][i] op srcs[1][i] op ... in source order, computed in f32 and rounded once
// to `dtype`; kAvg divides the sum by `divisor` (in f32). dst may alias one of the sources
// exactly (same pointer), not partially.
void ReduceBuffers(DType dtype, ReduceOp op, const void* const* srcs, int nsrc, void* dst,
                   int64_t count, int divisor);

// Widening and narrowing between a dtype and f32 (round to nearest even); Narrow divides by
// `divisor` first when it is not 1.
void WidenToF32(DType dtype, const void* src, float* dst, int64_t count);
void NarrowFromF32(DType dtype, const float* src, void* dst, int64_t count, int divisor);

}  // namespace fsdp::coll
