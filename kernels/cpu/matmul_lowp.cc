// Low-precision Linear layer (bf16/f16 weights, f32 activations and gradients): the f32
// operands are rounded into thread-local 16-bit scratch and multiplied by oneDNN with f32
// accumulation (native), or rounded in f32 and multiplied with the weight widened by the f32
// GEMM (widened: the same products), whichever lowp_gemm_choice picks for this CPU.
#include <bit>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/column_sum.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/vec_math.h"

namespace fsdp::kernels::cpu {
namespace {

using internal::Gemm;
using internal::Operand;
using internal::TryGemm;

// A growable scratch array that is never zero-filled (every use overwrites what it reads),
// 64-byte aligned as the backends' buffers are: the GEMMs read it as an operand, and an
// operand off a cache-line boundary costs them time (operator new gives 16 bytes).
template <typename T>
class Scratch {
 public:
  T* Get(int64_t n) {
    if (n > capacity_) {
      const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + kAlign - 1) / kAlign * kAlign;
      data_.reset(static_cast<T*>(std::aligned_alloc(kAlign, bytes)));
      if (data_ == nullptr) throw std::bad_alloc();
      capacity_ = n;
    }
    return data_.get();
  }

 private:
  static constexpr size_t kAlign = 64;
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
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

// Whether oneDNN has a matmul for `dtype` on this CPU: a small probe (its support depends on
// the type and the CPU, not the shape).
bool OneDnnHasMatmul(DType dtype) {
  const uint16_t a[4] = {}, b[4] = {};
  float c[4] = {};
  return TryGemm(c, 2, Operand{a, 2, false, dtype}, Operand{b, 2, true, dtype}, nullptr, 2, 2,
                 2, false);
}

// FSDP_LOWP_GEMM (read each call, so that tests can switch it): "native", "widened", or
// "auto" / unset. Another value is reported on stderr once and taken as auto.
enum class Policy { kAuto, kNative, kWidened };
Policy EnvPolicy() {
  const char* v = std::getenv("FSDP_LOWP_GEMM");
  if (v == nullptr || *v == '\0' || std::strcmp(v, "auto") == 0) return Policy::kAuto;
  if (std::strcmp(v, "native") == 0) return Policy::kNative;
  if (std::strcmp(v, "widened") == 0) return Policy::kWidened;
  static std::once_flag warned;
  std::call_once(warned, [v] {
    std::fprintf(stderr,
                 "fsdp: FSDP_LOWP_GEMM=%s is not auto, native or widened; using auto\n", v);
  });
  return Policy::kAuto;
}

// GFLOP/s of one low-precision Linear forward of n x n x n by each kernel, as a call runs it:
// the native path rounds the f32 input to `dtype` and multiplies 16-bit operands; the widened
// path rounds the input in f32 and widens the weight, then runs the f32 GEMM. Best of 3 after
// a warm-up, on the calling thread's OpenMP threads.
std::pair<double, double> MeasureKernels(DType dtype, int64_t n) {
  std::vector<float> inp(n * n), out(n * n), inp32(n * n), w32(n * n);
  std::vector<uint16_t> inp16(n * n), w16(n * n);
  for (int64_t i = 0; i < n * n; ++i) {
    inp[i] = static_cast<float>(i % 7) * 0.25f - 0.75f;
    w32[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
  }
  Downcast(w16.data(), w32.data(), n * n, dtype);
  auto time = [&](auto&& call) {
    double best = 0;
    for (int r = 0; r < 4; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      call();
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      if (r > 0 && (best == 0 || dt.count() < best)) best = dt.count();
    }
    return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) /
           best * 1e-9;
  };
  const double native = time([&] {
    Downcast(inp16.data(), inp.data(), n * n, dtype);
    Gemm(out.data(), n, Operand{inp16.data(), n, false, dtype},
         Operand{w16.data(), n, true, dtype}, nullptr, n, n, n, false);
  });
  const double widened = time([&] {
    if (dtype == DType::kBF16) {
      round_f32_through_bf16(inp32.data(), inp.data(), n * n);
    } else {
      round_f32_through_f16(inp32.data(), inp.data(), n * n);
    }
    Upcast(w32.data(), w16.data(), n * n, dtype);
    Gemm(out.data(), n, Operand{inp32.data(), n, false}, Operand{w32.data(), n, true}, nullptr,
         n, n, n, false);
  });
  return {native, widened};
}

// What is known of `dtype` on this CPU, found once per process: whether oneDNN has the native
// matmul, and (measured on first need, by auto) both kernels' rates.
struct Known {
  std::once_flag probed, measured;
  bool available = false;
  double native_gflops = 0, widened_gflops = 0;
};
Known& KnownOf(DType dtype) {
  static Known bf16, f16;
  Known& k = dtype == DType::kBF16 ? bf16 : f16;
  std::call_once(k.probed, [&k, dtype] { k.available = OneDnnHasMatmul(dtype); });
  return k;
}

// The fallback's f32 view of a rounded operand.
const float* Widened(Scratch<float>& s, const void* x, int64_t n, DType dtype) {
  float* out = s.Get(n);
  Upcast(out, x, n, dtype);
  return out;
}

// dbias[N] += the column sums of the f32 dout[M,N], in the f32 kernel's order. With `rounded`,
// the same pass stores dout rounded through bf16 there: its bits (uint16_t) for the native
// GEMMs, or their f32 value (float) for the widened ones.
template <typename T>
void BiasGradient(float* dbias, const float* dout, int64_t M, int64_t N, T* rounded) {
  if (rounded == nullptr) {
    internal::AccumulateColumnSums(dbias, M, N,
                                   [=](int64_t r, int64_t c) { return dout[r * N + c]; });
    return;
  }
  internal::AccumulateColumnSums(dbias, M, N, [=](int64_t r, int64_t c) {
    const float x = dout[r * N + c];
    const uint16_t b = internal::Bf16Bits(x);
    if constexpr (std::is_same_v<T, float>) {
      rounded[r * N + c] = std::bit_cast<float>(static_cast<uint32_t>(b) << 16);
    } else {
      rounded[r * N + c] = b;
    }
    return x;
  });
}

// The widened backward GEMMs on f32 operands holding the rounded values: dinp[M,K] += dout32 .
// weight (widened), dweight[N,K] += dout32^T . inp32 (inp32 unread without dweight).
void WidenedBackward(LowpScratch& s, float* dinp, float* dweight, const float* dout32,
                     const float* inp32, const void* weight, int64_t M, int64_t K, int64_t N,
                     DType dtype) {
  if (dinp != nullptr) {
    const float* w32 = Widened(s.weight, weight, N * K, dtype);
    Gemm(dinp, K, Operand{dout32, N, false}, Operand{w32, K, false}, nullptr, M, N, K, true);
  }
  if (dweight != nullptr) {
    Gemm(dweight, K, Operand{dout32, N, true}, Operand{inp32, K, false}, nullptr, N, M, K, true);
  }
}

}  // namespace

LowpGemmChoice lowp_gemm_choice(DType dtype) {
  LowpGemmChoice r;
  r.dtype = dtype;
  if (dtype == DType::kF32) {
    r.native_available = r.native = true;
    r.reason = "f32";
    return r;
  }
  Known& k = KnownOf(dtype);
  r.native_available = k.available;
  if (!k.available) {
    r.reason = "oneDNN has no native matmul of this type on this CPU";
    return r;
  }
  switch (EnvPolicy()) {
    case Policy::kNative:
      r.native = true;
      r.reason = "FSDP_LOWP_GEMM=native";
      return r;
    case Policy::kWidened:
      r.reason = "FSDP_LOWP_GEMM=widened";
      return r;
    case Policy::kAuto:
      break;
  }
  std::call_once(k.measured, [&k, dtype] {
    std::tie(k.native_gflops, k.widened_gflops) = MeasureKernels(dtype, kLowpGemmProbeSize);
  });
  r.native_gflops = k.native_gflops;
  r.widened_gflops = k.widened_gflops;
  r.native = kLowpGemmWidenedMargin * r.widened_gflops <= r.native_gflops;
  r.reason = r.native ? "measured: native is faster" : "measured: widened is faster";
  return r;
}

bool matmul_lowp_native(DType dtype) {
  if (dtype == DType::kF32) return true;
  return !ForcedFallback() && lowp_gemm_choice(dtype).native;
}

void matmul_forward_lowp(float* out, const void* inp_any, const void* weight, const void* bias,
                         int64_t M, int64_t K, int64_t N, DType dtype, DType inp_dtype) {
  if (dtype == DType::kF32) {
    matmul_forward(out, static_cast<const float*>(inp_any), static_cast<const float*>(weight),
                   static_cast<const float*>(bias), M, K, N);
    return;
  }
  // inp in the compute dtype: its 16-bit values are the rounded operand.
  const bool inp_kept = inp_dtype == dtype;
  const auto* inp = static_cast<const float*>(inp_any);  // read only when !inp_kept
  LowpScratch& s = ThreadScratch();
  const float* bias32 = bias != nullptr ? Widened(s.bias, bias, N, dtype) : nullptr;
  // out[M,N] = inp[M,K] . (weight[N,K])^T + bias
  if (matmul_lowp_native(dtype) &&
      TryGemm(out, N,
              Operand{inp_kept ? inp_any : Rounded(s.inp, inp, M * K, dtype), K, false, dtype},
              Operand{weight, K, true, dtype}, bias32, M, K, N, false)) {
    return;
  }
  const float* inp32 = inp_kept ? Widened(s.inp_f32, inp_any, M * K, dtype)
                                : RoundedF32(s.inp_f32, inp, M * K, dtype);
  const float* w32 = Widened(s.weight, weight, N * K, dtype);
  matmul_forward(out, inp32, w32, bias32, M, K, N);
}

void matmul_backward_lowp(float* dinp, float* dweight, float* dbias, const float* dout,
                          const void* inp_any, const void* weight, int64_t M, int64_t K,
                          int64_t N, DType dtype, DType inp_dtype) {
  if (dtype == DType::kF32) {
    matmul_backward(dinp, dweight, dbias, dout, static_cast<const float*>(inp_any),
                    static_cast<const float*>(weight), M, K, N);
    return;
  }
  // inp in the compute dtype: its 16-bit values are the rounded operand.
  const bool inp_kept = inp_dtype == dtype;
  const auto* inp = static_cast<const float*>(inp_any);  // read only when !inp_kept
  LowpScratch& s = ThreadScratch();
  // The rounded input: f32 for the widened GEMMs, 16-bit for the native ones.
  auto inp_f32 = [&]() -> const float* {
    return inp_kept ? Widened(s.inp_f32, inp_any, M * K, dtype)
                    : RoundedF32(s.inp_f32, inp, M * K, dtype);
  };
  auto inp_16 = [&]() -> const uint16_t* {
    return inp_kept ? static_cast<const uint16_t*>(inp_any) : Rounded(s.inp, inp, M * K, dtype);
  };
  const bool gemms = dinp != nullptr || dweight != nullptr;
  // With a bias gradient, bf16 rounds dout for the GEMMs in the pass that sums it.
  const bool fuse_bf16 = dtype == DType::kBF16 && gemms;
  if (!matmul_lowp_native(dtype)) {
    // The f32 GEMMs on the rounded operands, each rounded in one pass.
    float* fused = dbias != nullptr && fuse_bf16 ? s.dout_f32.Get(M * N) : nullptr;
    if (dbias != nullptr) BiasGradient(dbias, dout, M, N, fused);
    if (!gemms) return;
    const float* dout32 = fused != nullptr ? fused : RoundedF32(s.dout_f32, dout, M * N, dtype);
    WidenedBackward(s, dinp, dweight, dout32, dweight != nullptr ? inp_f32() : nullptr, weight,
                    M, K, N, dtype);
    return;
  }
  uint16_t* fused = dbias != nullptr && fuse_bf16 ? s.dout.Get(M * N) : nullptr;
  if (dbias != nullptr) BiasGradient(dbias, dout, M, N, fused);
  if (!gemms) return;
  const uint16_t* dout_lp = fused != nullptr ? fused : Rounded(s.dout, dout, M * N, dtype);
  const uint16_t* inp_lp = dweight != nullptr ? inp_16() : nullptr;
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
  WidenedBackward(s, dinp, dweight, Widened(s.dout_f32, dout_lp, M * N, dtype),
                  dweight != nullptr ? Widened(s.inp_f32, inp_lp, M * K, dtype) : nullptr,
                  weight, M, K, N, dtype);
}

}  // namespace fsdp::kernels::cpu
