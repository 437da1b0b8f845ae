// fsdp_bench --project and --validate_projection (fsdp_bench.h, docs/scaling.md "Projection"):
// the grid predicted on a described cluster (fsdp/project.h), and the prediction checked
// against runs measured on the simulated link.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/fsdp_bench.h"
#include "fsdp/bench_report.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/plan.h"
#include "fsdp/project.h"

namespace fsdp_bench {
namespace {

fsdp::DType wl_reduce(const Args& a, fsdp::DType d) {
  return a.reduce_dtype == "same" ? d : FloatDTypeFlag("--reduce_dtype", a.reduce_dtype);
}


// The configurations the projection measures do not use MFU: the peak is given or not measured.
fsdp::BenchConfig ProjectionConfig(const Args& a, const std::string& model, fsdp::DType dtype,
                                   int checkpoint, int threads) {
  fsdp::BenchConfig c = BaseConfig(a, model, dtype, checkpoint, threads);
  if (a.peak_gflops > 0) {
    c.peak_gflops_per_core = a.peak_gflops;
    c.peak_kind = "given (--peak_gflops)";
  } else {
    c.peak_gflops_per_core = 1;  // MFU is not used here: skip measuring the peak
    c.peak_kind = "not measured";
  }
  return c;
}

std::string Gbps(double bytes_per_s) { return absl::StrFormat("%g GB/s", bytes_per_s / 1e9); }

}  // namespace

int RunProjection(const Args& a) {
  fsdp::LinkSpec link;
  link.algorithm = *fsdp::ParseCollectiveAlgorithm(a.algorithm);
  link.ranks_per_host = a.ranks_per_host;
  link.intra_bytes_per_s = a.link_gbps * 1e9;
  link.intra_latency_s = a.link_latency_us * 1e-6;
  link.inter_bytes_per_s = a.inter_gbps * 1e9;
  link.inter_latency_s = a.inter_latency_us * 1e-6;
  link.intra_efficiency = a.intra_eff;
  link.inter_efficiency = a.inter_effs.front();
  const bool flops = a.project_from == "flops";
  const int threads = a.threads > 0 ? a.threads : 1;

  std::printf("fsdp_bench --project: predicted, not measured. Assumptions:\n");
  std::printf("  cluster: %s; %s per host\n", a.cluster.c_str(),
              a.ranks_per_host > 0 ? absl::StrCat(a.ranks_per_host, " devices").c_str()
                                   : "all devices on one host");
  if (flops) {
    std::printf("  compute: MODEL_SPEC.md FLOPs at %g TFLOP/s dense peak x %g achieved = %g "
                "TFLOP/s per device: block forward 2 P_block BT + 4 C T BT, backward 2x forward, "
                "recompute 1x forward (checkpointed blocks), head 6 V C BT (forward + backward); "
                "embedding, norms, element-wise work and host work free\n",
                a.peak_tflops, a.achieved, a.peak_tflops * a.achieved);
    std::printf("  optimizer: AdamW on the rank's shard, 28 bytes per parameter at %g GB/s "
                "(memory-bound)\n", a.hbm_gbps);
  } else {
    std::printf("  compute: measured here, one rank (%d thread(s)), link off, per block and "
                "around the blocks, x %g\n", threads, a.compute_scale);
  }
  std::printf("  collectives: %s", std::string(fsdp::CollectiveAlgorithmName(link.algorithm)).c_str());
  if (link.algorithm == fsdp::CollectiveAlgorithm::kSimulatedLink) {
    std::printf(" (the local communicator's charge: latency + chunk / bandwidth per peer)\n");
  } else {
    std::printf(" (bus bandwidth = the slowest leg at the achieved fractions; the hosts' "
                "network shared by the groups that run at once)\n");
  }
  std::printf("  inside a host: %s per device and direction x %g achieved, %g us per hop\n",
              Gbps(link.intra_bytes_per_s).c_str(), link.intra_efficiency, a.link_latency_us);
  if (a.ranks_per_host > 0) {
    std::vector<std::string> effs;
    for (double e : a.inter_effs) effs.push_back(absl::StrFormat("%g", e));
    std::printf("  between hosts: %s per %s and direction x %s achieved, %g us per hop\n",
                Gbps(link.inter_bytes_per_s).c_str(),
                link.algorithm == fsdp::CollectiveAlgorithm::kSimulatedLink ? "pair of ranks"
                                                                            : "host",
                absl::StrJoin(effs, " / ").c_str(), a.inter_latency_us);
  }
  std::printf("  overlap: the runtime's schedule replayed (prefetch up to N units ahead, at most "
              "max(2, N + 1) reductions in flight, one serial queue per communicator); %s\n",
              a.overlap_slowdown > 0
                  ? absl::StrFormat("compute runs at %g of its speed while a collective runs "
                                    "beside it", 1 - a.overlap_slowdown).c_str()
                  : "compute runs at full speed beside collectives");
  std::printf("  batch: B=%d sequences per device, T=%s; weak scaling (the global batch grows "
              "with the devices)\n", a.batch,
              a.seq > 0 ? absl::StrCat(a.seq).c_str() : "the block size");
  if (a.device_mem_gib > 0) {
    std::printf("  memory: fsdp::PlanMemory per run against %g GiB per device\n",
                a.device_mem_gib);
  }
  std::printf("  efficiency: tokens/s per device against the same strategy's smallest world "
              "of the grid\n\n");

  struct Row {
    std::string model, strategy;
    fsdp::DType dtype;
    int ckpt, prefetch, world, shard;
    double inter_eff;
    fsdp::Projection p;
    double flops_per_rank;
    double eff = 0;
    std::string mem;
  };
  std::vector<Row> rows;
  std::set<std::string> plan_errors;  // why a run's mem GiB is "-"
  for (const std::string& m : a.models) {
    const fsdp::nn::ModelConfig& mc = a.configs.at(m);
    for (fsdp::DType d : a.dtypes) {
      for (int ck : a.checkpoint) {
        std::optional<fsdp::StepProfile> measured;
        if (!flops) {
          fsdp::BenchConfig c = ProjectionConfig(a, m, d, ck, threads);
          c.world_size = 1;
          c.secondary_shard_size = 0;  // one rank: nothing is sharded
          std::fprintf(stderr, "fsdp_bench: measuring %s on 1 rank for its compute profile\n",
                       m.c_str());
          absl::StatusOr<fsdp::BenchResult> r = fsdp::RunBench(c);
          if (!r.ok()) {
            std::fprintf(stderr, "fsdp_bench: %s\n", r.status().ToString().c_str());
            return 1;
          }
          absl::StatusOr<fsdp::StepProfile> p = fsdp::ProfileFromBench(*r, mc);
          if (!p.ok()) {
            std::fprintf(stderr, "fsdp_bench: %s\n", p.status().ToString().c_str());
            return 1;
          }
          const double k = a.compute_scale;
          for (auto* v : {&p->block_forward_s, &p->block_backward_s, &p->block_recompute_s}) {
            for (double& x : *v) x *= k;
          }
          for (double* x : {&p->before_blocks_s, &p->forward_gaps_s, &p->head_s,
                            &p->backward_gaps_s, &p->after_blocks_s, &p->optimizer_s,
                            &p->after_optimizer_s}) {
            *x *= k;
          }
          measured = *p;
        }
        for (double ie : a.inter_effs) {
        for (fsdp::ShardingStrategy st : a.strategies) {
          for (int pf : a.prefetch) {
            for (int w : a.worlds) {
              const int shard = ShardSize(st, w, a.hybrid_shard, a.ranks_per_host);
              fsdp::StepProfile profile;
              if (flops) {
                fsdp::DeviceSpec dev{a.cluster, a.peak_tflops * 1e12, a.achieved, a.hbm_gbps * 1e9};
                fsdp::FlopsWorkload wl;
                wl.batch_size = a.batch;
                wl.seq_len = a.seq;
                wl.param_dtype = d;
                wl.reduce_dtype = a.reduce_dtype == "same" ? d : FloatDTypeFlag("", a.reduce_dtype);
                wl.checkpoint_every = ck;
                absl::StatusOr<fsdp::StepProfile> p = fsdp::ProfileFromFlops(mc, dev, wl, shard);
                if (!p.ok()) {
                  std::fprintf(stderr, "fsdp_bench: %s\n", p.status().ToString().c_str());
                  return 1;
                }
                profile = *p;
              } else {
                profile = *measured;
                // The optimizer updates the rank's shard: 1/shard of the 1-rank run's.
                profile.optimizer_s /= shard;
              }
              fsdp::ProjectionRun run;
              run.strategy = st;
              run.world_size = w;
              run.hybrid_shard_size = shard;
              run.prefetch = pf;
              run.communication = a.communication;
              run.secondary_shard_size = a.secondary_shard.front();
              run.overlap_slowdown = a.overlap_slowdown;
              fsdp::LinkSpec l = link;
              l.inter_efficiency = ie;
              if (l.ranks_per_host > w) l.ranks_per_host = w;
              absl::StatusOr<fsdp::Projection> p = fsdp::ProjectStep(profile, l, run);
              if (!p.ok()) {
                std::fprintf(stderr, "fsdp_bench: %s\n", p.status().ToString().c_str());
                return 1;
              }
              Row row{m, std::string(fsdp::StrategyName(st)), d, ck, pf, w, shard, ie, *p,
                      profile.model_flops_per_rank, 0.0, std::string()};
              fsdp::PlanRequest req;
              req.model = m;
              req.config = mc;
              req.world_size = w;
              req.ranks_per_host = a.ranks_per_host > 0 && a.ranks_per_host <= w ? a.ranks_per_host : 0;
              req.strategy = st;
              req.hybrid_shard_size = shard;
              req.secondary_shard_size = run.secondary_shard_size;
              req.param_dtype = d;
              req.reduce_dtype = wl_reduce(a, d);
              req.checkpoint_every = ck;
              req.batch_size = a.batch;
              req.seq_len = a.seq;
              req.device_memory_bytes =
                  static_cast<int64_t>(a.device_mem_gib * static_cast<double>(int64_t{1} << 30));
              absl::StatusOr<fsdp::MemoryPlan> plan = fsdp::PlanMemory(req);
              row.mem = plan.ok() ? absl::StrFormat("%.1f%s", static_cast<double>(plan->peak_bytes) /
                                                                  (int64_t{1} << 30),
                                                    a.device_mem_gib > 0
                                                        ? (plan->fits ? " fits" : " NO")
                                                        : "")
                                  : std::string("-");
              if (!plan.ok()) plan_errors.insert(std::string(plan.status().message()));
              rows.push_back(row);
            }
          }
        }
        }
      }
    }
  }
  // Efficiency against the smallest world of the same configuration.
  for (Row& r : rows) {
    const Row* base = nullptr;
    for (const Row& o : rows) {
      if (o.model == r.model && o.strategy == r.strategy && o.dtype == r.dtype &&
          o.ckpt == r.ckpt && o.prefetch == r.prefetch && o.inter_eff == r.inter_eff &&
          (base == nullptr || o.world < base->world)) {
        base = &o;
      }
    }
    r.eff = base->p.step_s / r.p.step_s;
  }
  std::printf("%-11s %-13s %5s %4s %5s %3s %7s %9s %9s %9s %9s %12s %6s %6s %11s\n", "model",
              "strategy", "hosts", "N", "shard", "pf", "net eff", "step ms", "compute",
              "exposed", "comm busy", "tokens/s", "MFU%", "eff", "mem GiB");
  for (const Row& r : rows) {
    const int hosts = a.ranks_per_host > 0 ? std::max(1, r.world / a.ranks_per_host) : 1;
    const double mfu = flops ? r.flops_per_rank / r.p.step_s / (a.peak_tflops * 1e12) : 0;
    std::printf("%-11s %-13s %5d %4d %5d %3d %7g %9.1f %9.1f %9.1f %9.1f %12.0f %6.1f %6.3f %11s\n",
                r.model.c_str(), r.strategy.c_str(), hosts, r.world, r.shard, r.prefetch,
                r.inter_eff,
                r.p.step_s * 1e3, r.p.compute_s * 1e3, r.p.exposed_comm_s * 1e3,
                r.p.comm_busy_s * 1e3, r.p.tokens_per_s, 100 * mfu, r.eff, r.mem.c_str());
  }
  std::fflush(stdout);  // the notes after the table
  for (const std::string& e : plan_errors) {
    std::fprintf(stderr, "fsdp_bench: mem GiB is - where the memory plan says: %s\n", e.c_str());
  }
  if (!a.svg_dir.empty()) {
    std::vector<fsdp::BenchResult> pts;
    for (const Row& r : rows) {
      fsdp::BenchResult b;
      // The series' label: what varies (the title says the rest).
      b.model = a.models.size() > 1 ? r.model : "";
      if (a.inter_effs.size() > 1) {
        absl::StrAppend(&b.model, b.model.empty() ? "" : " ", "net x", r.inter_eff);
      }
      b.strategy = r.strategy;
      b.world_size = r.world;
      b.param_dtype = r.dtype;
      b.checkpoint_every = r.ckpt;
      b.prefetch = r.prefetch;
      b.tokens_per_s = r.p.tokens_per_s;
      b.scaling_efficiency = r.eff;
      pts.push_back(b);
    }
    const std::filesystem::path dir(a.svg_dir);
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    const bool ok =
        WriteFile((dir / "projected_efficiency.svg").string(),
                  fsdp::ScalingEfficiencySvg(
                      pts, absl::StrCat("Projected efficiency, ", absl::StrJoin(a.models, ", "),
                                        " on ", a.cluster, ", against the smallest world"),
                      a.published_world, a.published_eff),
                  fsdp::kSvgFile) &&
        WriteFile((dir / "projected_throughput.svg").string(), fsdp::ThroughputSvg(pts),
                  fsdp::kSvgFile);
    if (!ok) return 1;
  }
  return 0;
}

int RunValidation(const Args& a) {
  const int max_world = *std::max_element(a.worlds.begin(), a.worlds.end());
  const int threads = a.threads > 0 ? a.threads : std::max(1, fsdp::HardwareThreads() / max_world);
  const fsdp::DType d = a.dtypes.front();
  const int ck = a.checkpoint.front();
  int runs = 0;
  for (size_t i = 0; i < a.models.size(); ++i) {
    runs += static_cast<int>(a.worlds.size() *
                             (a.calibrate_each ? 2 * a.strategies.size() * a.validate_links.size() *
                                                     a.prefetch.size()
                                               : 1 + a.strategies.size() *
                                                         a.validate_links.size() *
                                                         a.prefetch.size()));
  }
  std::fprintf(stderr, "fsdp_bench: validating the projection: %d runs, %d thread(s) per rank, "
               "B=%d, %d warm-up + %d measured steps each\n", runs, threads, a.batch, a.warmup,
               a.steps);
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int done = 0;
  auto progress = [&](const std::string& what) {
    std::fprintf(stderr, "fsdp_bench: [%d/%d done] %s | %.0f s elapsed\n", done, runs,
                 what.c_str(), elapsed());
  };
  struct Row {
    fsdp::BenchResult m;
    fsdp::Projection p;    // from the calibration run's compute
    fsdp::Projection own;  // from this run's own compute spans
    double err = 0, own_err = 0;
    double cal_compute = 0, cal_sync = 0;  // the calibration's compute and waits
  };
  std::vector<Row> rows;
  std::vector<std::string> calibrations;
  for (const std::string& model : a.models) {
    const fsdp::nn::ModelConfig& mc = a.configs.at(model);
    for (int w : a.worlds) {
      absl::StatusOr<fsdp::StepProfile> profile =
          absl::FailedPreconditionError("no calibration run yet");
      if (!a.calibrate_each) {
      fsdp::BenchConfig cal = ProjectionConfig(a, model, d, ck, threads);
      cal.world_size = w;
      cal.strategy = fsdp::ShardingStrategy::kFullShard;
      cal.prefetch = 1;
      progress(absl::StrCat("calibrating ", model, " on ", w, " ranks, link off"));
      absl::StatusOr<fsdp::BenchResult> cr = fsdp::RunBench(cal);
      ++done;
      if (!cr.ok()) {
        std::fprintf(stderr, "fsdp_bench: calibration failed: %s\n", cr.status().ToString().c_str());
        return 1;
      }
      profile = fsdp::ProfileFromBench(*cr, mc);
      if (!profile.ok()) {
        std::fprintf(stderr, "fsdp_bench: %s\n", profile.status().ToString().c_str());
        return 1;
      }
      double blocks = 0;
      for (size_t i = 0; i < cr->block_forward_s.size(); ++i) {
        blocks += cr->block_forward_s[i] + cr->block_backward_s[i] + cr->block_recompute_s[i];
      }
      calibrations.push_back(absl::StrFormat(
          "%s %d ranks: step %.1f ms, blocks %.1f ms, other compute %.1f ms, optimizer %.1f ms, "
          "exposed %.1f ms (added to every prediction of %d ranks)", model, w, cr->step_median_s * 1e3, blocks * 1e3,
          (profile->compute_s() - blocks - profile->optimizer_s) * 1e3, cr->optimizer_s * 1e3,
          cr->exposed_comm_s * 1e3, w));
      }
      for (fsdp::ShardingStrategy st : a.strategies) {
        for (const auto& [intra, inter] : a.validate_links) {
          for (int pf : a.prefetch) {
            fsdp::BenchConfig c = ProjectionConfig(a, model, d, ck, threads);
            c.world_size = w;
            c.strategy = st;
            c.prefetch = pf;
            c.link.link_bytes_per_second = intra * 1e9;
            c.link.link_latency = absl::Microseconds(a.link_latency_us);
            c.link.ranks_per_host = a.ranks_per_host > w ? w : a.ranks_per_host;
            c.link.inter_host_bytes_per_second = inter * 1e9;
            c.link.inter_host_latency = absl::Microseconds(a.inter_latency_us);
            const int shard = a.hybrid_shard > 0 ? a.hybrid_shard : a.ranks_per_host;
            c.hybrid_shard_size = shard > 0 && w < shard ? w : a.hybrid_shard;
            if (a.calibrate_each) {
              // The same run with the link off, right before: the compute it predicts from is
              // measured as close in time as possible (a shared machine's speed drifts).
              fsdp::BenchConfig off = c;
              off.link.link_bytes_per_second = off.link.inter_host_bytes_per_second = 0;
              off.link.link_latency = off.link.inter_host_latency = absl::ZeroDuration();
              progress(absl::StrCat("calibrating ", RunName(off, w), ", link off"));
              absl::StatusOr<fsdp::BenchResult> cr = fsdp::RunBench(off);
              ++done;
              if (!cr.ok()) {
                std::fprintf(stderr, "fsdp_bench: calibration failed: %s\n",
                             cr.status().ToString().c_str());
                return 1;
              }
              absl::StatusOr<fsdp::StepProfile> each = fsdp::ProfileFromBench(*cr, mc);
              if (!each.ok()) {
                std::fprintf(stderr, "fsdp_bench: %s\n", each.status().ToString().c_str());
                return 1;
              }
              profile = *each;
            }
            progress(absl::StrCat("running ", RunName(c, w), " link ", intra, ":", inter,
                                  " GB/s"));
            absl::StatusOr<fsdp::BenchResult> r = fsdp::RunBench(c);
            ++done;
            if (!r.ok()) {
              std::fprintf(stderr, "fsdp_bench: %s failed: %s\n", RunName(c, w).c_str(),
                           r.status().ToString().c_str());
              return 1;
            }
            fsdp::ProjectionRun run;
            run.strategy = st;
            run.world_size = w;
            run.hybrid_shard_size = r->hybrid_shard_size;
            run.prefetch = c.prefetch;
            run.communication = c.communication;
            run.secondary_shard_size = c.secondary_shard_size;
            absl::StatusOr<fsdp::Projection> p =
                fsdp::ProjectStep(*profile, fsdp::SimulatedLink(c.link), run);
            absl::StatusOr<fsdp::StepProfile> own_profile = fsdp::ProfileFromBench(*r, mc);
            // The waits without a link come from the calibration run, never from this one.
            if (own_profile.ok()) own_profile->sync_s = profile->sync_s;
            absl::StatusOr<fsdp::Projection> own =
                own_profile.ok() ? fsdp::ProjectStep(*own_profile, fsdp::SimulatedLink(c.link), run)
                                 : absl::StatusOr<fsdp::Projection>(own_profile.status());
            for (const absl::Status& st : {p.status(), own.status()}) {
              if (!st.ok()) {
                std::fprintf(stderr, "fsdp_bench: %s\n", st.ToString().c_str());
                return 1;
              }
            }
            // The profile's times are means over the measured steps: compared with the mean step.
            const double m = r->step_mean_s;
            rows.push_back({*r, *p, *own, (p->step_s - m) / m, (own->step_s - m) / m,
                            profile->compute_s(), profile->sync_s});
          }
        }
      }
    }
  }
  std::fprintf(stderr, "fsdp_bench: [%d/%d done] in %.0f s\n", runs, runs, elapsed());
  std::printf("fsdp_bench --validate_projection: each run measured on the simulated link "
              "(link GB/s: inside:between hosts) and predicted from the link and compute times "
              "alone: (cal) the compute per block and around the blocks (cal cmp), and the "
              "waits (cal wait), of %s with the link off; (own) the compute spans of the run "
              "itself (compute) with (cal)'s waits. No communication time is taken from a "
              "measurement with the link.\n",
              a.calibrate_each ? "the same run measured right before it"
                               : "its world's calibration run (FULL_SHARD, prefetch)");
  for (const std::string& c : calibrations) std::printf("calibration: %s\n", c.c_str());
  std::printf("%-6s %-13s %2s %5s %2s %10s | %8s %8s %8s %9s %7s | %8s %9s %7s | %8s %9s %9s\n",
              "model", "strategy", "N", "shard", "pf", "link GB/s", "mean ms", "cal cmp",
              "cal wait", "pred cal", "error", "compute", "pred own", "error", "exposed",
              "pred cal", "pred own");
  std::vector<double> errs, own_errs;
  for (const Row& r : rows) {
    const std::string linktext = absl::StrFormat("%g:%g", r.m.link_gbps, r.m.inter_gbps);
    std::printf("%-6s %-13s %2d %5d %2d %10s | %8.1f %8.1f %8.1f %9.1f %+6.1f%% | %8.1f %9.1f "
                "%+6.1f%% | %8.1f %9.1f %9.1f\n",
                r.m.model.c_str(), r.m.strategy.c_str(), r.m.world_size, r.m.hybrid_shard_size,
                r.m.prefetch, linktext.c_str(), r.m.step_mean_s * 1e3,
                r.cal_compute * 1e3, r.cal_sync * 1e3, r.p.step_s * 1e3, 100 * r.err, r.own.compute_s * 1e3, r.own.step_s * 1e3,
                100 * r.own_err, r.m.exposed_comm_s * 1e3, r.p.exposed_comm_s * 1e3,
                r.own.exposed_comm_s * 1e3);
    errs.push_back(std::fabs(r.err));
    own_errs.push_back(std::fabs(r.own_err));
  }
  auto summary = [](std::vector<double> e, const char* what) {
    std::sort(e.begin(), e.end());
    const double median = e.empty() ? 0
                          : e.size() % 2 ? e[e.size() / 2]
                                         : (e[e.size() / 2 - 1] + e[e.size() / 2]) / 2;
    std::printf("step time error, %s, over %zu runs: median |error| %.1f%%, worst %.1f%% "
                "(target: median <= 10%%, worst <= 20%%)\n",
                what, e.size(), 100 * median, e.empty() ? 0.0 : 100 * e.back());
  };
  summary(errs, "compute from the calibration runs (cal)");
  summary(own_errs, "compute from each run's own compute spans (own)");
  return 0;
}

}  // namespace fsdp_bench
