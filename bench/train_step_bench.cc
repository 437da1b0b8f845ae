// Single-rank training step of a bundled model (default the GPT `mini`, batch 4 x 256; any
// name of MODEL_SPEC.md, e.g. --model llama-mini) on the CPU backend with
// all cores, in f32 and in bf16 compute (the mixed-precision path: bf16 weights cast from the
// f32 master each step, bf16 x bf16 GEMMs with f32 accumulation), steps of the two
// interleaved so that their ratio comes from one run. MFU is against the GEMM peak of the
// step's own compute dtype measured in the same run (MODEL_SPEC.md "Figures": peak = GEMM
// 2048^3 GFLOP/s on one core x cores used; sgemm for f32, the bf16 GEMM for bf16, or sgemm
// where the bf16 run widens its operands to f32: kernels::cpu::lowp_gemm_choice, printed).
// Then where a step's time goes: each op's time per step (the backend times every op,
// CpuBackendOptions::time_ops), side by side for the dtypes, with the difference to the first.
//
// Usage: train_step_bench [--model mini] [--batch 4] [--seq 256] [--steps 10] [--warmup 2]
//                         [--threads 0] [--dtypes f32,bf16]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/ops.h"
#include "fsdp/optim.h"

namespace {

struct Args {
  std::string config = "mini";
  int batch = 4, seq = 256, steps = 10, warmup = 2, threads = 0;
  std::vector<fsdp::DType> dtypes = {fsdp::DType::kF32, fsdp::DType::kBF16};
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model" || k == "--config") a.config = v;
    else if (k == "--batch") a.batch = std::atoi(v.c_str());
    else if (k == "--seq") a.seq = std::atoi(v.c_str());
    else if (k == "--steps") a.steps = std::atoi(v.c_str());
    else if (k == "--warmup") a.warmup = std::atoi(v.c_str());
    else if (k == "--threads") a.threads = std::atoi(v.c_str());
    else if (k == "--dtypes") {
      a.dtypes.clear();
      for (absl::string_view name : absl::StrSplit(v, ',')) {
        const std::optional<fsdp::DType> d =
            fsdp::ParseDType(std::string_view(name.data(), name.size()));
        if (d.has_value() && fsdp::IsFloat16Or32(*d)) {
          a.dtypes.push_back(*d);
        } else {
          std::fprintf(stderr, "--dtypes: '%s' is not f32, bf16 or f16\n",
                       std::string(name).c_str());
          std::exit(2);
        }
      }
    } else {
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

// One compute dtype's model, parameters (f32 master, and its cast in the compute dtype),
// gradients, AdamW and step times.
struct Run {
  fsdp::DType dtype;
  std::unique_ptr<fsdp::nn::StagedModel> gpt;
  std::vector<fsdp::Buffer> params, compute, grads;
  std::vector<std::unique_ptr<fsdp::AdamW>> opts;
  std::vector<double> step_s, fwd_s, bwd_s, opt_s;
  std::map<std::string, std::vector<double>> op_s;  // per op: its seconds in each step
  std::map<std::string, int64_t> op_calls;          // per op: calls in one step
  double peak_core = 0;
  bool widened = false;  // a 16-bit dtype run on f32 GEMMs (no native 16-bit matmul)
};

// Each op's median time per step for every run, the ops that take the most first, with the
// difference of each later run to the first.
void PrintOpTimes(const std::vector<Run>& runs) {
  std::map<std::string, double> longest;  // per op: its largest median over the runs
  for (const Run& r : runs) {
    for (const auto& [op, v] : r.op_s) longest[op] = std::max(longest[op], Median(v));
  }
  std::vector<std::pair<double, std::string>> order;
  for (const auto& [op, t] : longest) order.emplace_back(-t, op);
  std::sort(order.begin(), order.end());
  std::printf("  where a step's time goes: each op's median ms per step (calls per step)\n");
  std::printf("    %-26s", "op");
  for (const Run& r : runs) std::printf(" %16s", fsdp::DTypeName(r.dtype).data());
  for (size_t i = 1; i < runs.size(); ++i) {
    std::printf("   %s-%s", fsdp::DTypeName(runs[i].dtype).data(),
                fsdp::DTypeName(runs[0].dtype).data());
  }
  std::printf("\n");
  std::vector<double> total(runs.size(), 0.0);
  for (const auto& [neg, op] : order) {
    std::vector<double> ms;
    for (const Run& r : runs) {
      const auto it = r.op_s.find(op);
      ms.push_back(it == r.op_s.end() ? 0.0 : Median(it->second) * 1e3);
    }
    for (size_t i = 0; i < runs.size(); ++i) total[i] += ms[i];
    if (-neg * 1e3 < 0.05) continue;  // below what a step's noise shows
    std::printf("    %-26s", op.c_str());
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto c = runs[i].op_calls.find(op);
      std::printf(" %8.2f (%5lld)", ms[i],
                  static_cast<long long>(c == runs[i].op_calls.end() ? 0 : c->second));
    }
    for (size_t i = 1; i < runs.size(); ++i) std::printf("   %+8.2f", ms[i] - ms[0]);
    std::printf("\n");
  }
  std::printf("    %-26s", "(every op)");
  for (size_t i = 0; i < runs.size(); ++i) std::printf(" %8.2f        ", total[i]);
  for (size_t i = 1; i < runs.size(); ++i) std::printf("   %+8.2f", total[i] - total[0]);
  std::printf("\n");
}

int main(int argc, char** argv) {
  using fsdp::Buffer;
  using fsdp::DType;
  const Args args = ParseArgs(argc, argv);
  const fsdp::nn::ModelConfig config = Get(fsdp::nn::ModelConfig::FromName(args.config));
  auto backend = Get(fsdp::CpuBackend::Create({.num_threads = args.threads, .time_ops = true}));
  backend->BindCurrentThread();
  const int threads = backend->num_threads();
  const int B = args.batch, T = args.seq;

  const double sgemm_all = fsdp::kernels::cpu::measure_sgemm_gflops(2048, threads, 5);
  backend->BindCurrentThread();

  const int num_units = config.num_units();
  const auto specs = config.ParamSpecs();
  std::vector<Run> runs;
  for (DType dtype : args.dtypes) {
    Run r;
    r.dtype = dtype;
    if (fsdp::kernels::cpu::matmul_lowp_native(dtype)) {
      r.peak_core = fsdp::kernels::cpu::measure_gemm_gflops(2048, 1, 5, dtype);
    } else {
      // The Linear layers widen their rounded operands to f32 (kernels/cpu/matmul_lowp.cc:
      // no native 16-bit matmul, or the f32 GEMM measured faster), so the f32 GEMM is the
      // peak.
      r.widened = true;
      r.peak_core = fsdp::kernels::cpu::measure_gemm_gflops(2048, 1, 5, DType::kF32);
    }
    backend->BindCurrentThread();
    // Parameters, gradients and AdamW per unit, as the trainer of examples/train_gpt.cc holds
    // them.
    for (int u = 0; u < num_units; ++u) {
      const int64_t n = config.UnitNumel(u);
      r.params.push_back(Get(Buffer::Create(backend.get(), n * sizeof(float))));
      r.grads.push_back(Get(Buffer::Create(backend.get(), n * sizeof(float))));
      if (dtype != DType::kF32) {
        r.compute.push_back(Get(Buffer::Create(backend.get(), n * fsdp::DTypeSize(dtype))));
      }
      for (const fsdp::nn::ParamSpec& spec : specs) {
        if (spec.unit == u) {
          config.InitParamSlice(spec, 1, 0, spec.numel, r.params.back().as<float>() + spec.offset);
        }
      }
      r.opts.push_back(
          Get(fsdp::AdamW::Create(backend.get(), n, fsdp::nn::UnitDecayRanges(specs, u))));
    }
    r.gpt = Get(config.CreateModel(backend.get(), B, T, {.compute_dtype = dtype}));
    runs.push_back(std::move(r));
  }
  std::vector<int32_t> tokens(static_cast<size_t>(B) * T);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % config.vocab_size());
  Buffer ids = Get(Buffer::Create(backend.get(), tokens.size() * sizeof(int32_t)));
  Check(backend->CopyFromHost(ids.view(DType::kI32), tokens.data()));
  // The clip runs on the device as the runtime's does: sum of squares (f64), split, global
  // norm and clip factor, scale.
  Buffer sum_sq = Get(Buffer::Create(backend.get(), sizeof(double)));
  Buffer split = Get(Buffer::Create(backend.get(), 2 * sizeof(float)));
  Buffer factor = Get(Buffer::Create(backend.get(), sizeof(float)));
  fsdp::Ops& ops = backend->ops();
  const fsdp::Stream cs = fsdp::Stream::kCompute;

  for (int s = 0; s < args.warmup + args.steps; ++s) {
    for (Run& r : runs) {  // the dtypes alternate step by step: one run, the same noise
      std::vector<fsdp::View> p, g;
      backend->ResetOpTimes();
      const double t0 = Now();
      for (int u = 0; u < num_units; ++u) {
        g.push_back(r.grads[u].view());
        if (r.dtype == DType::kF32) {
          p.push_back(r.params[u].view());
        } else {  // as the runtime's gather does: the f32 master cast to the compute dtype
          p.push_back(r.compute[u].view(r.dtype));
          ops.Cast(cs, p.back(), r.params[u].view());
        }
      }
      const fsdp::View idx = ids.view(DType::kI32);
      Check(r.gpt->Forward(p, idx, idx).status());
      const double t1 = Now();
      for (int u = 0; u < num_units; ++u) Check(backend->Memset(g[u], 0));
      Check(r.gpt->Backward(p, g));
      const double t2 = Now();
      const fsdp::View sq = sum_sq.view(DType::kF64);
      Check(backend->Memset(sq, 0));
      for (int u = 0; u < num_units; ++u) ops.SumSquares(cs, sq, g[u]);
      ops.SplitF64(cs, split.view(), sq);
      ops.GlobalNormClip(cs, sq, factor.view(), split.view(), 1.0, 1.0f);
      for (int u = 0; u < num_units; ++u) {
        ops.ScaleBy(cs, g[u], factor.view());
        Check(r.opts[u]->Step(r.params[u].view(), g[u]));
      }
      Check(backend->Synchronize());
      const double t3 = Now();
      if (s < args.warmup) continue;
      r.fwd_s.push_back(t1 - t0);
      r.bwd_s.push_back(t2 - t1);
      r.opt_s.push_back(t3 - t2);
      r.step_s.push_back(t3 - t0);
      for (const fsdp::CpuOpTime& t : backend->op_times()) {
        std::vector<double>& v = r.op_s[t.op];
        v.resize(r.step_s.size() - 1, 0.0);  // an op a step did not run took 0 s there
        v.push_back(t.seconds);
        r.op_calls[t.op] = t.calls;
      }
    }
  }
  for (Run& r : runs) {
    for (auto& [op, v] : r.op_s) v.resize(r.step_s.size(), 0.0);
  }

  const int64_t tokens_per_step = static_cast<int64_t>(B) * T;
  const double flops = config.flops_per_step(tokens_per_step, T);
  std::printf("train_step_bench: %s (%.2fM parameters), batch %d x %d = %lld tokens/step, "
              "%d threads, median of %d steps after %d warm-up, dtypes interleaved\n",
              config.name().c_str(), config.num_parameters() / 1e6, B, T,
              static_cast<long long>(tokens_per_step), threads, args.steps, args.warmup);
  std::printf("  %-34s %10.1f GFLOP/s\n", ("sgemm 2048^3, " + std::to_string(threads) + " threads").c_str(), sgemm_all);
  std::printf("  %-34s %10.2f GFLOP\n", "model FLOPs per step", flops / 1e9);
  for (const Run& r : runs) {
    const char* name = fsdp::DTypeName(r.dtype).data();
    const double step = Median(r.step_s);
    const double achieved = flops / step / 1e9;
    std::printf("  %s compute\n", name);
    if (r.dtype != DType::kF32) {
      const auto c = fsdp::kernels::cpu::lowp_gemm_choice(r.dtype);
      std::printf("    %s Linear GEMMs: %s (%s", name, r.widened ? "widened to f32" : "native",
                  c.reason);
      if (c.native_gflops > 0) {
        std::printf("; %lld^3 forward: native %.1f, widened %.1f GFLOP/s",
                    static_cast<long long>(fsdp::kernels::cpu::kLowpGemmProbeSize),
                    c.native_gflops, c.widened_gflops);
      }
      std::printf(")\n");
    }
    std::printf("    %-32s %10.1f GFLOP/s\n",
                (std::string(r.widened ? "f32" : name) + " GEMM 2048^3, 1 thread (peak/core)").c_str(),
                r.peak_core);
    std::printf("    %-32s %10.1f ms   (min %.1f, max %.1f)\n", "step time", step * 1e3,
                *std::min_element(r.step_s.begin(), r.step_s.end()) * 1e3,
                *std::max_element(r.step_s.begin(), r.step_s.end()) * 1e3);
    std::printf("    %-32s %10.1f / %.1f / %.1f ms\n", "  forward / backward / clip+AdamW",
                Median(r.fwd_s) * 1e3, Median(r.bwd_s) * 1e3, Median(r.opt_s) * 1e3);
    std::printf("    %-32s %10.0f\n", "tokens/s", tokens_per_step / step);
    std::printf("    %-32s %10.1f GFLOP/s\n", "achieved", achieved);
    std::printf("    %-32s %10.1f %%  (of %d x %.1f GFLOP/s, the %s GEMM peak)\n", "MFU",
                100 * achieved / (r.peak_core * threads), threads, r.peak_core,
                r.widened ? "f32" : name);
  }
  for (size_t i = 1; i < runs.size(); ++i) {
    std::printf("  %s step / %s step: %.3f (%.2fx faster)\n", fsdp::DTypeName(runs[i].dtype).data(),
                fsdp::DTypeName(runs[0].dtype).data(),
                Median(runs[i].step_s) / Median(runs[0].step_s),
                Median(runs[0].step_s) / Median(runs[i].step_s));
  }
  PrintOpTimes(runs);
  return 0;
}
