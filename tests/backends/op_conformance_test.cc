// The op conformance suite: every op of a backend's table (fsdp/ops.h) against the CPU kernels
// (kernels::cpu, on host memory), on odd shapes, with inputs copied to the device and results
// copied back: the only way a test reaches device memory. Gradients start non-zero, so
// accumulation (+=) is checked too.
//
// Tolerances are per dtype for a backend with kernels of its own. `cpu` and `sim` run the
// reference kernels themselves, so any difference there is a bug in the plumbing (a view's
// offset, a stream's order): they must match bitwise.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/ops.h"
#include "fsdp/optim.h"
#include "fsdp/sim_backend.h"
#include "gtest/gtest.h"
#include "tests/test_backend.h"

namespace fsdp {
namespace {

std::unique_ptr<Backend> MakeBackend(const std::string& name) {
  if (name == "sim") return std::move(SimBackend::Create({.num_threads = 1})).value();
  if (name == "pjrt" || name == "cuda") {
    absl::StatusOr<std::unique_ptr<Backend>> b = testing::MakeTestBackend(1, 0, name);
    return b.ok() ? *std::move(b) : nullptr;
  }
  auto cpu = std::move(CpuBackend::Create({.num_threads = 1})).value();
  cpu->BindCurrentThread();
  return cpu;
}

// Buffers on the backend under test, filled from and read back to the host.
class Device {
 public:
  explicit Device(Backend* b) : b_(b) {}
  template <typename T>
  View In(const std::vector<T>& host, DType dtype) {
    buffers_.push_back(std::move(Buffer::Create(b_, host.size() * sizeof(T))).value());
    const View v = buffers_.back().view(dtype);
    EXPECT_TRUE(b_->CopyFromHost(v, host.data()).ok());
    return v;
  }
  View In(const std::vector<float>& host) { return In(host, DType::kF32); }
  View InI32(const std::vector<int32_t>& host) { return In(host, DType::kI32); }
  template <typename T = float>
  std::vector<T> Read(View v) {
    std::vector<T> out(static_cast<size_t>(v.bytes()) / sizeof(T));
    const absl::Status s = b_->CopyToHost(out.data(), v);
    EXPECT_TRUE(s.ok()) << s;
    return out;
  }

 private:
  Backend* b_;
  std::vector<Buffer> buffers_;
};

std::vector<float> Random(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// The f32 values of 16-bit elements of dtype d.
std::vector<float> FromLowp(const std::vector<uint16_t>& x, DType d) {
  std::vector<float> out(x.size());
  const int64_t n = static_cast<int64_t>(x.size());
  if (d == DType::kBF16) {
    kernels::cpu::cast_bf16_to_f32(out.data(), x.data(), n);
  } else {
    kernels::cpu::cast_f16_to_f32(out.data(), x.data(), n);
  }
  return out;
}

std::vector<uint16_t> ToLowp(const std::vector<float>& x, DType d) {
  std::vector<uint16_t> out(x.size());
  const int64_t n = static_cast<int64_t>(x.size());
  if (d == DType::kBF16) {
    kernels::cpu::cast_f32_to_bf16(out.data(), x.data(), n);
  } else {
    kernels::cpu::cast_f32_to_f16(out.data(), x.data(), n);
  }
  return out;
}

// Why the backend cannot run here ("" when it can): pjrt without its plugin, cuda without a
// device.
std::string Unavailable(const std::string& backend) {
  if (backend == "pjrt") return testing::PjrtUnavailable();
  if (backend == "cuda") return testing::CudaUnavailable();
  return "";
}

class OpConformanceTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = Unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
    backend_ = MakeBackend(GetParam());
    ASSERT_NE(backend_, nullptr);
    dev_ = std::make_unique<Device>(backend_.get());
  }
  Ops& ops() { return backend_->ops(); }
  static constexpr Stream cs = Stream::kCompute;

  // Relative tolerance of a result computed in `d`: zero for the backends that run the
  // reference kernels.
  double Tolerance(DType d) const {
    if (GetParam() == "cpu" || GetParam() == "sim") return 0.0;
    return d == DType::kF32 ? 1e-5 : d == DType::kF16 ? 2e-3 : 1e-2;
  }
  void Expect(const std::vector<float>& got, const std::vector<float>& want, DType d,
              const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    const double tol = Tolerance(d);
    for (size_t i = 0; i < got.size(); ++i) {
      if (tol == 0.0) {
        ASSERT_EQ(std::memcmp(&got[i], &want[i], 4), 0)
            << what << "[" << i << "]: " << got[i] << " vs " << want[i];
      } else {
        ASSERT_NEAR(got[i], want[i], tol * (1.0 + std::abs(want[i]))) << what << "[" << i << "]";
      }
    }
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Device> dev_;
};

TEST_P(OpConformanceTest, MatmulForwardAndBackwardInEveryComputeDtype) {
  const int64_t M = 7, K = 13, N = 5;
  const auto inp = Random(M * K, 1), w = Random(N * K, 2), bias = Random(N, 3);
  const auto dout = Random(M * N, 4);
  for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (bool with_bias : {true, false}) {
      SCOPED_TRACE(std::string(DTypeName(d)) + (with_bias ? " bias" : " no bias"));
      // Reference on the host.
      std::vector<float> out(M * N), dinp = Random(M * K, 5), dw = Random(N * K, 6),
                                     db = Random(N, 7);
      const std::vector<float> dinp0 = dinp, dw0 = dw, db0 = db;
      View vw, vb;
      if (d == DType::kF32) {
        kernels::cpu::matmul_forward(out.data(), inp.data(), w.data(),
                                     with_bias ? bias.data() : nullptr, M, K, N);
        kernels::cpu::matmul_backward(dinp.data(), dw.data(), with_bias ? db.data() : nullptr,
                                      dout.data(), inp.data(), w.data(), M, K, N);
        vw = dev_->In(w);
        vb = with_bias ? dev_->In(bias) : View{};
      } else {
        const auto wl = ToLowp(w, d), bl = ToLowp(bias, d);
        kernels::cpu::matmul_forward_lowp(out.data(), inp.data(), wl.data(),
                                          with_bias ? bl.data() : nullptr, M, K, N, d);
        kernels::cpu::matmul_backward_lowp(dinp.data(), dw.data(),
                                           with_bias ? db.data() : nullptr, dout.data(),
                                           inp.data(), wl.data(), M, K, N, d);
        vw = dev_->In(wl, d);
        vb = with_bias ? dev_->In(bl, d) : View{};
      }
      const View vout = dev_->In(std::vector<float>(M * N, -1.0f));
      const View vinp = dev_->In(inp), vdout = dev_->In(dout);
      const View vdinp = dev_->In(dinp0), vdw = dev_->In(dw0), vdb = dev_->In(db0);
      ops().MatmulForward(cs, vout, vinp, vw, vb, M, K, N);
      ops().MatmulBackward(cs, vdinp, vdw, with_bias ? vdb : View{}, vdout, vinp, vw, M, K, N);
      // The operands are rounded to d and the products (exact in f32) summed in f32: a correct
      // backend differs from the reference only in its order of f32 additions, so the f32
      // tolerance applies (d's would let an operand that was not rounded pass).
      Expect(dev_->Read(vout), out, DType::kF32, "out");
      Expect(dev_->Read(vdinp), dinp, DType::kF32, "dinp");
      Expect(dev_->Read(vdw), dw, DType::kF32, "dweight");
      Expect(dev_->Read(vdb), with_bias ? db : db0, DType::kF32, "dbias");
      if (d == DType::kF32) continue;
      // Backward's input as a kept copy in d (already rounded): the same gradients.
      const View vdinp2 = dev_->In(dinp0), vdw2 = dev_->In(dw0), vdb2 = dev_->In(db0);
      ops().MatmulBackward(cs, vdinp2, vdw2, with_bias ? vdb2 : View{}, vdout,
                           dev_->In(ToLowp(inp, d), d), vw, M, K, N);
      Expect(dev_->Read(vdinp2), dinp, DType::kF32, "dinp, kept input");
      Expect(dev_->Read(vdw2), dw, DType::kF32, "dweight, kept input");
      Expect(dev_->Read(vdb2), with_bias ? db : db0, DType::kF32, "dbias, kept input");
      // Forward's input as a kept copy: the same output.
      const View vout2 = dev_->In(std::vector<float>(M * N, -1.0f));
      ops().MatmulForward(cs, vout2, dev_->In(ToLowp(inp, d), d), vw, vb, M, K, N);
      Expect(dev_->Read(vout2), out, DType::kF32, "out, kept input");
    }
  }
}

TEST_P(OpConformanceTest, LayernormForwardAndBackward) {
  const int64_t N = 5, C = 11;
  const auto inp = Random(N * C, 1, 2.0f), w = Random(C, 2), b = Random(C, 3),
             dout = Random(N * C, 4);
  std::vector<float> out(N * C), mean(N), rstd(N), dinp = Random(N * C, 5), dw = Random(C, 6),
                                                   db = Random(C, 7);
  const View vdinp = dev_->In(dinp), vdw = dev_->In(dw), vdb = dev_->In(db);
  kernels::cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(),
                                  b.data(), N, C, 1e-5f);
  kernels::cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(),
                                   w.data(), mean.data(), rstd.data(), N, C);
  const View vout = dev_->In(std::vector<float>(N * C)), vmean = dev_->In(std::vector<float>(N)),
             vrstd = dev_->In(std::vector<float>(N));
  const View vinp = dev_->In(inp), vw = dev_->In(w), vb = dev_->In(b), vdout = dev_->In(dout);
  ops().LayernormForward(cs, vout, vmean, vrstd, vinp, vw, vb, N, C, 1e-5f);
  ops().LayernormBackward(cs, vdinp, vdw, vdb, vdout, vinp, vw, vmean, vrstd, N, C);
  Expect(dev_->Read(vout), out, DType::kF32, "out");
  Expect(dev_->Read(vmean), mean, DType::kF32, "mean");
  Expect(dev_->Read(vrstd), rstd, DType::kF32, "rstd");
  Expect(dev_->Read(vdinp), dinp, DType::kF32, "dinp");
  Expect(dev_->Read(vdw), dw, DType::kF32, "dweight");
  Expect(dev_->Read(vdb), db, DType::kF32, "dbias");
}

TEST_P(OpConformanceTest, GeluAttentionAndSoftmaxCrossEntropy) {
  const int64_t n = 37;
  const auto x = Random(n, 1, 2.0f), dy = Random(n, 2);
  std::vector<float> y(n), dx = Random(n, 3);
  const View vdx = dev_->In(dx);
  kernels::cpu::gelu_forward(y.data(), x.data(), n);
  kernels::cpu::gelu_backward(dx.data(), x.data(), dy.data(), n);
  const View vy = dev_->In(std::vector<float>(n)), vx = dev_->In(x), vdy = dev_->In(dy);
  ops().GeluForward(cs, vy, vx);
  ops().GeluBackward(cs, vdx, vx, vdy);
  Expect(dev_->Read(vy), y, DType::kF32, "gelu");
  Expect(dev_->Read(vdx), dx, DType::kF32, "gelu'");
  // Forward's output in bf16 / f16: the f32 values rounded as written.
  for (DType d : {DType::kBF16, DType::kF16}) {
    const View vy16 = dev_->In(std::vector<uint16_t>(n, 0xabcd), d);
    ops().GeluForward(cs, vy16, vx);
    const std::string what = "gelu into " + std::string(DTypeName(d));
    Expect(FromLowp(dev_->Read<uint16_t>(vy16), d), FromLowp(ToLowp(y, d), d), d, what.c_str());
  }
  // Backward's input as a kept bf16 / f16 copy: the f32 kernel on its widened values.
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> xl = ToLowp(x, d);
    const std::vector<float> xw = FromLowp(xl, d);
    std::vector<float> want = Random(n, 3);
    kernels::cpu::gelu_backward(want.data(), xw.data(), dy.data(), n);
    const View vdx2 = dev_->In(Random(n, 3));
    ops().GeluBackward(cs, vdx2, dev_->In(xl, d), vdy);
    const std::string what = "gelu', kept " + std::string(DTypeName(d));
    Expect(dev_->Read(vdx2), want, DType::kF32, what.c_str());
  }

  const int64_t B = 2, T = 5, C = 12, NH = 3;
  const auto qkv = Random(B * T * 3 * C, 4), dout = Random(B * T * C, 5);
  std::vector<float> out(B * T * C), lse(B * NH * T), dqkv = Random(B * T * 3 * C, 6);
  const View vdqkv = dev_->In(dqkv);
  kernels::cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH);
  kernels::cpu::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), B,
                                   T, C, NH);
  const View vout = dev_->In(std::vector<float>(out.size())),
             vlse = dev_->In(std::vector<float>(lse.size()));
  const View vqkv = dev_->In(qkv), vdout = dev_->In(dout);
  ops().AttentionForward(cs, vout, vlse, vqkv, B, T, C, NH);
  ops().AttentionBackward(cs, vdqkv, vdout, vqkv, vout, vlse, B, T, C, NH);
  Expect(dev_->Read(vout), out, DType::kF32, "attention");
  Expect(dev_->Read(vlse), lse, DType::kF32, "lse");
  Expect(dev_->Read(vdqkv), dqkv, DType::kF32, "dqkv");
  // Backward's qkv and out as kept bf16 / f16 copies: the f32 kernel on their widened values.
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> qkv16 = ToLowp(qkv, d), out16 = ToLowp(out, d);
    std::vector<float> want = Random(B * T * 3 * C, 6);
    kernels::cpu::gqa_attention_backward_kept(want.data(), dout.data(), qkv16.data(), d,
                                              out16.data(), d, lse.data(), B, T, NH, NH, C / NH);
    const View vdqkv2 = dev_->In(Random(B * T * 3 * C, 6));
    ops().AttentionBackward(cs, vdqkv2, vdout, dev_->In(qkv16, d), dev_->In(out16, d),
                            dev_->In(lse), B, T, C, NH);
    const std::string what = "dqkv, kept " + std::string(DTypeName(d));
    Expect(dev_->Read(vdqkv2), want, DType::kF32, what.c_str());
  }

  const int64_t N = 6, V = 13;
  const auto logits = Random(N * V, 7, 3.0f);
  const std::vector<int32_t> targets = {0, 12, 5, -1, 7, 7};  // -1 is ignored
  std::vector<float> losses(N), probs(N * V), dlogits = Random(N * V, 8);
  const View vdlogits = dev_->In(dlogits);
  kernels::cpu::softmax_crossentropy_forward(losses.data(), probs.data(), logits.data(),
                                             targets.data(), N, V);
  kernels::cpu::softmax_crossentropy_backward(dlogits.data(), probs.data(), targets.data(),
                                              0.25f, N, V);
  const View vlosses = dev_->In(std::vector<float>(N)), vprobs = dev_->In(std::vector<float>(N * V));
  const View vlogits = dev_->In(logits), vtargets = dev_->InI32(targets);
  ops().SoftmaxCrossEntropyForward(cs, vlosses, vprobs, vlogits, vtargets, N, V);
  ops().SoftmaxCrossEntropyBackward(cs, vdlogits, vprobs, vtargets, 0.25f, N, V);
  Expect(dev_->Read(vlosses), losses, DType::kF32, "losses");
  Expect(dev_->Read(vprobs), probs, DType::kF32, "probs");
  Expect(dev_->Read(vdlogits), dlogits, DType::kF32, "dlogits");
  // Mean into a device scalar.
  const View vmean = dev_->In(std::vector<float>(1));
  ops().Mean(cs, vmean, vlosses);
  double sum = 0;
  for (float l : losses) sum += l;
  Expect(dev_->Read(vmean), {static_cast<float>(sum / N)}, DType::kF32, "mean");
}

TEST_P(OpConformanceTest, LlamaLayers) {
  // RMSNorm.
  {
    const int64_t N = 5, C = 11;
    const auto inp = Random(N * C, 1, 2.0f), w = Random(C, 2), dout = Random(N * C, 3);
    std::vector<float> out(N * C), rstd(N), dinp = Random(N * C, 4), dw = Random(C, 5);
    const View vdinp = dev_->In(dinp), vdw = dev_->In(dw);
    kernels::cpu::rmsnorm_forward(out.data(), rstd.data(), inp.data(), w.data(), N, C, 1e-6f);
    kernels::cpu::rmsnorm_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(),
                                   rstd.data(), N, C);
    const View vout = dev_->In(std::vector<float>(N * C)),
               vrstd = dev_->In(std::vector<float>(N));
    const View vinp = dev_->In(inp), vw = dev_->In(w), vdout = dev_->In(dout);
    ops().RmsnormForward(cs, vout, vrstd, vinp, vw, N, C, 1e-6f);
    ops().RmsnormBackward(cs, vdinp, vdw, vdout, vinp, vw, vrstd, N, C);
    Expect(dev_->Read(vout), out, DType::kF32, "rmsnorm out");
    Expect(dev_->Read(vrstd), rstd, DType::kF32, "rstd");
    Expect(dev_->Read(vdinp), dinp, DType::kF32, "rmsnorm dinp");
    Expect(dev_->Read(vdw), dw, DType::kF32, "rmsnorm dweight");
    // Without the input gradient (a frozen input): dweight only.
    std::vector<float> dw_only = Random(C, 6);
    const View vdw_only = dev_->In(dw_only);
    kernels::cpu::rmsnorm_backward(nullptr, dw_only.data(), dout.data(), inp.data(), w.data(),
                                   rstd.data(), N, C);
    ops().RmsnormBackward(cs, View{}, vdw_only, vdout, vinp, vw, vrstd, N, C);
    Expect(dev_->Read(vdw_only), dw_only, DType::kF32, "rmsnorm dweight only");
  }
  // Rotary embeddings in place on the q and k heads of a grouped qkv (v and a slice offset
  // untouched), forward then backward on a gradient.
  {
    const int64_t B = 2, T = 5, NH = 3, NKV = 1, D = 6, W = (NH + 2 * NKV) * D;
    const auto x0 = Random(B * T * W + 3, 7), g0 = Random(B * T * W, 8);
    std::vector<float> x = x0, g = g0;
    kernels::cpu::rope_forward(x.data() + 3, B, T, W, NH + NKV, D, 10000.0f);
    kernels::cpu::rope_backward(g.data(), B, T, W, NH + NKV, D, 10000.0f);
    const View vx = dev_->In(x0), vg = dev_->In(g0);
    ops().RopeForward(cs, vx.Slice(3, B * T * W), B, T, W, NH + NKV, D, 10000.0f);
    ops().RopeBackward(cs, vg, B, T, W, NH + NKV, D, 10000.0f);
    Expect(dev_->Read(vx), x, DType::kF32, "rope");
    Expect(dev_->Read(vg), g, DType::kF32, "rope backward");
  }
  // Grouped-query attention.
  {
    const int64_t B = 2, T = 5, NH = 4, NKV = 2, D = 3, W = (NH + 2 * NKV) * D;
    const auto qkv = Random(B * T * W, 9), dout = Random(B * T * NH * D, 10);
    std::vector<float> out(B * T * NH * D), lse(B * NH * T), dqkv = Random(B * T * W, 11);
    const View vdqkv = dev_->In(dqkv);
    kernels::cpu::gqa_attention_forward(out.data(), lse.data(), qkv.data(), B, T, NH, NKV, D);
    kernels::cpu::gqa_attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(),
                                         lse.data(), B, T, NH, NKV, D);
    const View vout = dev_->In(std::vector<float>(out.size())),
               vlse = dev_->In(std::vector<float>(lse.size()));
    const View vqkv = dev_->In(qkv), vdout = dev_->In(dout);
    ops().GqaAttentionForward(cs, vout, vlse, vqkv, B, T, NH, NKV, D);
    ops().GqaAttentionBackward(cs, vdqkv, vdout, vqkv, vout, vlse, B, T, NH, NKV, D);
    Expect(dev_->Read(vout), out, DType::kF32, "gqa attention");
    Expect(dev_->Read(vlse), lse, DType::kF32, "gqa lse");
    Expect(dev_->Read(vdqkv), dqkv, DType::kF32, "gqa dqkv");
    for (DType d : {DType::kBF16, DType::kF16}) {  // kept qkv (out f32), as AttentionBackward
      const std::vector<uint16_t> qkv16 = ToLowp(qkv, d);
      std::vector<float> want = Random(B * T * W, 11);
      kernels::cpu::gqa_attention_backward_kept(want.data(), dout.data(), qkv16.data(), d,
                                                out.data(), DType::kF32, lse.data(), B, T, NH,
                                                NKV, D);
      const View vdqkv2 = dev_->In(Random(B * T * W, 11));
      ops().GqaAttentionBackward(cs, vdqkv2, vdout, dev_->In(qkv16, d), dev_->In(out),
                                 dev_->In(lse), B, T, NH, NKV, D);
      const std::string what = "gqa dqkv, kept qkv " + std::string(DTypeName(d));
      Expect(dev_->Read(vdqkv2), want, DType::kF32, what.c_str());
    }
  }
  // SwiGLU.
  {
    const int64_t N = 7, F = 9;
    const auto gu = Random(N * 2 * F, 12, 3.0f), dout = Random(N * F, 13);
    std::vector<float> out(N * F), dgu = Random(N * 2 * F, 14);
    const View vdgu = dev_->In(dgu);
    kernels::cpu::swiglu_forward(out.data(), gu.data(), N, F);
    kernels::cpu::swiglu_backward(dgu.data(), dout.data(), gu.data(), N, F);
    const View vout = dev_->In(std::vector<float>(N * F)), vgu = dev_->In(gu);
    ops().SwigluForward(cs, vout, vgu, N, F);
    ops().SwigluBackward(cs, vdgu, dev_->In(dout), vgu, N, F);
    Expect(dev_->Read(vout), out, DType::kF32, "swiglu");
    for (DType d : {DType::kBF16, DType::kF16}) {  // forward's output rounded as written
      const View vout16 = dev_->In(std::vector<uint16_t>(N * F, 0xabcd), d);
      ops().SwigluForward(cs, vout16, vgu, N, F);
      const std::string what = "swiglu into " + std::string(DTypeName(d));
      Expect(FromLowp(dev_->Read<uint16_t>(vout16), d), FromLowp(ToLowp(out, d), d), d,
             what.c_str());
    }
    Expect(dev_->Read(vdgu), dgu, DType::kF32, "swiglu dgu");
    for (DType d : {DType::kBF16, DType::kF16}) {  // backward's gu a kept copy
      const std::vector<uint16_t> gu16 = ToLowp(gu, d);
      std::vector<float> want = Random(N * 2 * F, 14);
      kernels::cpu::swiglu_backward(want.data(), dout.data(), FromLowp(gu16, d).data(), N, F);
      const View vdgu2 = dev_->In(Random(N * 2 * F, 14));
      ops().SwigluBackward(cs, vdgu2, dev_->In(dout), dev_->In(gu16, d), N, F);
      const std::string what = "swiglu dgu, kept " + std::string(DTypeName(d));
      Expect(dev_->Read(vdgu2), want, DType::kF32, what.c_str());
    }
  }
}

TEST_P(OpConformanceTest, EmbeddingWithRepeatedIds) {
  const int64_t N = 7, C = 9, V = 11;
  const auto table = Random(V * C, 1), dout = Random(N * C, 2);
  const std::vector<int32_t> idx = {3, 0, 10, 3, 3, 5, 0};
  std::vector<float> out(N * C), dtable = Random(V * C, 3);
  const View vdtable = dev_->In(dtable);
  kernels::cpu::embedding_forward(out.data(), idx.data(), table.data(), N, C);
  kernels::cpu::embedding_backward(dtable.data(), dout.data(), idx.data(), N, C);
  const View vout = dev_->In(std::vector<float>(N * C)), vidx = dev_->InI32(idx);
  ops().EmbeddingForward(cs, vout, vidx, dev_->In(table), N, C);
  ops().EmbeddingBackward(cs, vdtable, dev_->In(dout), vidx, N, C);
  Expect(dev_->Read(vout), out, DType::kF32, "out");
  Expect(dev_->Read(vdtable), dtable, DType::kF32, "dtable");
}

TEST_P(OpConformanceTest, ElementwiseCastsAndReductionsOnSlices) {
  const int64_t n = 29;
  const auto a = Random(n + 3, 1), b = Random(n, 2), dout = Random(n, 3);
  // Views at an odd element offset inside a larger buffer.
  const View va = dev_->In(a).Slice(3, n), vb = dev_->In(b);
  const View vout = dev_->In(std::vector<float>(n));
  ops().Add(cs, vout, va, vb);
  std::vector<float> want(n);
  kernels::cpu::residual_forward(want.data(), a.data() + 3, b.data(), n);
  Expect(dev_->Read(vout), want, DType::kF32, "add");
  std::vector<float> da = Random(n, 4), db = Random(n, 5);
  const View vda = dev_->In(da), vdb = dev_->In(db);
  kernels::cpu::residual_backward(da.data(), db.data(), dout.data(), n);
  ops().AddBackward(cs, vda, vdb, dev_->In(dout));
  Expect(dev_->Read(vda), da, DType::kF32, "da");
  Expect(dev_->Read(vdb), db, DType::kF32, "db");

  // Casts both ways, bf16 and f16, with values that need rounding.
  for (DType d : {DType::kBF16, DType::kF16}) {
    const std::vector<uint16_t> lowp = ToLowp(b, d);
    const View vl = dev_->In(std::vector<uint16_t>(n), d);
    ops().Cast(cs, vl, vb);
    EXPECT_EQ(dev_->Read<uint16_t>(vl), lowp) << DTypeName(d);
    const View vback = dev_->In(std::vector<float>(n));
    ops().Cast(cs, vback, vl);
    Expect(dev_->Read(vback), FromLowp(lowp, d), DType::kF32, "cast back");
    // The kept copy and the rounded values in place, at an odd offset: what the two casts
    // give.
    const View vx = dev_->In(a).Slice(3, n);
    const View vkept = dev_->In(std::vector<uint16_t>(n + 1), d).Slice(1, n);
    ops().CastKeepingRounded(cs, vkept, vx);
    const std::vector<uint16_t> kept_want = ToLowp(std::vector<float>(a.begin() + 3, a.end()), d);
    EXPECT_EQ(dev_->Read<uint16_t>(vkept), kept_want) << DTypeName(d);
    Expect(dev_->Read(vx), FromLowp(kept_want, d), DType::kF32, "rounded in place");
  }

  // Scale by a host factor and by a device scalar.
  std::vector<float> s = b;
  kernels::cpu::scale_inplace(s.data(), 0.3f, n);
  const View vs = dev_->In(b);
  ops().Scale(cs, vs, 0.3f);
  Expect(dev_->Read(vs), s, DType::kF32, "scale");
  kernels::cpu::scale_inplace(s.data(), -1.75f, n);
  ops().ScaleBy(cs, vs, dev_->In(std::vector<float>{-1.75f}));
  Expect(dev_->Read(vs), s, DType::kF32, "scale by");

  // Reduce: sum and average of three inputs, in order, in f32, into one of them.
  const auto c = Random(n, 6);
  const View vc = dev_->In(c), vb2 = dev_->In(b);
  const View ins[3] = {vb2, va, vc};
  std::vector<float> sum(n), avg(n);
  for (int64_t i = 0; i < n; ++i) {
    sum[i] = (b[i] + a[3 + i]) + c[i];
    avg[i] = sum[i] / 3.0f;
  }
  const View vavg = dev_->In(std::vector<float>(n));
  ops().Reduce(cs, vavg, ins, ReduceOp::kAvg);
  ops().Reduce(cs, vb2, ins, ReduceOp::kSum);
  Expect(dev_->Read(vb2), sum, DType::kF32, "reduce sum");
  Expect(dev_->Read(vavg), avg, DType::kF32, "reduce avg");

  // Sum of squares accumulates in f64 on the device; split into an f32 pair; the global norm
  // and the clip factor from the pairs of three "ranks".
  const View sq = dev_->In(std::vector<double>{0.5}, DType::kF64);
  ops().SumSquares(cs, sq, va);
  ops().SumSquares(cs, sq, vb);
  const double want_sq = 0.5 + kernels::cpu::sum_squares(a.data() + 3, n) +
                         kernels::cpu::sum_squares(b.data(), n);
  const double got_sq = dev_->Read<double>(sq)[0];
  if (Tolerance(DType::kF32) == 0.0) {
    EXPECT_EQ(got_sq, want_sq);
  } else {  // summed in another order, in double
    EXPECT_NEAR(got_sq, want_sq, 1e-13 * want_sq);
  }
  const View pairs = dev_->In(std::vector<float>(6));
  for (int r = 0; r < 3; ++r) ops().SplitF64(cs, pairs.Slice(2 * r, 2), sq);
  const auto p = dev_->Read(pairs);
  // The split itself is exact on every backend.
  EXPECT_EQ(p[0], static_cast<float>(got_sq));
  EXPECT_EQ(p[1], static_cast<float>(got_sq - static_cast<double>(p[0])));
  EXPECT_NEAR(static_cast<double>(p[0]) + p[1], want_sq, 1e-12 * want_sq);
  const View total = dev_->In(std::vector<double>{0.0}, DType::kF64);
  const View factor = dev_->In(std::vector<float>{0.0f});
  for (float max_norm : {0.0f, 1.0f, 1e6f}) {
    ops().GlobalNormClip(cs, total, factor, pairs, 2.0, max_norm);
    double t = 0;
    for (int r = 0; r < 3; ++r) t += static_cast<double>(p[2 * r]) + p[2 * r + 1];
    EXPECT_EQ(dev_->Read<double>(total)[0], t);
    const float want_factor =
        static_cast<float>(ClipCoefficient(std::sqrt(t) / 2.0, max_norm) / 2.0);
    EXPECT_EQ(dev_->Read(factor)[0], want_factor) << "max_norm " << max_norm;
  }
}

TEST_P(OpConformanceTest, OptimizersOnAShardSlice) {
  const int64_t n = 23;
  const auto g = Random(n, 1), p0 = Random(n + 2, 2);
  std::vector<float> p = p0, m(n, 0.1f), v(n, 0.2f);
  const View vp = dev_->In(p0).Slice(2, n), vm = dev_->In(m), vv = dev_->In(v), vg = dev_->In(g);
  for (int64_t step = 1; step <= 3; ++step) {
    const AdamWScalars k = AdamWStepScalars(1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
    kernels::cpu::adamw_update(p.data() + 2, g.data(), m.data(), v.data(), n, k);
    ops().AdamW(cs, vp, vg, vm, vv, k);
  }
  Expect(dev_->Read(vp), std::vector<float>(p.begin() + 2, p.end()), DType::kF32, "adamw param");
  Expect(dev_->Read(vm), m, DType::kF32, "adamw m");
  Expect(dev_->Read(vv), v, DType::kF32, "adamw v");

  std::vector<float> q = p0, buf(n);
  const View vq = dev_->In(p0), vbuf = dev_->In(buf);
  for (int step = 1; step <= 3; ++step) {
    kernels::cpu::sgd_update(q.data(), g.data(), buf.data(), n, 0.1f, 0.9f, 0.1f, 0.01f, true,
                             step == 1);
    ops().Sgd(cs, vq.Slice(0, n), vg, vbuf, 0.1f, 0.9f, 0.1f, 0.01f, true, step == 1);
  }
  Expect(dev_->Read(vq), q, DType::kF32, "sgd param");
  Expect(dev_->Read(vbuf), buf, DType::kF32, "sgd momentum");
}

INSTANTIATE_TEST_SUITE_P(Backends, OpConformanceTest,
                         ::testing::Values("cpu", "sim", "pjrt", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

// Every op checks its views (backends/common/checked_ops.h): a 16-bit tensor of the other
// type, a view too small for the sizes, a cast between types it has no conversion for, or
// sizes that do not split into heads fail the backend with a message naming the op and the
// view, and the op is not run (it would read a 16-bit tensor as f32, past its end:
// AddressSanitizer's CI stage sees that; or leave its output unwritten). The failure is
// sticky: the next copy and every event after it return it.
class OpViewChecksTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string why = Unavailable(GetParam());
    if (!why.empty()) GTEST_SKIP() << why;
  }
  // What a fresh backend says after `issue` ran its op: the status of the copy after it.
  absl::Status After(const std::function<void(Ops&, Device&)>& issue) {
    std::unique_ptr<Backend> b = MakeBackend(GetParam());
    EXPECT_NE(b, nullptr);
    if (b == nullptr) return absl::InternalError("no backend");
    Device dev(b.get());
    const View probe = dev.In(std::vector<float>(4, 1.0f));
    issue(b->ops(), dev);
    std::vector<float> host(4);
    const absl::Status copied = b->CopyToHost(host.data(), probe);
    // Sticky: an event recorded later carries it too.
    const absl::Status later = b->Record(Stream::kCompute).Wait();
    EXPECT_EQ(copied.ok(), later.ok()) << copied << " / " << later;
    return copied;
  }
  static constexpr Stream cs = Stream::kCompute;
};

// A failed status whose message names all of `words`.
void ExpectRefused(const absl::Status& s, std::initializer_list<const char*> words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const char* w : words) EXPECT_NE(s.message().find(w), std::string::npos) << w << ": " << s;
}

TEST_P(OpViewChecksTest, LinearRefusesAnInputOfTheOther16BitTypeAndShortViews) {
  const int64_t M = 4, K = 8, N = 3;
  const auto inp = Random(M * K, 1), w = Random(N * K, 2), bias = Random(N, 3);
  // The control: the same call with good views runs.
  EXPECT_TRUE(After([&](Ops& ops, Device& d) {
                ops.MatmulForward(cs, d.In(std::vector<float>(M * N)),
                                  d.In(ToLowp(inp, DType::kBF16), DType::kBF16),
                                  d.In(ToLowp(w, DType::kBF16), DType::kBF16), View{}, M, K, N);
              }).ok());
  // A bf16 weight with an f16 kept input (read as f32, it would be read past its end).
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.MatmulForward(cs, d.In(std::vector<float>(M * N)),
                                    d.In(ToLowp(inp, DType::kF16), DType::kF16),
                                    d.In(ToLowp(w, DType::kBF16), DType::kBF16), View{}, M, K,
                                    N);
                }),
                {"MatmulForward", "the input: f16", "f32 or bf16"});
  // The same in backward, and a bias of another dtype than the weight, and a short output.
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.MatmulBackward(cs, View{}, d.In(std::vector<float>(N * K)), View{},
                                     d.In(std::vector<float>(M * N)),
                                     d.In(ToLowp(inp, DType::kF16), DType::kF16),
                                     d.In(ToLowp(w, DType::kBF16), DType::kBF16), M, K, N);
                }),
                {"MatmulBackward", "the input: f16"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.MatmulForward(cs, d.In(std::vector<float>(M * N)), d.In(inp),
                                    d.In(ToLowp(w, DType::kBF16), DType::kBF16), d.In(bias), M,
                                    K, N);
                }),
                {"MatmulForward", "the bias: f32", "bf16"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.MatmulForward(cs, d.In(std::vector<float>(M * N - 1)), d.In(inp), d.In(w),
                                    View{}, M, K, N);
                }),
                {"MatmulForward", "the output", std::to_string(M * N - 1).c_str()});
}

TEST_P(OpViewChecksTest, KeptCopyOpsRefuseOtherTypesAndShortViews) {
  const int64_t B = 1, T = 3, C = 8, NH = 2, n = 12;
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.GeluBackward(cs, d.In(std::vector<float>(n)),
                                   d.In(std::vector<int32_t>(n), DType::kI32),
                                   d.In(std::vector<float>(n)));
                }),
                {"GeluBackward", "the input: i32"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.GeluForward(cs, d.In(std::vector<uint16_t>(n - 1), DType::kBF16),
                                  d.In(std::vector<float>(n)));
                }),
                {"GeluForward", "the output: bf16 with 11 elements"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.SwigluBackward(cs, d.In(std::vector<float>(2 * n)),
                                     d.In(std::vector<float>(n)),
                                     d.In(std::vector<uint16_t>(n), DType::kF16), n, 1);
                }),
                {"SwigluBackward", "gu: f16 with 12 elements", "at least 24"});
  // qkv kept in bf16 but one row short; C that does not split into heads.
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.AttentionBackward(cs, d.In(std::vector<float>(B * T * 3 * C)),
                                        d.In(std::vector<float>(B * T * C)),
                                        d.In(std::vector<uint16_t>((B * T - 1) * 3 * C),
                                             DType::kBF16),
                                        d.In(std::vector<float>(B * T * C)),
                                        d.In(std::vector<float>(B * NH * T)), B, T, C, NH);
                }),
                {"AttentionBackward", "qkv: bf16"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.AttentionForward(cs, d.In(std::vector<float>(B * T * C)),
                                       d.In(std::vector<float>(B * 3 * T)),
                                       d.In(std::vector<float>(B * T * 3 * C)), B, T, C, 3);
                }),
                {"AttentionForward", "C=8 does not split into NH=3"});
}

TEST_P(OpViewChecksTest, RuntimeOpsAndF32LayersRefuseWrongViews) {
  const int64_t n = 12;
  // Cast has no bf16 -> f16 conversion: it used to leave the output unwritten.
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.Cast(cs, d.In(std::vector<uint16_t>(n), DType::kF16),
                           d.In(std::vector<uint16_t>(n), DType::kBF16));
                }),
                {"Cast", "no cast from bf16 to f16"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.Cast(cs, d.In(std::vector<uint16_t>(n - 2), DType::kBF16),
                           d.In(std::vector<float>(n)));
                }),
                {"Cast", "out: bf16 with 10 elements", "at least 12"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.AdamW(cs, d.In(std::vector<float>(n)), d.In(std::vector<float>(n)),
                            d.In(std::vector<float>(n - 1)), d.In(std::vector<float>(n)),
                            AdamWScalars{});
                }),
                {"AdamW", "m: f32 with 11 elements"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  const View out = d.In(std::vector<float>(n));
                  const View other = d.In(std::vector<uint16_t>(n), DType::kBF16);
                  const View ins[] = {out, other};
                  ops.Reduce(cs, out, ins, ReduceOp::kSum);
                }),
                {"Reduce", "an input: bf16"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.LayernormForward(cs, d.In(std::vector<float>(2 * 6)),
                                       d.In(std::vector<float>(2)), d.In(std::vector<float>(2)),
                                       d.In(std::vector<float>(2 * 6)),
                                       d.In(std::vector<float>(5)), d.In(std::vector<float>(6)),
                                       2, 6, 1e-5f);
                }),
                {"LayernormForward", "the weight: f32 with 5 elements", "at least 6"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.SoftmaxCrossEntropyForward(cs, d.In(std::vector<float>(3)),
                                                 d.In(std::vector<float>(3 * 4)),
                                                 d.In(std::vector<float>(3 * 4)),
                                                 d.In(std::vector<float>(3)), 3, 4);
                }),
                {"SoftmaxCrossEntropyForward", "the targets: f32", "i32"});
  ExpectRefused(After([&](Ops& ops, Device& d) {
                  ops.RopeForward(cs, d.In(std::vector<float>(2 * 8)), 1, 2, 8, 2, 5, 1e4f);
                }),
                {"RopeForward", "the head size must be even"});
}

INSTANTIATE_TEST_SUITE_P(Backends, OpViewChecksTest,
                         ::testing::Values("cpu", "sim", "pjrt", "cuda"),
                         [](const ::testing::TestParamInfo<std::string>& info) {
                           return info.param;
                         });

}  // namespace
}  // namespace fsdp
