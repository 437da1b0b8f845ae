// Copy and reduction loops of the collectives (see reduce.h).
#include "collectives/reduce.h"

#include <algorithm>
#include <cstring>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define FSDP_COLL_AVX2 1
#endif
// Streaming stores are compiler builtins that ThreadSanitizer does not see; under TSan every
// write goes through plain stores or memcpy so that races on the buffers are reported.
#if defined(FSDP_COLL_AVX2) && !defined(__SANITIZE_THREAD__)
#define FSDP_COLL_STREAM 1
#endif

namespace fsdp::coll {
namespace {

inline float LoadOne(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kF32: return static_cast<const float*>(p)[i];
    case DType::kBF16: return Bf16ToFloat(static_cast<const uint16_t*>(p)[i]);
    case DType::kF16: return F16ToFloat(static_cast<const uint16_t*>(p)[i]);
    default: return 0;  // only f32, bf16, f16 are reduced (ValidateCall)
  }
}

inline void StoreOne(DType t, void* p, int64_t i, float v) {
  switch (t) {
    case DType::kF32: static_cast<float*>(p)[i] = v; return;
    case DType::kBF16: static_cast<uint16_t*>(p)[i] = FloatToBf16(v); return;
    case DType::kF16: static_cast<uint16_t*>(p)[i] = FloatToF16(v); return;
    default: return;
  }
}

inline float Combine(ReduceOp op, float a, float b) {
  return op == ReduceOp::kMax ? (b > a ? b : a) : a + b;
}

#ifdef FSDP_COLL_AVX2
// 8 elements of `t` at p[i..i+8) as f32.
inline __m256 Load8(DType t, const void* p, int64_t i) {
  switch (t) {
    case DType::kF32: return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    case DType::kBF16: {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    case DType::kF16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
    default: return _mm256_setzero_ps();
  }
}

// f32 -> bf16 bits in the low 16 of each 32-bit lane: round to nearest even, NaN made quiet.
inline __m256i RoundToBf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(rounded, nan, is_nan);
}

// Stores 8 f32 as `t` at p[i..i+8); `stream` requires p + i aligned to the store width.
inline void Store8(DType t, void* p, int64_t i, __m256 v, bool stream) {
  switch (t) {
    case DType::kF32: {
      float* d = static_cast<float*>(p) + i;
      if (stream) _mm256_stream_ps(d, v); else _mm256_storeu_ps(d, v);
      return;
    }
    case DType::kBF16: {
      const __m256i w = RoundToBf16(v);
      const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
      __m128i* d = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i);
      if (stream) _mm_stream_si128(d, packed); else _mm_storeu_si128(d, packed);
      return;
    }
    case DType::kF16: {
      const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
      __m128i* d = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i);
      if (stream) _mm_stream_si128(d, h); else _mm_storeu_si128(d, h);
      return;
    }
    default: return;
  }
}
#endif

// dst[off + i] for i in [0, n): every source is read in the same pass (the hardware
// prefetchers follow several sequential streams well; block-wise passes over one source at a
// time run at half the speed). kStream requires dst + off aligned to 32 bytes.
template <DType T, ReduceOp Op, bool kStream>
void ReduceRange(const void* const* srcs, int nsrc, void* dst, int64_t off, int64_t n, int divisor) {
  int64_t i = 0;
#ifdef FSDP_COLL_AVX2
  const __m256 div = _mm256_set1_ps(static_cast<float>(divisor));
  // max(v, acc) returns acc when v is NaN, as the scalar (v > acc ? v : acc) does.
  auto combine = [](__m256 acc, __m256 v) {
    return Op == ReduceOp::kMax ? _mm256_max_ps(v, acc) : _mm256_add_ps(acc, v);
  };
  auto finish = [&](__m256 v) { return Op == ReduceOp::kAvg ? _mm256_div_ps(v, div) : v; };
  for (; i + 32 <= n; i += 32) {
    const int64_t j = off + i;
    __m256 a0 = Load8(T, srcs[0], j), a1 = Load8(T, srcs[0], j + 8);
    __m256 a2 = Load8(T, srcs[0], j + 16), a3 = Load8(T, srcs[0], j + 24);
    for (int q = 1; q < nsrc; ++q) {
      const void* src = srcs[q];
      a0 = combine(a0, Load8(T, src, j));
      a1 = combine(a1, Load8(T, src, j + 8));
      a2 = combine(a2, Load8(T, src, j + 16));
      a3 = combine(a3, Load8(T, src, j + 24));
    }
    Store8(T, dst, j, finish(a0), kStream);
    Store8(T, dst, j + 8, finish(a1), kStream);
    Store8(T, dst, j + 16, finish(a2), kStream);
    Store8(T, dst, j + 24, finish(a3), kStream);
  }
  for (; i + 8 <= n; i += 8) {
    const int64_t j = off + i;
    __m256 a = Load8(T, srcs[0], j);
    for (int q = 1; q < nsrc; ++q) a = combine(a, Load8(T, srcs[q], j));
    Store8(T, dst, j, finish(a), kStream);
  }
#endif
  for (; i < n; ++i) {
    float a = LoadOne(T, srcs[0], off + i);
    for (int q = 1; q < nsrc; ++q) a = Combine(Op, a, LoadOne(T, srcs[q], off + i));
    if (Op == ReduceOp::kAvg) a = a / static_cast<float>(divisor);
    StoreOne(T, dst, off + i, a);
  }
}

using RangeFn = void (*)(const void* const*, int, void*, int64_t, int64_t, int);

template <DType T>
RangeFn SelectOp(ReduceOp op, bool stream) {
  switch (op) {
    case ReduceOp::kSum: return stream ? &ReduceRange<T, ReduceOp::kSum, true> : &ReduceRange<T, ReduceOp::kSum, false>;
    case ReduceOp::kAvg: return stream ? &ReduceRange<T, ReduceOp::kAvg, true> : &ReduceRange<T, ReduceOp::kAvg, false>;
    case ReduceOp::kMax: return stream ? &ReduceRange<T, ReduceOp::kMax, true> : &ReduceRange<T, ReduceOp::kMax, false>;
  }
  return nullptr;
}

RangeFn Select(DType t, ReduceOp op, bool stream) {
  switch (t) {
    case DType::kF32: return SelectOp<DType::kF32>(op, stream);
    case DType::kBF16: return SelectOp<DType::kBF16>(op, stream);
    case DType::kF16: return SelectOp<DType::kF16>(op, stream);
    default: return nullptr;
  }
}

}  // namespace

void CopyBytes(void* dst, const void* src, size_t bytes) {
  if (dst == src || bytes == 0) return;
#ifdef FSDP_COLL_STREAM
  if (bytes >= kStreamBytes) {
    char* d = static_cast<char*>(dst);
    const char* s = static_cast<const char*>(src);
    const size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;
    std::memcpy(d, s, head);
    size_t i = head;
    for (; i + 128 <= bytes; i += 128) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
      const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    }
    _mm_sfence();  // streaming stores are weakly ordered: publish them before any flag
    std::memcpy(d + i, s + i, bytes - i);
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

void ReduceBuffers(DType t, ReduceOp op, const void* const* srcs, int nsrc, void* dst,
                   int64_t count, int divisor) {
  if (count <= 0) return;
  // Streaming stores for large outputs, on the part of dst aligned to 32 bytes.
  int64_t head = 0;
  bool stream = false;
#ifdef FSDP_COLL_STREAM
  const size_t esize = DTypeSize(t);
  // Not when dst is one of the sources (in place): its lines are in cache already, and a
  // streaming store would evict them.
  const uintptr_t addr = reinterpret_cast<uintptr_t>(dst);
  const bool aliased = std::find(srcs, srcs + nsrc, static_cast<const void*>(dst)) != srcs + nsrc;
  if (static_cast<size_t>(count) * esize >= kStreamBytes && addr % esize == 0 && !aliased) {
    head = static_cast<int64_t>(((32 - (addr & 31)) & 31) / esize);
    stream = true;
  }
#endif
  if (head > 0) Select(t, op, false)(srcs, nsrc, dst, 0, head, divisor);
  Select(t, op, stream)(srcs, nsrc, dst, head, count - head, divisor);
#ifdef FSDP_COLL_AVX2
  if (stream) _mm_sfence();
#endif
}

void WidenToF32(DType t, const void* src, float* dst, int64_t count) {
  if (t == DType::kF32) {
    CopyBytes(dst, src, static_cast<size_t>(count) * 4);
    return;
  }
  int64_t i = 0;
#ifdef FSDP_COLL_AVX2
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, Load8(t, src, i));
#endif
  for (; i < count; ++i) dst[i] = LoadOne(t, src, i);
}

void NarrowFromF32(DType t, const float* src, void* dst, int64_t count, int divisor) {
  if (t == DType::kF32 && divisor == 1) {
    CopyBytes(dst, src, static_cast<size_t>(count) * 4);
    return;
  }
  const float d = static_cast<float>(divisor);
  int64_t i = 0;
#ifdef FSDP_COLL_AVX2
  const __m256 dv = _mm256_set1_ps(d);
  for (; i + 8 <= count; i += 8) {
    __m256 v = _mm256_loadu_ps(src + i);
    if (divisor != 1) v = _mm256_div_ps(v, dv);
    Store8(t, dst, i, v, false);
  }
#endif
  for (; i < count; ++i) StoreOne(t, dst, i, divisor != 1 ? src[i] / d : src[i]);
}

}  // namespace fsdp::coll
