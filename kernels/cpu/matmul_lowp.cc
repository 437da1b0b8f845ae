// Low-precision Linear layer (bf16/f16 weights, f32 activations and gradients): the f32
// operands are rounded into thread-local 16-bit scratch and multiplied by oneDNN with f32
// accumulation; where oneDNN cannot, every operand is upcast and the f32 GEMM runs on the
// same rounded values.
#include <cstdlib>
#include <cstring>
#include <memory>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/column_sum.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

using internal::Gemm;
using internal::Operand;
using internal::TryGemm;

// A growable scratch array that is never zero-filled (every use overwrites what it reads).
template <typename T>
class Scratch {
 public:
  T* Get(int64_t n) {
    if (n > capacity_) {
      data_.reset(new T[static_cast<size_t>(n)]);
      capacity_ = n;
    }
    return data_.get();
  }

 private:
  std::unique_ptr<T[]> data_;
  int64_t capacity_ = 0;
};

// One set per thread: rank threads call kernels concurrently.
struct LowpScratch {
  Scratch<uint16_t> inp, dout;                    // f32 operands rounded to the 16-bit type
  Scratch<float> bias, weight, inp_f32, dout_f32;  // upcasts (the bias always; rest: fallback)
};

LowpScratch& ThreadScratch() {
  thread_local LowpScratch s;
  return s;
}

bool ForcedFallback() {
  const char* v = std::getenv("FSDP_FORCE_LOWP_FALLBACK");
  return v != nullptr && std::strcmp(v, "1") == 0;
}

void Downcast(uint16_t* out, const float* in, int64_t n, DType dtype) {
  if (dtype == DType::kBF16) {
    cast_f32_to_bf16(out, in, n);
  } else {
    cast_f32_to_f16(out, in, n);
  }
}

void Upcast(float* out, const void* in, int64_t n, DType dtype) {
  if (dtype == DType::kBF16) {
    cast_bf16_to_f32(out, static_cast<const uint16_t*>(in), n);
  } else {
    cast_f16_to_f32(out, static_cast<const uint16_t*>(in), n);
  }
}

// An f32 operand rounded to `dtype`, in scratch.
const uint16_t* Rounded(Scratch<uint16_t>& s, const float* x, int64_t n, DType dtype) {
  uint16_t* out = s.Get(n);
  Downcast(out, x, n, dtype);
  return out;
}

// An f32 operand rounded to `dtype` and kept in f32 (one pass), for the f32 GEMM.
const float* RoundedF32(Scratch<float>& s, const float* x, int64_t n, DType dtype) {
  float* out = s.Get(n);
  if (dtype == DType::kBF16) {
    round_f32_through_bf16(out, x, n);
  } else {
    round_f32_through_f16(out, x, n);
  }
  return out;
}

// Whether oneDNN has a matmul for `dtype` on this CPU: a small probe, once per dtype (its
// support depends on the type and the CPU, not the shape).
bool OneDnnHasMatmul(DType dtype) {
  auto probe = [](DType t) {
    const uint16_t a[4] = {}, b[4] = {};
    float c[4] = {};
    return TryGemm(c, 2, Operand{a, 2, false, t}, Operand{b, 2, true, t}, nullptr, 2, 2, 2,
                   false);
  };
  static const bool bf16 = probe(DType::kBF16);
  static const bool f16 = probe(DType::kF16);
  return dtype == DType::kBF16 ? bf16 : f16;
}

// The fallback's f32 view of a rounded operand.
const float* Widened(Scratch<float>& s, const void* x, int64_t n, DType dtype) {
  float* out = s.Get(n);
  Upcast(out, x, n, dtype);
  return out;
}

}  // namespace

bool matmul_lowp_native(DType dtype) {
  if (dtype == DType::kF32) return true;
  return !ForcedFallback() && OneDnnHasMatmul(dtype);
}

void matmul_forward_lowp(float* out, const float* inp, const void* weight, const void* bias,
                         int64_t M, int64_t K, int64_t N, DType dtype) {
  if (dtype == DType::kF32) {
    matmul_forward(out, inp, static_cast<const float*>(weight), static_cast<const float*>(bias),
                   M, K, N);
    return;
  }
  LowpScratch& s = ThreadScratch();
  const float* bias32 = bias != nullptr ? Widened(s.bias, bias, N, dtype) : nullptr;
  // out[M,N] = inp[M,K] . (weight[N,K])^T + bias
  if (matmul_lowp_native(dtype) &&
      TryGemm(out, N, Operand{Rounded(s.inp, inp, M * K, dtype), K, false, dtype},
              Operand{weight, K, true, dtype}, bias32, M, K, N, false)) {
    return;
  }
  const float* inp32 = RoundedF32(s.inp_f32, inp, M * K, dtype);
  const float* w32 = Widened(s.weight, weight, N * K, dtype);
  matmul_forward(out, inp32, w32, bias32, M, K, N);
}

void matmul_backward_lowp(float* dinp, float* dweight, float* dbias, const float* dout,
                          const float* inp, const void* weight, int64_t M, int64_t K, int64_t N,
                          DType dtype) {
  if (dtype == DType::kF32) {
    matmul_backward(dinp, dweight, dbias, dout, inp, static_cast<const float*>(weight), M, K, N);
    return;
  }
  LowpScratch& s = ThreadScratch();
  const bool gemms = dinp != nullptr || dweight != nullptr;
  if (!matmul_lowp_native(dtype)) {
    // The f32 GEMMs on the rounded operands, each rounded in one pass.
    if (dbias != nullptr) {
      internal::AccumulateColumnSums(dbias, M, N,
                                     [=](int64_t r, int64_t c) { return dout[r * N + c]; });
    }
    if (!gemms) return;
    const float* dout32 = RoundedF32(s.dout_f32, dout, M * N, dtype);
    if (dinp != nullptr) {
      const float* w32 = Widened(s.weight, weight, N * K, dtype);
      Gemm(dinp, K, Operand{dout32, N, false}, Operand{w32, K, false}, nullptr, M, N, K, true);
    }
    if (dweight != nullptr) {
      const float* inp32 = RoundedF32(s.inp_f32, inp, M * K, dtype);
      Gemm(dweight, K, Operand{dout32, N, true}, Operand{inp32, K, false}, nullptr, N, M, K,
           true);
    }
    return;
  }
  const uint16_t* dout_lp = nullptr;
  if (dbias != nullptr && dtype == DType::kBF16 && gemms) {
    // One pass over dout for both the bias gradient (from the f32 dout, in the f32 kernel's
    // order) and its rounding to bf16 for the GEMMs.
    uint16_t* rounded = s.dout.Get(M * N);
    internal::AccumulateColumnSums(dbias, M, N, [=](int64_t r, int64_t c) {
      const float x = dout[r * N + c];
      rounded[r * N + c] = internal::Bf16Bits(x);
      return x;
    });
    dout_lp = rounded;
  } else if (dbias != nullptr) {
    internal::AccumulateColumnSums(dbias, M, N,
                                   [=](int64_t r, int64_t c) { return dout[r * N + c]; });
  }
  if (!gemms) return;
  if (dout_lp == nullptr) dout_lp = Rounded(s.dout, dout, M * N, dtype);
  const uint16_t* inp_lp = dweight != nullptr ? Rounded(s.inp, inp, M * K, dtype) : nullptr;
  bool native = true;
  // dinp[M,K] += dout[M,N] . weight[N,K]
  if (native && dinp != nullptr) {
    native = TryGemm(dinp, K, Operand{dout_lp, N, false, dtype}, Operand{weight, K, false, dtype},
                     nullptr, M, N, K, true);
  }
  // dweight[N,K] += (dout[M,N])^T . inp[M,K]
  if (native && dweight != nullptr) {
    native = TryGemm(dweight, K, Operand{dout_lp, N, true, dtype},
                     Operand{inp_lp, K, false, dtype}, nullptr, N, M, K, true);
    if (!native && dinp != nullptr) {
      // dinp is done already: the fallback below must not add it again. (Not expected: oneDNN
      // supports a type for every layout or for none.)
      dinp = nullptr;
    }
  }
  if (native) return;
  const float* dout32 = Widened(s.dout_f32, dout_lp, M * N, dtype);
  if (dinp != nullptr) {
    const float* w32 = Widened(s.weight, weight, N * K, dtype);
    Gemm(dinp, K, Operand{dout32, N, false}, Operand{w32, K, false}, nullptr, M, N, K, true);
  }
  if (dweight != nullptr) {
    const float* inp32 = Widened(s.inp_f32, inp_lp, M * K, dtype);
    Gemm(dweight, K, Operand{dout32, N, true}, Operand{inp32, K, false}, nullptr, N, M, K, true);
  }
}

}  // namespace fsdp::kernels::cpu
