// Single-rank training step of the GPT (default `mini`, batch 4 x 256) on the CPU backend with
// all cores, and its MFU against the oneDNN sgemm peak measured in the same run
// (MODEL_SPEC.md "Figures": peak = sgemm 2048^3 GFLOP/s on one core x cores used).
//
// Usage: train_step_bench [--config mini] [--batch 4] [--seq 256] [--steps 10] [--warmup 2]
//                         [--threads 0]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/nn/gpt.h"
#include "fsdp/ops.h"
#include "fsdp/optim.h"

namespace {

struct Args {
  std::string config = "mini";
  int batch = 4, seq = 256, steps = 10, warmup = 2, threads = 0;
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--config") a.config = v;
    else if (k == "--batch") a.batch = std::atoi(v.c_str());
    else if (k == "--seq") a.seq = std::atoi(v.c_str());
    else if (k == "--steps") a.steps = std::atoi(v.c_str());
    else if (k == "--warmup") a.warmup = std::atoi(v.c_str());
    else if (k == "--threads") a.threads = std::atoi(v.c_str());
    else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      std::exit(2);
    }
  }
  return a;
}

void Check(const absl::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "train_step_bench: %s\n", s.ToString().c_str());
    std::exit(1);
  }
}
template <typename T>
T Get(absl::StatusOr<T> v) {
  Check(v.status());
  return std::move(*v);
}

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  using fsdp::Buffer;
  const Args args = ParseArgs(argc, argv);
  const fsdp::nn::GptConfig config = Get(fsdp::nn::GptConfig::FromName(args.config));
  auto backend = Get(fsdp::CpuBackend::Create({.num_threads = args.threads}));
  backend->BindCurrentThread();
  const int threads = backend->num_threads();
  const int B = args.batch, T = args.seq;

  const double peak_core = fsdp::kernels::cpu::measure_sgemm_gflops(2048, 1, 5);
  const double peak_all = fsdp::kernels::cpu::measure_sgemm_gflops(2048, threads, 5);
  backend->BindCurrentThread();

  // Parameters, gradients and AdamW per unit, as the trainer of examples/train_gpt.cc holds them.
  const int num_units = fsdp::nn::GptNumUnits(config);
  const auto specs = fsdp::nn::GptParamSpecs(config);
  std::vector<Buffer> params, grads;
  std::vector<std::unique_ptr<fsdp::AdamW>> opts;
  std::vector<fsdp::View> p, g;
  for (int u = 0; u < num_units; ++u) {
    const int64_t n = fsdp::nn::GptUnitNumel(config, u);
    params.push_back(Get(Buffer::Create(backend.get(), n * sizeof(float))));
    grads.push_back(Get(Buffer::Create(backend.get(), n * sizeof(float))));
    fsdp::nn::InitUnit(config, u, 1, params.back().as<float>());
    opts.push_back(Get(fsdp::AdamW::Create(backend.get(), n, fsdp::nn::UnitDecayRanges(specs, u))));
    p.push_back(params.back().view());
    g.push_back(grads.back().view());
  }
  auto gpt = Get(fsdp::nn::Gpt::Create(config, backend.get(), B, T));
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % config.vocab_size);
  Buffer ids = Get(Buffer::Create(backend.get(), tokens.size() * sizeof(int32_t)));
  Check(backend->CopyFromHost(ids.view(fsdp::DType::kI32), tokens.data()));
  // The clip runs on the device as the runtime's does: sum of squares (f64), split, global
  // norm and clip factor, scale.
  Buffer sum_sq = Get(Buffer::Create(backend.get(), sizeof(double)));
  Buffer split = Get(Buffer::Create(backend.get(), 2 * sizeof(float)));
  Buffer factor = Get(Buffer::Create(backend.get(), sizeof(float)));
  fsdp::Ops& ops = backend->ops();
  const fsdp::Stream cs = fsdp::Stream::kCompute;

  std::vector<double> step_s, fwd_s, bwd_s, opt_s;
  for (int s = 0; s < args.warmup + args.steps; ++s) {
    const double t0 = Now();
    const fsdp::View idx = ids.view(fsdp::DType::kI32);
    Check(gpt->Forward(p, idx, idx).status());
    const double t1 = Now();
    for (int u = 0; u < num_units; ++u) Check(backend->Memset(g[u], 0));
    Check(gpt->Backward(p, g));
    const double t2 = Now();
    const fsdp::View sq = sum_sq.view(fsdp::DType::kF64);
    Check(backend->Memset(sq, 0));
    for (int u = 0; u < num_units; ++u) ops.SumSquares(cs, sq, g[u]);
    ops.SplitF64(cs, split.view(), sq);
    ops.GlobalNormClip(cs, sq, factor.view(), split.view(), 1.0, 1.0f);
    for (int u = 0; u < num_units; ++u) {
      ops.ScaleBy(cs, g[u], factor.view());
      Check(opts[u]->Step(p[u], g[u]));
    }
    Check(backend->Synchronize());
    const double t3 = Now();
    if (s < args.warmup) continue;
    fwd_s.push_back(t1 - t0);
    bwd_s.push_back(t2 - t1);
    opt_s.push_back(t3 - t2);
    step_s.push_back(t3 - t0);
  }

  const int64_t tokens_per_step = static_cast<int64_t>(B) * T;
  const double flops = config.flops_per_step(tokens_per_step, T);
  const double step = Median(step_s);
  const double achieved = flops / step / 1e9;
  std::printf("train_step_bench: %s (%.2fM parameters), batch %d x %d = %lld tokens/step, "
              "%d threads, median of %d steps after %d warm-up\n",
              config.name.c_str(), config.num_parameters() / 1e6, B, T,
              static_cast<long long>(tokens_per_step), threads, args.steps, args.warmup);
  std::printf("  %-34s %10.1f GFLOP/s\n", "sgemm 2048^3, 1 thread (peak/core)", peak_core);
  std::printf("  %-34s %10.1f GFLOP/s\n", ("sgemm 2048^3, " + std::to_string(threads) + " threads").c_str(), peak_all);
  std::printf("  %-34s %10.1f ms   (min %.1f, max %.1f)\n", "step time", step * 1e3,
              *std::min_element(step_s.begin(), step_s.end()) * 1e3,
              *std::max_element(step_s.begin(), step_s.end()) * 1e3);
  std::printf("  %-34s %10.1f / %.1f / %.1f ms\n", "  forward / backward / clip+AdamW",
              Median(fwd_s) * 1e3, Median(bwd_s) * 1e3, Median(opt_s) * 1e3);
  std::printf("  %-34s %10.0f\n", "tokens/s", tokens_per_step / step);
  std::printf("  %-34s %10.2f GFLOP\n", "model FLOPs per step", flops / 1e9);
  std::printf("  %-34s %10.1f GFLOP/s\n", "achieved", achieved);
  std::printf("  %-34s %10.1f %%  (of %d x %.1f GFLOP/s)\n", "MFU", 100 * achieved / (peak_core * threads),
              threads, peak_core);
  return 0;
}
