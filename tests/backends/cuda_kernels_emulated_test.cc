// The CUDA kernels of kernels/cuda (kernels.h) run on the CPU through the host emulator of
// tests/cuda_emu (compiled as C++ with FSDP_CUDA_EMULATION, the shim headers standing in for
// CUDA's), each launcher checked against the CPU kernel it mirrors (fsdp/kernels_cpu.h, and
// backends/host/host_ops.h for the device-scalar ops) on small shapes and their edges. This is
// the kernels' only execution in CI without a GPU: it checks what they compute, their index
// arithmetic, barriers and shuffles, but not races or device math accuracy (see
// tests/cuda_emu/cuda_emu.h). Tolerances: bitwise where the kernel and the CPU do the same
// operations (casts, add, scale, reduce, embedding forward, bias broadcast); else relative +
// absolute, 1e-5 relative where only FMA contraction differs (optimizers), looser where the
// order of a reduction differs (norms, softmax, attention).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "collectives/reduce.h"
#include "fsdp/dtype.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/optim.h"
#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.cuh"

#if defined(__SANITIZE_THREAD__)
#define FSDP_EMU_UNDER_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define FSDP_EMU_UNDER_TSAN 1
#endif
#endif

namespace {

namespace gpu = fsdp::kernels::cuda;
namespace cpu = fsdp::kernels::cpu;
using Vec = std::vector<float>;

std::mt19937& Rng() {
  static std::mt19937 rng(1234);
  return rng;
}
Vec Rand(int64_t n, float lo = -2.0f, float hi = 2.0f) {
  std::uniform_real_distribution<float> d(lo, hi);
  Vec v(static_cast<size_t>(n));
  for (float& x : v) x = d(Rng());
  return v;
}

// Every element of `got` within abs + rel * |want| of `want` (NaN where want is NaN).
::testing::AssertionResult Near(const Vec& got, const Vec& want, double rel, double abs) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size differs";
  for (size_t i = 0; i < got.size(); ++i) {
    const double g = got[i], w = want[i];
    const bool ok = std::isnan(w) ? std::isnan(g) : std::fabs(g - w) <= abs + rel * std::fabs(w);
    if (!ok) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "element %zu of %zu: emulated %.9g, cpu %.9g", i,
                    got.size(), g, w);
      return ::testing::AssertionFailure() << msg;
    }
  }
  return ::testing::AssertionSuccess();
}
template <typename T>
::testing::AssertionResult Same(const std::vector<T>& got, const std::vector<T>& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size differs";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      return ::testing::AssertionFailure()
             << "element " << i << " of " << got.size() << " differs bitwise: emulated "
             << +got[i] << ", cpu " << +want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

// A launch error left by a launcher, read (and cleared) as the caller would.
cudaError_t LastError() { return cudaGetLastError(); }

class CudaKernelsEmulated : public ::testing::Test {
 protected:
  void SetUp() override {
#ifdef FSDP_EMU_UNDER_TSAN
    // TSan tracks each OS thread's stack, and the emulator switches stacks under it with
    // swapcontext (unannotated for TSan); it could not find anything here anyway: the
    // emulated threads are not concurrent (compute-sanitizer racecheck on a GPU is the tool).
    GTEST_SKIP() << "skipped: the emulator's user-level contexts are not supported under TSan";
#endif
    ASSERT_EQ(LastError(), cudaSuccess);
  }
  void TearDown() override { EXPECT_EQ(LastError(), cudaSuccess) << "a launch failed"; }
};

// ---- the emulator itself --------------------------------------------------------------------

// out[block] = sum over the block's threads of x, by a warp butterfly and shared partials;
// every thread checks it got the same total.
__global__ void BlockSumProbe(float* out, const float* x, int* mismatches) {
  __shared__ float partial[32];
  const unsigned tid = threadIdx.x, lane = tid % 32u, warp = tid / 32u;
  float v = x[blockIdx.x * blockDim.x + tid];
  for (int off = 16; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float total = 0;
  for (unsigned w = 0; w < blockDim.x / 32u; ++w) total += partial[w];
  float down = x[blockIdx.x * blockDim.x + tid];
  for (unsigned off = 16; off > 0; off /= 2) down += __shfl_down_sync(0xffffffffu, down, off);
  if (lane == 0 && down != v) atomicAdd(reinterpret_cast<float*>(mismatches), 1.0f);
  __syncthreads();
  if (tid == 0) out[blockIdx.x] = total;
}
__global__ void NopProbe() {}

TEST_F(CudaKernelsEmulated, EmulatorBarriersAndShuffles) {
  const int blocks = 3, threads = 96;
  Vec x(blocks * threads);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7);
  Vec out(blocks, -1.0f);
  float mismatches = 0;
  FSDP_LAUNCH(BlockSumProbe, blocks, threads, 0, nullptr)
  (out.data(), x.data(), reinterpret_cast<int*>(&mismatches));
  for (int b = 0; b < blocks; ++b) {
    float want = 0;
    for (int t = 0; t < threads; ++t) want += x[b * threads + t];
    EXPECT_EQ(out[b], want) << "block " << b;
  }
  EXPECT_EQ(mismatches, 0.0f);
}

TEST_F(CudaKernelsEmulated, EmulatorLaunchErrors) {
  FSDP_LAUNCH(NopProbe, 0, 32, 0, nullptr)();
  EXPECT_EQ(LastError(), cudaErrorInvalidConfiguration);
  FSDP_LAUNCH(NopProbe, 1, 1025, 0, nullptr)();
  EXPECT_EQ(LastError(), cudaErrorInvalidConfiguration);
  FSDP_LAUNCH(NopProbe, dim3(1, 65536), 32, 0, nullptr)();
  EXPECT_EQ(LastError(), cudaErrorInvalidConfiguration);
  FSDP_LAUNCH(NopProbe, 1, 32, 48 * 1024 + 4, nullptr)();  // no opt-in
  EXPECT_EQ(LastError(), cudaErrorInvalidValue);
  FSDP_LAUNCH(NopProbe, dim3(1, 65535, 1), 1, 0, nullptr)();  // the limits themselves
  FSDP_LAUNCH(NopProbe, 1, dim3(32, 32), 0, nullptr)();
  EXPECT_EQ(LastError(), cudaSuccess);
}

// ---- norms ----------------------------------------------------------------------------------

TEST_F(CudaKernelsEmulated, LayerNorm) {
  for (auto [N, C] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {3, 33}, {2, 1025}, {40, 7}, {33, 64}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const Vec x = Rand(N * C, 3, 5), w = Rand(C), b = Rand(C), dy = Rand(N * C);
    Vec o1(N * C), m1(N), r1(N), o2(N * C), m2(N), r2(N);
    gpu::layernorm_forward(nullptr, o1.data(), m1.data(), r1.data(), x.data(), w.data(),
                           b.data(), N, C, 1e-5f);
    cpu::layernorm_forward(o2.data(), m2.data(), r2.data(), x.data(), w.data(), b.data(), N, C,
                           1e-5f);
    EXPECT_TRUE(Near(o1, o2, 1e-3, 1e-3));
    EXPECT_TRUE(Near(m1, m2, 1e-5, 1e-6));
    EXPECT_TRUE(Near(r1, r2, 1e-3, 0));
    for (int mask = 0; mask < 8; ++mask) {  // which of dinp, dweight, dbias are computed
      SCOPED_TRACE("mask=" + std::to_string(mask));
      Vec dx1 = Rand(N * C), dw1 = Rand(C), db1 = Rand(C);  // += into pre-filled outputs
      Vec dx2 = dx1, dw2 = dw1, db2 = db1;
      auto P = [mask](Vec& v, int bit) { return (mask >> bit) & 1 ? v.data() : nullptr; };
      gpu::layernorm_backward(nullptr, P(dx1, 0), P(dw1, 1), P(db1, 2), dy.data(), x.data(),
                              w.data(), m2.data(), r2.data(), N, C);
      cpu::layernorm_backward(P(dx2, 0), P(dw2, 1), P(db2, 2), dy.data(), x.data(), w.data(),
                              m2.data(), r2.data(), N, C);
      EXPECT_TRUE(Near(dx1, dx2, 1e-3, 1e-3));
      EXPECT_TRUE(Near(dw1, dw2, 1e-3, 1e-3));
      EXPECT_TRUE(Near(db1, db2, 1e-4, 1e-4));
    }
  }
}

TEST_F(CudaKernelsEmulated, RmsNorm) {
  for (auto [N, C] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {3, 33}, {2, 1025}, {40, 7}, {33, 64}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " C=" + std::to_string(C));
    const Vec x = Rand(N * C), w = Rand(C), dy = Rand(N * C);
    Vec o1(N * C), r1(N), o2(N * C), r2(N);
    gpu::rmsnorm_forward(nullptr, o1.data(), r1.data(), x.data(), w.data(), N, C, 1e-5f);
    cpu::rmsnorm_forward(o2.data(), r2.data(), x.data(), w.data(), N, C, 1e-5f);
    EXPECT_TRUE(Near(o1, o2, 1e-4, 1e-5));
    EXPECT_TRUE(Near(r1, r2, 1e-4, 0));
    for (int mask = 0; mask < 4; ++mask) {
      SCOPED_TRACE("mask=" + std::to_string(mask));
      Vec dx1 = Rand(N * C), dw1 = Rand(C);
      Vec dx2 = dx1, dw2 = dw1;
      auto P = [mask](Vec& v, int bit) { return (mask >> bit) & 1 ? v.data() : nullptr; };
      gpu::rmsnorm_backward(nullptr, P(dx1, 0), P(dw1, 1), dy.data(), x.data(), w.data(),
                            r2.data(), N, C);
      cpu::rmsnorm_backward(P(dx2, 0), P(dw2, 1), dy.data(), x.data(), w.data(), r2.data(), N,
                            C);
      EXPECT_TRUE(Near(dx1, dx2, 1e-4, 1e-4));
      EXPECT_TRUE(Near(dw1, dw2, 1e-4, 1e-4));
    }
  }
}

// ---- activations ----------------------------------------------------------------------------

TEST_F(CudaKernelsEmulated, Gelu) {
  for (int64_t n : {0, 1, 1000}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    Vec x = Rand(n, -12, 12);
    if (n > 3) x[0] = -200, x[1] = 200, x[2] = NAN;
    const Vec dy = Rand(n);
    Vec o1(n, 7.0f), o2(n, 7.0f), d1 = Rand(n), d2 = d1;
    gpu::gelu_forward(nullptr, o1.data(), x.data(), n);
    cpu::gelu_forward(o2.data(), x.data(), n);
    EXPECT_TRUE(Near(o1, o2, 1e-5, 1e-6));
    gpu::gelu_backward(nullptr, d1.data(), x.data(), dy.data(), n);
    cpu::gelu_backward(d2.data(), x.data(), dy.data(), n);
    EXPECT_TRUE(Near(d1, d2, 1e-5, 1e-6));
  }
}

TEST_F(CudaKernelsEmulated, Swiglu) {
  for (auto [N, F] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {3, 300}, {2, 33}}) {
    SCOPED_TRACE("N=" + std::to_string(N) + " F=" + std::to_string(F));
    const Vec gu = Rand(N * 2 * F, -100, 100), dy = Rand(N * F);
    Vec o1(N * F), o2(N * F), d1 = Rand(N * 2 * F), d2 = d1;
    gpu::swiglu_forward(nullptr, o1.data(), gu.data(), N, F);
    cpu::swiglu_forward(o2.data(), gu.data(), N, F);
    EXPECT_TRUE(Near(o1, o2, 1e-5, 1e-6));
    gpu::swiglu_backward(nullptr, d1.data(), dy.data(), gu.data(), N, F);
    cpu::swiglu_backward(d2.data(), dy.data(), gu.data(), N, F);
    EXPECT_TRUE(Near(d1, d2, 1e-5, 1e-6));
  }
}

TEST_F(CudaKernelsEmulated, Rope) {
  struct Shape {
    int64_t B, T, W, NH, D;
  };
  for (const Shape& s : {Shape{2, 5, 3 * 16 + 4, 3, 16}, Shape{1, 3, 130, 1, 130},
                         Shape{1, 40, 2 * 64, 2, 64}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                 " D=" + std::to_string(s.D));
    Vec x1 = Rand(s.B * s.T * s.W), x2 = x1;
    gpu::rope_forward(nullptr, x1.data(), s.B, s.T, s.W, s.NH, s.D, 10000.0f);
    cpu::rope_forward(x2.data(), s.B, s.T, s.W, s.NH, s.D, 10000.0f);
    EXPECT_TRUE(Near(x1, x2, 1e-5, 1e-6));
    gpu::rope_backward(nullptr, x1.data(), s.B, s.T, s.W, s.NH, s.D, 10000.0f);
    cpu::rope_backward(x2.data(), s.B, s.T, s.W, s.NH, s.D, 10000.0f);
    EXPECT_TRUE(Near(x1, x2, 1e-5, 1e-6));
  }
}

// ---- attention ------------------------------------------------------------------------------

TEST_F(CudaKernelsEmulated, Attention) {
  struct Shape {
    int64_t B, T, NH, NKV, D;
  };
  // MHA, GQA (NH / NKV = 2, 3), T = 1 and T not a multiple of the 32-row tile, D = 1, D not a
  // multiple of 32, D > 128 (dynamic shared memory above 48 KiB: the opt-in path).
  for (const Shape& s : {Shape{1, 1, 1, 1, 8}, Shape{2, 33, 4, 2, 20}, Shape{1, 70, 2, 2, 64},
                         Shape{1, 40, 3, 1, 33}, Shape{1, 31, 2, 2, 1},
                         Shape{1, 35, 2, 1, 200}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) +
                 " NH=" + std::to_string(s.NH) + " NKV=" + std::to_string(s.NKV) +
                 " D=" + std::to_string(s.D));
    const int64_t W = (s.NH + 2 * s.NKV) * s.D;
    const Vec qkv = Rand(s.B * s.T * W, -3, 3), dy = Rand(s.B * s.T * s.NH * s.D);
    Vec o1 = Rand(s.B * s.T * s.NH * s.D), l1 = Rand(s.B * s.NH * s.T);  // overwritten
    Vec o2(o1.size()), l2(l1.size());
    gpu::attention_forward(nullptr, o1.data(), l1.data(), qkv.data(), s.B, s.T, s.NH, s.NKV,
                           s.D);
    cpu::gqa_attention_forward(o2.data(), l2.data(), qkv.data(), s.B, s.T, s.NH, s.NKV, s.D);
    EXPECT_TRUE(Near(o1, o2, 1e-4, 1e-4));
    EXPECT_TRUE(Near(l1, l2, 1e-5, 1e-5));
    // Backward from the CPU kernel's out and lse, so that only backward's differences count.
    Vec d1 = Rand(s.B * s.T * W), d2 = d1;  // += into a pre-filled dqkv
    Vec ws = Rand(gpu::attention_backward_workspace_bytes(s.B, s.T, s.NH) / 4);
    gpu::attention_backward(nullptr, d1.data(), dy.data(), qkv.data(), o2.data(), l2.data(), s.B,
                            s.T, s.NH, s.NKV, s.D, ws.data());
    cpu::gqa_attention_backward(d2.data(), dy.data(), qkv.data(), o2.data(), l2.data(), s.B, s.T,
                                s.NH, s.NKV, s.D);
    EXPECT_TRUE(Near(d1, d2, 1e-4, 1e-4));
  }
}

TEST_F(CudaKernelsEmulated, AttentionUnsupportedShapes) {
  Vec out(64, 5.0f), lse(64, 5.0f), qkv(1024, 1.0f);
  gpu::attention_forward(nullptr, out.data(), lse.data(), qkv.data(), 1, 1, 1, 1, 257);
  EXPECT_EQ(LastError(), cudaErrorInvalidConfiguration) << "D > 256";
  gpu::attention_forward(nullptr, out.data(), lse.data(), qkv.data(), 1, 1, 3, 2, 8);
  EXPECT_EQ(LastError(), cudaErrorInvalidConfiguration) << "NH not a multiple of NKV";
  EXPECT_EQ(out, Vec(64, 5.0f));
  gpu::attention_forward(nullptr, out.data(), lse.data(), qkv.data(), 0, 4, 1, 1, 8);
  EXPECT_EQ(LastError(), cudaSuccess) << "B = 0 launches nothing";
}

// ---- loss, embedding ------------------------------------------------------------------------

TEST_F(CudaKernelsEmulated, SoftmaxCrossEntropy) {
  struct Case {
    int64_t N, V;
    bool alias;  // probs written over the logits
  };
  for (const Case& c : {Case{4, 1, false}, Case{5, 33, false}, Case{3, 1025, true},
                        Case{1, 3000, false}}) {
    SCOPED_TRACE("N=" + std::to_string(c.N) + " V=" + std::to_string(c.V) +
                 " alias=" + std::to_string(c.alias));
    const Vec x = Rand(c.N * c.V, -10, 10);
    std::vector<int32_t> t(c.N);
    for (int64_t n = 0; n < c.N; ++n) t[n] = n % 3 == 1 ? -1 : int32_t((n * 7919) % c.V);
    Vec l1(c.N), l2(c.N), p1(c.N * c.V), p2(c.N * c.V), xg = x;
    gpu::softmax_crossentropy_forward(nullptr, l1.data(), c.alias ? xg.data() : p1.data(),
                                      xg.data(), t.data(), c.N, c.V);
    if (c.alias) p1 = xg;
    cpu::softmax_crossentropy_forward(l2.data(), p2.data(), x.data(), t.data(), c.N, c.V);
    EXPECT_TRUE(Near(l1, l2, 1e-5, 1e-5));
    EXPECT_TRUE(Near(p1, p2, 1e-4, 1e-9));
    // The backward on arbitrary probabilities (the forward may zero an ignored row's), so
    // that an ignored row that is not skipped shows.
    const Vec probs = Rand(c.N * c.V, 0, 1);
    Vec d1 = Rand(c.N * c.V), d2 = d1;
    gpu::softmax_crossentropy_backward(nullptr, d1.data(), probs.data(), t.data(), 0.37f, c.N,
                                       c.V);
    cpu::softmax_crossentropy_backward(d2.data(), probs.data(), t.data(), 0.37f, c.N, c.V);
    EXPECT_TRUE(Near(d1, d2, 1e-5, 1e-6));
  }
}

TEST_F(CudaKernelsEmulated, Embedding) {
  struct Case {
    int64_t N, C, rows;
  };
  // The last: more positions than one chunk of staged indices, more rows than partitions.
  for (const Case& c : {Case{7, 1, 3}, Case{20, 300, 4}, Case{1, 33, 1}, Case{2500, 5, 70}}) {
    SCOPED_TRACE("N=" + std::to_string(c.N) + " C=" + std::to_string(c.C));
    const Vec table = Rand(c.rows * c.C), dy = Rand(c.N * c.C);
    std::vector<int32_t> idx(c.N);  // repeated indices: the backward adds them all
    for (int64_t n = 0; n < c.N; ++n) idx[n] = int32_t((n * 5) % c.rows);
    Vec o1(c.N * c.C), o2(c.N * c.C);
    gpu::embedding_forward(nullptr, o1.data(), idx.data(), table.data(), c.N, c.C);
    cpu::embedding_forward(o2.data(), idx.data(), table.data(), c.N, c.C);
    EXPECT_TRUE(Same(o1, o2));
    Vec d1 = Rand(c.rows * c.C), d2 = d1;
    gpu::embedding_backward(nullptr, d1.data(), dy.data(), idx.data(), c.N, c.C);
    cpu::embedding_backward(d2.data(), dy.data(), idx.data(), c.N, c.C);
    EXPECT_TRUE(Same(d1, d2));  // positions added in order, as the CPU does
  }
}

// ---- element-wise, casts, reduce ------------------------------------------------------------

// Random values with the special cases of the casts first: Inf, NaN (quiet, signalling, with
// payloads), subnormals, f16 and bf16 rounding boundaries.
Vec Special(int64_t n) {
  Vec v = Rand(n, -70000, 70000);
  const uint32_t specials[] = {0x7f800000u, 0xff800000u, 0x7fc00001u, 0xff812345u,
                               0x00000001u, 0x80000abcu, 0x38800000u, 0x387fffffu,
                               0x33000000u, 0x33000001u, 0x477ff000u, 0x477fefffu,
                               0x3f808000u, 0x3f818000u, 0x00400000u, 0x007fffffu};
  for (int64_t i = 0; i < n && i < 16; ++i) std::memcpy(&v[i], &specials[i], 4);
  for (int64_t i = 16; i < n; i += 3) v[i] *= 1e-6f;
  for (int64_t i = 17; i < n; i += 5) v[i] *= 1e-30f;
  return v;
}

TEST_F(CudaKernelsEmulated, AddAccumulateScale) {
  for (int64_t n : {0, 1, 33, 1000}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Vec a = Special(n), b = Rand(n);
    Vec o1(n), o2(n);
    gpu::add(nullptr, o1.data(), a.data(), b.data(), n);
    cpu::residual_forward(o2.data(), a.data(), b.data(), n);
    EXPECT_TRUE(Same(o1, o2));
    Vec ab = a;  // out aliases an input
    gpu::add(nullptr, ab.data(), ab.data(), b.data(), n);
    EXPECT_TRUE(Same(ab, o2));
    Vec da1 = Rand(n), db1 = Rand(n), da2 = da1, db2 = db1;
    gpu::add_backward(nullptr, da1.data(), db1.data(), b.data(), n);
    cpu::residual_backward(da2.data(), db2.data(), b.data(), n);
    EXPECT_TRUE(Same(da1, da2));
    EXPECT_TRUE(Same(db1, db2));
    gpu::add_backward(nullptr, nullptr, db1.data(), b.data(), n);
    cpu::residual_backward(nullptr, db2.data(), b.data(), n);
    EXPECT_TRUE(Same(db1, db2));
    gpu::accumulate(nullptr, da1.data(), a.data(), n);
    cpu::residual_backward(da2.data(), nullptr, a.data(), n);
    EXPECT_TRUE(Same(da1, da2));
    Vec s1 = a, s2 = a;
    gpu::scale(nullptr, s1.data(), 0.3f, n);
    cpu::scale_inplace(s2.data(), 0.3f, n);
    EXPECT_TRUE(Same(s1, s2));
    float f = 1.0f;
    gpu::scale_by(nullptr, s1.data(), &f, n);
    EXPECT_TRUE(Same(s1, s2));
    f = 1.7f;
    gpu::scale_by(nullptr, s1.data(), &f, n);
    cpu::scale_inplace(s2.data(), 1.7f, n);
    EXPECT_TRUE(Same(s1, s2));
  }
}

TEST_F(CudaKernelsEmulated, Casts) {
  for (int64_t n : {0, 1, 33, 1000}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Vec a = Special(n);
    std::vector<uint16_t> h1(n), h2(n);
    Vec o1(n), o2(n);
    gpu::cast_f32_to_bf16(nullptr, h1.data(), a.data(), n);
    cpu::cast_f32_to_bf16(h2.data(), a.data(), n);
    EXPECT_TRUE(Same(h1, h2));
    gpu::cast_bf16_to_f32(nullptr, o1.data(), h2.data(), n);
    cpu::cast_bf16_to_f32(o2.data(), h2.data(), n);
    EXPECT_TRUE(Same(o1, o2));
    gpu::cast_f32_to_f16(nullptr, h1.data(), a.data(), n);
    cpu::cast_f32_to_f16(h2.data(), a.data(), n);
    EXPECT_TRUE(Same(h1, h2));
  }
  // f16 -> f32 over every bit pattern (subnormals, Inf, NaN payloads).
  std::vector<uint16_t> all(65536);
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  Vec o1(all.size()), o2(all.size());
  gpu::cast_f16_to_f32(nullptr, o1.data(), all.data(), 65536);
  cpu::cast_f16_to_f32(o2.data(), all.data(), 65536);
  EXPECT_TRUE(Same(o1, o2));
}

TEST_F(CudaKernelsEmulated, Reduce) {
  for (int64_t n : {1, 33, 700}) {
    for (int dt = 0; dt < 3; ++dt) {
      for (int op = 0; op < 3; ++op) {
        for (int nin : {1, 2, 3, 16}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " dtype=" + std::to_string(dt) +
                       " op=" + std::to_string(op) + " n_in=" + std::to_string(nin));
          const size_t es = dt == 0 ? 4 : 2;
          std::vector<std::vector<unsigned char>> ins(nin, std::vector<unsigned char>(n * es));
          for (int q = 0; q < nin; ++q) {
            Vec v = q == 0 ? Special(n) : Rand(n, -100, 100);
            if (q == 1 && n > 20) v[20] = NAN;
            if (dt == 0) std::memcpy(ins[q].data(), v.data(), n * 4);
            if (dt == 1) cpu::cast_f32_to_bf16(reinterpret_cast<uint16_t*>(ins[q].data()), v.data(), n);
            if (dt == 2) cpu::cast_f32_to_f16(reinterpret_cast<uint16_t*>(ins[q].data()), v.data(), n);
          }
          std::vector<const void*> ptr(nin);
          for (int q = 0; q < nin; ++q) ptr[q] = ins[q].data();
          std::vector<unsigned char> r1(n * es, 0xab), r2(n * es);
          gpu::reduce(nullptr, r1.data(), ptr.data(), nin, n, dt, op);
          fsdp::coll::ReduceBuffers(static_cast<fsdp::DType>(dt), static_cast<fsdp::ReduceOp>(op),
                                    ptr.data(), nin, r2.data(), n, nin);
          EXPECT_TRUE(Same(r1, r2));
          std::vector<unsigned char> in_place = ins[nin - 1];  // out is one of the inputs
          ptr[nin - 1] = in_place.data();
          gpu::reduce(nullptr, in_place.data(), ptr.data(), nin, n, dt, op);
          EXPECT_TRUE(Same(in_place, r2));
        }
      }
    }
  }
}

TEST_F(CudaKernelsEmulated, BiasBackwardAndBroadcast) {
  for (auto [M, N] : std::vector<std::pair<int64_t, int64_t>>{{1, 1}, {70, 33}, {5, 100}}) {
    SCOPED_TRACE("M=" + std::to_string(M) + " N=" + std::to_string(N));
    const Vec dy = Rand(M * N);
    Vec d1 = Rand(N), d2 = d1;  // += into a pre-filled dbias
    gpu::bias_backward(nullptr, d1.data(), dy.data(), M, N);
    for (int64_t c = 0; c < N; ++c) {
      float col = 0;  // the CPU reference: matmul_backward's dbias column sums
      for (int64_t r = 0; r < M; ++r) col += dy[r * N + c];
      d2[c] += col;
    }
    EXPECT_TRUE(Near(d1, d2, 1e-5, 1e-5));
    const Vec bias = Rand(N);
    Vec o(M * N), want(M * N);
    gpu::bias_broadcast(nullptr, o.data(), bias.data(), 0, M, N);
    for (int64_t i = 0; i < M * N; ++i) want[i] = bias[i % N];
    EXPECT_TRUE(Same(o, want));
    std::vector<uint16_t> h(N);
    cpu::cast_f32_to_bf16(h.data(), bias.data(), N);
    gpu::bias_broadcast(nullptr, o.data(), h.data(), 1, M, N);
    for (int64_t i = 0; i < M * N; ++i) want[i] = fsdp::Bf16ToFloat(h[i % N]);
    EXPECT_TRUE(Same(o, want));
    cpu::cast_f32_to_f16(h.data(), bias.data(), N);
    gpu::bias_broadcast(nullptr, o.data(), h.data(), 2, M, N);
    for (int64_t i = 0; i < M * N; ++i) want[i] = fsdp::F16ToFloat(h[i % N]);
    EXPECT_TRUE(Same(o, want));
  }
}

// ---- optimizers, device scalars -------------------------------------------------------------

TEST_F(CudaKernelsEmulated, AdamWAndSgd) {
  for (int64_t n : {1, 1000, 5000}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Vec g = Rand(n);
    Vec p1 = Rand(n), m1 = Rand(n), v1 = Rand(n, 0, 1);
    Vec p2 = p1, m2 = m1, v2 = v1;
    const fsdp::AdamWScalars k = fsdp::AdamWStepScalars(1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 7);
    gpu::adamw_update(nullptr, p1.data(), g.data(), m1.data(), v1.data(), n, k);
    cpu::adamw_update(p2.data(), g.data(), m2.data(), v2.data(), n, k);
    EXPECT_TRUE(Near(p1, p2, 1e-5, 1e-7));
    EXPECT_TRUE(Near(m1, m2, 1e-5, 1e-7));
    EXPECT_TRUE(Near(v1, v2, 1e-5, 1e-9));
    for (int variant = 0; variant < 8; ++variant) {
      const float momentum = variant & 1 ? 0.9f : 0.0f;
      const bool nesterov = variant & 2, first = variant & 4;
      SCOPED_TRACE("momentum=" + std::to_string(momentum) + " nesterov=" +
                   std::to_string(nesterov) + " first=" + std::to_string(first));
      Vec b1 = Rand(n), b2 = b1;
      gpu::sgd_update(nullptr, p1.data(), g.data(), b1.data(), n, 0.1f, momentum, 0.1f, 0.01f,
                      nesterov, first);
      cpu::sgd_update(p2.data(), g.data(), b2.data(), n, 0.1f, momentum, 0.1f, 0.01f, nesterov,
                      first);
      EXPECT_TRUE(Near(p1, p2, 1e-5, 1e-6));
      EXPECT_TRUE(Near(b1, b2, 1e-5, 1e-6));
    }
  }
}

// Block quantization, codes, scales and decoded values the CPU's bit for bit (NaN where the
// CPU has NaN): blocks of very different magnitudes, a short last block, a zero block, an inf
// block and a NaN block followed by larger values.
// Bit for bit, except that any NaN matches any NaN (payloads are the hardware's).
::testing::AssertionResult SameOrNaN(const Vec& got, const Vec& want) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "size differs";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(got[i]) && std::isnan(want[i])) continue;
    if (std::memcmp(&got[i], &want[i], sizeof(float)) != 0) {
      return ::testing::AssertionFailure() << "element " << i << " of " << got.size()
                                           << ": emulated " << got[i] << ", cpu " << want[i];
    }
  }
  return ::testing::AssertionSuccess();
}

TEST_F(CudaKernelsEmulated, QuantizeAndDequantizeBlocks) {
  struct Case {
    int64_t n, block;
  };
  for (const Case& c : {Case{1000, 16}, Case{777, 256}}) {
    SCOPED_TRACE("n=" + std::to_string(c.n) + " block=" + std::to_string(c.block));
    Vec x = Rand(c.n);
    for (int64_t i = 0; i < c.n; ++i) x[i] *= std::ldexp(1.0f, static_cast<int>(i / 64 % 40) - 20);
    if (c.n >= 64) {
      for (int64_t i = 0; i < 16; ++i) x[i] = 0.0f;
      x[20] = INFINITY;
      x[33] = NAN;
      x[34] = 1e30f;
    }
    const int64_t blocks = (c.n + c.block - 1) / c.block;
    for (int format : {1, 2}) {
      SCOPED_TRACE(format == 1 ? "int8" : "fp8");
      const fsdp::WireFormat f = static_cast<fsdp::WireFormat>(format);
      std::vector<uint8_t> gc(c.n, 0xcd), cc(c.n);
      Vec gs(blocks, -1.0f), cs(blocks);
      gpu::quantize_blocks(nullptr, gc.data(), gs.data(), x.data(), c.n, c.block, format);
      cpu::quantize_blocks(cc.data(), cs.data(), x.data(), c.n, c.block, f);
      EXPECT_TRUE(Same(gc, cc));
      EXPECT_TRUE(SameOrNaN(gs, cs));
      Vec g32(c.n), c32(c.n);
      gpu::dequantize_blocks(nullptr, g32.data(), 0, cc.data(), cs.data(), c.n, c.block, format);
      cpu::dequantize_blocks(c32.data(), fsdp::DType::kF32, cc.data(), cs.data(), c.n, c.block, f);
      EXPECT_TRUE(SameOrNaN(g32, c32));
      for (int d : {1, 2}) {
        const fsdp::DType dt = d == 1 ? fsdp::DType::kBF16 : fsdp::DType::kF16;
        std::vector<uint16_t> g16(c.n), c16(c.n);
        gpu::dequantize_blocks(nullptr, g16.data(), d, cc.data(), cs.data(), c.n, c.block, format);
        cpu::dequantize_blocks(c16.data(), dt, cc.data(), cs.data(), c.n, c.block, f);
        Vec gw(c.n), cw(c.n);
        for (int64_t i = 0; i < c.n; ++i) {
          gw[i] = d == 1 ? fsdp::Bf16ToFloat(g16[i]) : fsdp::F16ToFloat(g16[i]);
          cw[i] = d == 1 ? fsdp::Bf16ToFloat(c16[i]) : fsdp::F16ToFloat(c16[i]);
        }
        EXPECT_TRUE(SameOrNaN(gw, cw));
      }
    }
  }
}

TEST_F(CudaKernelsEmulated, SumSquaresAndMean) {
  for (int64_t n : {0, 1, 1000, 70000}) {
    SCOPED_TRACE("n=" + std::to_string(n));
    const Vec x = Rand(n);
    double got = 1.5;  // += into the device scalar
    std::vector<double> partials(gpu::kSumSquaresPartials, std::nan(""));
    gpu::sum_squares(nullptr, &got, x.data(), n, partials.data());
    const double want = 1.5 + cpu::sum_squares(x.data(), n);
    EXPECT_NEAR(got, want, 1e-12 * want);
    float mean = -1.0f;
    gpu::mean(nullptr, &mean, x.data(), n);
    double sum = 0;
    for (float v : x) sum += v;
    const float want_mean = static_cast<float>(sum / static_cast<double>(n));
    if (n == 0) {
      EXPECT_TRUE(std::isnan(mean)) << mean;
    } else {
      EXPECT_NEAR(mean, want_mean, 1e-6 * std::fabs(want_mean) + 1e-12);
    }
  }
}

TEST_F(CudaKernelsEmulated, SplitF64AndGlobalNormClip) {
  for (double in : {1.0 / 3.0 * 1e10, -2.5, 0.0, 1e-300}) {
    float out[2] = {7, 7};
    gpu::split_f64(nullptr, out, &in);
    EXPECT_EQ(out[0], static_cast<float>(in));
    EXPECT_EQ(out[1], static_cast<float>(in - static_cast<double>(out[0])));
  }
  // As host_ops.h GlobalNormClip: f64 partials (wide) or f32 (hi, lo) pairs.
  auto reference = [](const void* p, bool wide, int64_t n, double k, float max_norm,
                      double* total, float* factor) {
    double sum = 0;
    for (int64_t r = 0; r < n; ++r) {
      sum += wide ? static_cast<const double*>(p)[r]
                  : static_cast<double>(static_cast<const float*>(p)[2 * r]) +
                        static_cast<const float*>(p)[2 * r + 1];
    }
    *total = sum;
    *factor = static_cast<float>(fsdp::ClipCoefficient(std::sqrt(sum) / k, max_norm) / k);
  };
  const double wide[3] = {1.0, 4.0, 11.0};
  const float pairs[6] = {1.0f, 1e-9f, 3.0f, -1e-9f, 1e3f, 0.5f};
  struct Case {
    const void* p;
    bool wide;
    int64_t n;
    double k;
    float max_norm;
  };
  for (const Case& c : {Case{wide, true, 3, 2.0, 1.0f}, Case{wide, true, 3, 1.0, 100.0f},
                        Case{pairs, false, 3, 1.0, 0.0f}, Case{pairs, false, 3, 4.0, 2.0f},
                        Case{pairs, false, 0, 4.0, 1.0f}}) {
    SCOPED_TRACE("wide=" + std::to_string(c.wide) + " n=" + std::to_string(c.n) +
                 " k=" + std::to_string(c.k) + " max_norm=" + std::to_string(c.max_norm));
    double t1 = -1, t2 = -2;
    float f1 = -1, f2 = -2;
    gpu::global_norm_clip(nullptr, &t1, &f1, c.p, c.wide, c.n, c.k, c.max_norm);
    reference(c.p, c.wide, c.n, c.k, c.max_norm, &t2, &f2);
    EXPECT_EQ(t1, t2);
    EXPECT_EQ(f1, f2);
  }
}

}  // namespace
