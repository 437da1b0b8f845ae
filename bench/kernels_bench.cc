// CPU kernel benchmarks. sgemm 2048^3 on one core and on all cores is the MFU peak of
// MODEL_SPEC.md (and the bf16 GEMM 2048^3 the peak of bf16 compute, next to the Linear layers
// in bf16); the layer kernels run at the `mini` GPT shapes (B=8, T=256, C=384, NH=6).
// Counters: GFLOP/s (model FLOPs: attention counts the full T x T products, as the PaLM
// formula does) or GB/s (bytes the kernel must read and write) for memory-bound kernels.
//
//   build/bench/kernels_bench --benchmark_counters_tabular=true
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "benchmark/benchmark.h"
#include "bench/attention_full_square.h"
#include "fsdp/kernels_cpu.h"
#include "kernels/cpu/attention.h"

namespace k = fsdp::kernels::cpu;

namespace {

constexpr int64_t kB = 8, kT = 256, kC = 384, kNH = 6, kV = 256;
constexpr int64_t kTokens = kB * kT;

std::vector<float> Random(int64_t n, float scale = 1.0f) {
  std::mt19937 rng(static_cast<unsigned>(n));
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

// Runs the benchmark on `threads` OpenMP threads (0 = all) and restores the count after.
class ThreadScope {
 public:
  explicit ThreadScope(int threads) : saved_(omp_get_max_threads()) {
    omp_set_num_threads(threads > 0 ? threads : omp_get_num_procs());
  }
  ~ThreadScope() { omp_set_num_threads(saved_); }

 private:
  int saved_;
};

void SetFlops(benchmark::State& state, double flops_per_iter) {
  state.counters["GFLOP/s"] =
      benchmark::Counter(flops_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void SetBytes(benchmark::State& state, double bytes_per_iter) {
  state.counters["GB/s"] =
      benchmark::Counter(bytes_per_iter * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// ---- sgemm: the MFU peak ---------------------------------------------------------------------
// Args: n, threads (0 = all cores).
void BM_Sgemm(benchmark::State& state) {
  const int64_t n = state.range(0);
  ThreadScope scope(static_cast<int>(state.range(1)));
  const int threads = omp_get_max_threads();
  const auto a = Random(n * n), b = Random(n * n);
  std::vector<float> c(n * n);
  k::sgemm(c.data(), a.data(), b.data(), n, n, n);  // warm-up: plan, page faults
  for (auto _ : state) {
    k::sgemm(c.data(), a.data(), b.data(), n, n, n);
    benchmark::DoNotOptimize(c.data());
  }
  const double flops = 2.0 * n * n * n;
  SetFlops(state, flops);
  state.counters["GFLOP/s/core"] = benchmark::Counter(
      flops * 1e-9 / threads, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["threads"] = threads;
}
BENCHMARK(BM_Sgemm)->Args({2048, 1})->Args({2048, 0})->Unit(benchmark::kMillisecond)
    ->UseRealTime()->MinTime(2.0);

// ---- Linear layers of one `mini` block: M = B*T tokens; args K (in), N (out) ---------------
void BM_MatmulForward(benchmark::State& state) {
  const int64_t M = kTokens, K = state.range(0), N = state.range(1);
  ThreadScope scope(static_cast<int>(state.range(2)));
  const auto inp = Random(M * K), w = Random(N * K, 0.05f), bias = Random(N);
  std::vector<float> out(M * N);
  for (auto _ : state) {
    k::matmul_forward(out.data(), inp.data(), w.data(), bias.data(), M, K, N);
    benchmark::DoNotOptimize(out.data());
  }
  SetFlops(state, 2.0 * M * K * N);
}

void BM_MatmulBackward(benchmark::State& state) {
  const int64_t M = kTokens, K = state.range(0), N = state.range(1);
  ThreadScope scope(static_cast<int>(state.range(2)));
  const auto inp = Random(M * K), w = Random(N * K, 0.05f), dout = Random(M * N);
  std::vector<float> dinp(M * K), dw(N * K), db(N);
  for (auto _ : state) {
    k::matmul_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), M,
                       K, N);
    benchmark::DoNotOptimize(dinp.data());
  }
  SetFlops(state, 4.0 * M * K * N);
}

// c_attn (C -> 3C), attn c_proj (C -> C), mlp c_fc (C -> 4C), mlp c_proj (4C -> C).
// Arg threads: 1 = one core (the per-core MFU), 0 = all cores.
#define MINI_LINEAR_SHAPES                                                                  \
  ArgNames({"K", "N", "threads"})->ArgsProduct({{kC}, {3 * kC, kC, 4 * kC}, {1, 0}})        \
      ->Args({4 * kC, kC, 1})->Args({4 * kC, kC, 0})->Unit(benchmark::kMillisecond)         \
      ->UseRealTime()
BENCHMARK(BM_MatmulForward)->MINI_LINEAR_SHAPES;
BENCHMARK(BM_MatmulBackward)->MINI_LINEAR_SHAPES;

// The same layers in bf16 compute (the mixed-precision Linear: bf16 weights, the f32
// activations rounded to bf16, f32 accumulation) on the kernel the Linear layers use here
// (kernels::cpu::lowp_gemm_choice: oneDNN's native bf16 matmul, or its operands widened to the
// f32 GEMM; FSDP_LOWP_GEMM picks one), named in each row's label; and the native bf16 GEMM
// peak, which a CPU without that matmul in oneDNN skips, saying so.
void LabelBf16Kernel(benchmark::State& state) {
  state.SetLabel(k::matmul_lowp_native(fsdp::DType::kBF16) ? "native bf16"
                                                            : "widened to f32");
}

bool SkippedWithoutBf16(benchmark::State& state) {
  if (k::lowp_gemm_choice(fsdp::DType::kBF16).native_available) return false;
  state.SkipWithError("skipped: oneDNN has no native bf16 matmul on this CPU");
  return true;
}

void BM_GemmBf16Peak(benchmark::State& state) {
  if (SkippedWithoutBf16(state)) return;
  ThreadScope scope(static_cast<int>(state.range(1)));
  const int threads = omp_get_max_threads();
  double gflops = 0;
  for (auto _ : state) gflops = k::measure_gemm_gflops(state.range(0), 0, 3, fsdp::DType::kBF16);
  state.counters["GFLOP/s"] = gflops;
  state.counters["GFLOP/s/core"] = gflops / threads;
  state.counters["threads"] = threads;
}
BENCHMARK(BM_GemmBf16Peak)->Args({2048, 1})->Args({2048, 0})->Unit(benchmark::kMillisecond)
    ->UseRealTime()->Iterations(1);

std::vector<uint16_t> Bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  k::cast_f32_to_bf16(out.data(), v.data(), static_cast<int64_t>(v.size()));
  return out;
}

void BM_MatmulForwardBf16(benchmark::State& state) {
  LabelBf16Kernel(state);
  const int64_t M = kTokens, K = state.range(0), N = state.range(1);
  ThreadScope scope(static_cast<int>(state.range(2)));
  const auto inp = Random(M * K), bias = Random(N);
  const auto w = Bf16(Random(N * K, 0.05f)), b16 = Bf16(bias);
  std::vector<float> out(M * N);
  for (auto _ : state) {
    k::matmul_forward_lowp(out.data(), inp.data(), w.data(), b16.data(), M, K, N,
                           fsdp::DType::kBF16);
    benchmark::DoNotOptimize(out.data());
  }
  SetFlops(state, 2.0 * M * K * N);
}

void BM_MatmulBackwardBf16(benchmark::State& state) {
  LabelBf16Kernel(state);
  const int64_t M = kTokens, K = state.range(0), N = state.range(1);
  ThreadScope scope(static_cast<int>(state.range(2)));
  const auto inp = Random(M * K), dout = Random(M * N);
  const auto w = Bf16(Random(N * K, 0.05f));
  std::vector<float> dinp(M * K), dw(N * K), db(N);
  for (auto _ : state) {
    k::matmul_backward_lowp(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                            M, K, N, fsdp::DType::kBF16);
    benchmark::DoNotOptimize(dinp.data());
  }
  SetFlops(state, 4.0 * M * K * N);
}
BENCHMARK(BM_MatmulForwardBf16)->MINI_LINEAR_SHAPES;
BENCHMARK(BM_MatmulBackwardBf16)->MINI_LINEAR_SHAPES;

// ---- Attention ----------------------------------------------------------------------------
void BM_AttentionForward(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const auto qkv = Random(kTokens * 3 * kC);
  std::vector<float> out(kTokens * kC), lse(kB * kNH * kT);
  for (auto _ : state) {
    k::attention_forward(out.data(), lse.data(), qkv.data(), kB, kT, kC, kNH);
    benchmark::DoNotOptimize(out.data());
  }
  SetFlops(state, 4.0 * kB * kT * kT * kC);  // q k^T and p v
}
BENCHMARK(BM_AttentionForward)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_AttentionBackward(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const auto qkv = Random(kTokens * 3 * kC), dout = Random(kTokens * kC);
  std::vector<float> out(kTokens * kC), lse(kB * kNH * kT), dqkv(kTokens * 3 * kC);
  k::attention_forward(out.data(), lse.data(), qkv.data(), kB, kT, kC, kNH);
  for (auto _ : state) {
    k::attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), kB, kT,
                          kC, kNH);
    benchmark::DoNotOptimize(dqkv.data());
  }
  SetFlops(state, 8.0 * kB * kT * kT * kC);  // twice the forward
}
BENCHMARK(BM_AttentionBackward)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

// Forward + backward of one Llama attention layer at llama-mini's heads (6 query heads, 2 kv
// heads, D = 64), B = 1, on all cores (one rank's threads), by sequence length: the blocked
// kernels of the library (kernel 1: the log-sum-exp kept, the probabilities recomputed) against
// the full-square baseline (kernel 0: bench/attention_full_square.cc, the T x T probabilities
// kept). Counters: GFLOP/s as above (forward 4 B T^2 C, backward twice that, C = 6 * 64), and
// the bytes each kernel allocates: `kept_MiB`, what forward keeps for backward beyond its
// output (lse or att), and `scratch_MiB`, the per-thread working buffers of backward, summed
// over the threads.
void BM_LlamaAttention(benchmark::State& state) {
  ThreadScope scope(0);
  constexpr int64_t B = 1, NH = 6, NKV = 2, D = 64, C = NH * D, W = (NH + 2 * NKV) * D;
  constexpr int64_t kBlock = k::internal::kAttentionBlock;  // the library kernels' block
  const int64_t T = state.range(0);
  const bool flash = state.range(1) != 0;
  const auto qkv = Random(B * T * W), dout = Random(B * T * C);
  std::vector<float> out(B * T * C), dqkv(B * T * W);
  std::vector<float> kept(flash ? B * NH * T : B * NH * T * T);
  for (auto _ : state) {
    if (flash) {
      k::gqa_attention_forward(out.data(), kept.data(), qkv.data(), B, T, NH, NKV, D);
      k::gqa_attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), kept.data(), B,
                                T, NH, NKV, D);
    } else {
      fsdp::bench::FullSquareAttentionForward(out.data(), kept.data(), qkv.data(), B, T, NH, NKV,
                                              D, kBlock);
      fsdp::bench::FullSquareAttentionBackward(dqkv.data(), dout.data(), qkv.data(), kept.data(),
                                               B, T, NH, NKV, D, kBlock);
    }
    benchmark::DoNotOptimize(dqkv.data());
  }
  SetFlops(state, 12.0 * B * T * T * C);
  const double threads = omp_get_max_threads(), mib = 1024.0 * 1024.0;
  state.counters["kept_MiB"] = static_cast<double>(kept.size()) * sizeof(float) / mib;
  const double scratch = flash ? (2.0 * std::min(kBlock, T) + NH / NKV) * T
                               : static_cast<double>(T) * T;
  state.counters["scratch_MiB"] = threads * scratch * sizeof(float) / mib;
}
BENCHMARK(BM_LlamaAttention)->ArgNames({"T", "flash"})->ArgsProduct({{256, 1024, 2048, 4096}, {0, 1}})
    ->Unit(benchmark::kMillisecond)->UseRealTime();

// ---- Memory-bound layers ----------------------------------------------------------------------
void BM_LayernormForward(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const auto inp = Random(kTokens * kC), w = Random(kC), b = Random(kC);
  std::vector<float> out(kTokens * kC), mean(kTokens), rstd(kTokens);
  for (auto _ : state) {
    k::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                         kTokens, kC);
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, 2.0 * kTokens * kC * sizeof(float));
}
BENCHMARK(BM_LayernormForward)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_LayernormBackward(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const auto inp = Random(kTokens * kC), w = Random(kC), b = Random(kC),
             dout = Random(kTokens * kC);
  std::vector<float> out(kTokens * kC), mean(kTokens), rstd(kTokens), dinp(kTokens * kC),
      dw(kC), db(kC);
  k::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(),
                       kTokens, kC);
  for (auto _ : state) {
    k::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(),
                          mean.data(), rstd.data(), kTokens, kC);
    benchmark::DoNotOptimize(dinp.data());
  }
  SetBytes(state, 4.0 * kTokens * kC * sizeof(float));  // read x, dy, dx; write dx
}
BENCHMARK(BM_LayernormBackward)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_GeluForward(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = kTokens * 4 * kC;
  const auto inp = Random(n, 3.0f);
  std::vector<float> out(n);
  for (auto _ : state) {
    k::gelu_forward(out.data(), inp.data(), n);
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, 2.0 * n * sizeof(float));
}
BENCHMARK(BM_GeluForward)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

// bf16 compute keeps GELU's output in bf16: written rounded by the kernel (Bf16), against the
// f32 kernel followed by a cast (ThenCast), what the model ran before.
void BM_GeluForwardBf16(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = kTokens * 4 * kC;
  const auto inp = Random(n, 3.0f);
  std::vector<uint16_t> out(n);
  for (auto _ : state) {
    k::gelu_forward_lowp(out.data(), inp.data(), n, fsdp::DType::kBF16);
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, 1.5 * n * sizeof(float));
}
BENCHMARK(BM_GeluForwardBf16)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_GeluForwardThenCast(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = kTokens * 4 * kC;
  const auto inp = Random(n, 3.0f);
  std::vector<float> out(n);
  std::vector<uint16_t> low(n);
  for (auto _ : state) {
    k::gelu_forward(out.data(), inp.data(), n);
    k::cast_f32_to_bf16(low.data(), out.data(), n);
    benchmark::DoNotOptimize(low.data());
  }
  SetBytes(state, 1.5 * n * sizeof(float));
}
BENCHMARK(BM_GeluForwardThenCast)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

void BM_GeluBackward(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = kTokens * 4 * kC;
  const auto inp = Random(n, 3.0f), dout = Random(n);
  std::vector<float> dinp(n);
  for (auto _ : state) {
    k::gelu_backward(dinp.data(), inp.data(), dout.data(), n);
    benchmark::DoNotOptimize(dinp.data());
  }
  SetBytes(state, 4.0 * n * sizeof(float));
}
BENCHMARK(BM_GeluBackward)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

// The bf16 compute path rounds every Linear layer's f32 input (and, in backward, its output
// gradient) to bf16: here the MLP's widest activation.
void BM_CastF32ToBf16(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = kTokens * 4 * kC;
  const auto inp = Random(n, 3.0f);
  std::vector<uint16_t> out(n);
  for (auto _ : state) {
    k::cast_f32_to_bf16(out.data(), inp.data(), n);
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, 1.0 * n * (sizeof(float) + sizeof(uint16_t)));
}
BENCHMARK(BM_CastF32ToBf16)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

void BM_SoftmaxCrossEntropy(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const auto logits = Random(kTokens * kV, 4.0f);
  std::vector<int32_t> targets(kTokens);
  for (int64_t i = 0; i < kTokens; ++i) targets[i] = static_cast<int32_t>(i % kV);
  std::vector<float> losses(kTokens), probs(kTokens * kV), dlogits(kTokens * kV);
  for (auto _ : state) {
    k::softmax_crossentropy_forward(losses.data(), probs.data(), logits.data(), targets.data(),
                                    kTokens, kV);
    k::softmax_crossentropy_backward(dlogits.data(), probs.data(), targets.data(),
                                     1.0f / kTokens, kTokens, kV);
    benchmark::DoNotOptimize(dlogits.data());
  }
  SetBytes(state, 5.0 * kTokens * kV * sizeof(float));
}
BENCHMARK(BM_SoftmaxCrossEntropy)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMicrosecond)->UseRealTime();

// Block quantization for the wire over all `mini` parameters (~10.8 M, block 256): a shard's
// codes and scales (int8, fp8 e4m3), and every rank's codes decoded into bf16 parameters.
void BM_QuantizeBlocks(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const fsdp::WireFormat f = state.range(1) == 0 ? fsdp::WireFormat::kInt8
                                                 : fsdp::WireFormat::kFp8E4M3;
  const int64_t n = 10'800'000, block = 256;
  const auto x = Random(n, 3.0f);
  std::vector<uint8_t> codes(n);
  std::vector<float> scales(n / block + 1);
  for (auto _ : state) {
    k::quantize_blocks(codes.data(), scales.data(), x.data(), n, block, f);
    benchmark::DoNotOptimize(codes.data());
  }
  SetBytes(state, 1.0 * n * (sizeof(float) + 1));
}
BENCHMARK(BM_QuantizeBlocks)->ArgNames({"threads", "fp8"})->Args({1, 0})->Args({1, 1})
    ->Args({0, 0})->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_DequantizeBlocksBf16(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = 10'800'000, block = 256;
  const auto x = Random(n, 3.0f);
  std::vector<uint8_t> codes(n);
  std::vector<float> scales(n / block + 1);
  k::quantize_blocks(codes.data(), scales.data(), x.data(), n, block, fsdp::WireFormat::kInt8);
  std::vector<uint16_t> out(n);
  for (auto _ : state) {
    k::dequantize_blocks(out.data(), fsdp::DType::kBF16, codes.data(), scales.data(), n, block,
                         fsdp::WireFormat::kInt8);
    benchmark::DoNotOptimize(out.data());
  }
  SetBytes(state, 1.0 * n * (1 + sizeof(uint16_t)));
}
BENCHMARK(BM_DequantizeBlocksBf16)->ArgName("threads")->Arg(1)->Arg(0)
    ->Unit(benchmark::kMillisecond)->UseRealTime();

// AdamW over all `mini` parameters (~10.8 M): read p, g, m, v; write p, m, v.
void BM_AdamW(benchmark::State& state) {
  ThreadScope scope(static_cast<int>(state.range(0)));
  const int64_t n = 10'800'000;
  auto p = Random(n), g = Random(n), m = Random(n, 0.01f), v = Random(n, 0.01f);
  for (float& x : v) x = x * x;
  int64_t step = 1;
  for (auto _ : state) {
    k::adamw_update(p.data(), g.data(), m.data(), v.data(), n,
                    fsdp::AdamWStepScalars(3e-4f, 0.9f, 0.95f, 1e-8f, 0.1f, step++));
    benchmark::DoNotOptimize(p.data());
  }
  SetBytes(state, 7.0 * n * sizeof(float));
}
BENCHMARK(BM_AdamW)->ArgName("threads")->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
