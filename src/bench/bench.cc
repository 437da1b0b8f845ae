// RunBench: training steps of a bundled model under one sharding configuration, measured from
// the wall clock and the timeline (fsdp/bench.h, docs/scaling.md).
#include "fsdp/bench.h"

#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/plan.h"
#include "fsdp/trace.h"

namespace fsdp {
namespace {

// The tracer is process-wide: the first rank to start enables it, the last to finish restores
// it (off and cleared, unless it was on before).
class TracerUse {
 public:
  TracerUse() {
    std::lock_guard<std::mutex> lock(mu());
    State& s = state();
    if (s.users++ == 0) {
      s.was_enabled = Tracer::Global().enabled();
      Tracer::Global().Enable();
    }
  }
  ~TracerUse() {
    std::lock_guard<std::mutex> lock(mu());
    State& s = state();
    if (--s.users == 0 && !s.was_enabled) {
      Tracer::Global().Disable();
      Tracer::Global().Clear();
    }
  }
  TracerUse(const TracerUse&) = delete;
  TracerUse& operator=(const TracerUse&) = delete;

 private:
  struct State {
    int users = 0;
    bool was_enabled = false;
  };
  static std::mutex& mu() {
    static std::mutex m;
    return m;
  }
  static State& state() {
    static State s;
    return s;
  }
};

bool IsHybrid(ShardingStrategy s) {
  return s == ShardingStrategy::kHybridShard || s == ShardingStrategy::kHybridShardGradOp;
}

int ResolveShardSize(const BenchConfig& c, int world) {
  if (!IsHybrid(c.strategy)) return c.strategy == ShardingStrategy::kNoShard ? 1 : world;
  if (c.hybrid_shard_size > 0) return c.hybrid_shard_size;
  const int rph = c.link.ranks_per_host;
  if (rph > 0 && rph <= world && world % rph == 0) return rph;
  return world;
}

absl::StatusOr<nn::ModelConfig> ResolveModel(const BenchConfig& c) {
  if (c.config.has_value()) return *c.config;
  return nn::ModelConfig::FromName(c.model);
}

absl::Status Check(const BenchConfig& c, const nn::ModelConfig& mc, int world) {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("RunBench: ", parts...));
  };
  if (world < 1) return bad("world_size=", world, ": allowed: 1 or more ranks");
  if (c.batch_size < 1) return bad("batch_size=", c.batch_size, ": allowed: 1 or more");
  if (c.seq_len < 0 || c.seq_len > mc.block_size()) {
    return bad("seq_len=", c.seq_len, ": allowed: 1 to the block size of ", mc.name(), ", ",
               mc.block_size(), " (0: the block size)");
  }
  if (c.steps < 1) return bad("steps=", c.steps, ": allowed: 1 or more measured steps");
  if (c.warmup_steps < 0) return bad("warmup_steps=", c.warmup_steps, ": allowed: 0 or more");
  if (c.threads_per_rank < 0) return bad("threads_per_rank=", c.threads_per_rank);
  if (c.checkpoint_every < 0) return bad("checkpoint_every=", c.checkpoint_every);
  if (c.prefetch < 0) {
    return bad("prefetch=", c.prefetch, ": allowed: 0 (none) or the units gathered ahead");
  }
  if (IsHybrid(c.strategy)) {
    const int s = ResolveShardSize(c, world);
    if (s < 1 || world % s != 0) {
      return bad("hybrid_shard_size=", s, ": ", std::string(StrategyName(c.strategy)),
                 " needs the ranks per shard group: a divisor of the ", world, " ranks");
    }
  }
  return absl::OkStatus();
}

double Percentile(std::vector<double> v, double p) {  // linear interpolation, p in [0, 1]
  std::sort(v.begin(), v.end());
  const double pos = p * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (pos - static_cast<double>(lo)) * (v[hi] - v[lo]);
}

// The memory report's fields, in the order a rank's figures pack them (each rank's report is
// merged by its largest value).
constexpr int64_t MemoryReport::*kMemoryFields[] = {
    &MemoryReport::param_shard_bytes,       &MemoryReport::grad_shard_bytes,
    &MemoryReport::optimizer_bytes,         &MemoryReport::gathered_param_bytes,
    &MemoryReport::gathered_param_peak_bytes, &MemoryReport::grad_buffer_bytes,
    &MemoryReport::grad_buffer_peak_bytes,  &MemoryReport::activation_peak_bytes,
    &MemoryReport::secondary_param_bytes,   &MemoryReport::secondary_param_peak_bytes,
    &MemoryReport::peak_bytes};

// What one rank measured, packed as doubles so that one all_gather moves it.
struct RankFigures {
  // Per measured step.
  std::vector<double> step, compute, exposed, optimizer, comm_bytes, bus_bytes, collectives,
      comm_time;
  // Scalars.
  MemoryReport memory;
  double host_syncs = 0;  // total over measured steps
  double threads = 0;
  double loss = 0;
  // Summed over measured steps: per block forward, backward, recompute (3 L), then the six
  // places around the blocks (BenchResult::before_blocks_s ... after_optimizer_s) and the
  // exposed communication in the six phases of a step (exposed_start_s ... exposed_optimizer_s).
  std::vector<double> profile;

  static constexpr int kPerStep = 8;
  // The memory report's fields, then syncs, threads and loss.
  static constexpr int kScalars = static_cast<int>(std::size(kMemoryFields)) + 3;
  static constexpr int kPlaces = 12;
  static int ProfileSize(int blocks) { return 3 * blocks + kPlaces; }
  static int Size(int steps, int blocks) {
    return kPerStep * steps + kScalars + ProfileSize(blocks);
  }

  std::vector<double> Pack() const {
    std::vector<double> out;
    for (const auto* v : {&step, &compute, &exposed, &optimizer, &comm_bytes, &bus_bytes,
                          &collectives, &comm_time}) {
      out.insert(out.end(), v->begin(), v->end());
    }
    for (int64_t MemoryReport::*field : kMemoryFields) {
      out.push_back(static_cast<double>(memory.*field));
    }
    out.push_back(host_syncs);
    out.push_back(threads);
    out.push_back(loss);
    out.insert(out.end(), profile.begin(), profile.end());
    return out;
  }
  static RankFigures Unpack(const double* p, int steps, int blocks) {
    RankFigures f;
    for (auto* v : {&f.step, &f.compute, &f.exposed, &f.optimizer, &f.comm_bytes, &f.bus_bytes,
                    &f.collectives, &f.comm_time}) {
      v->assign(p, p + steps);
      p += steps;
    }
    for (int64_t MemoryReport::*field : kMemoryFields) {
      f.memory.*field = static_cast<int64_t>(std::llround(*p++));
    }
    f.host_syncs = *p++;
    f.threads = *p++;
    f.loss = *p++;
    f.profile.assign(p, p + ProfileSize(blocks));
    return f;
  }
};

// Adds one step's compute by place (RankFigures::profile) from the block spans of the step
// [b, e) (`blocks`, on the compute lane) and the rank's spans (`mine`, for the waits).
void AddProfile(const std::vector<Span>& mine, std::vector<Span> blocks, int rank, int64_t b,
                int64_t e, std::vector<double>& profile) {
  const double ns = 1e-9;
  const int L = (static_cast<int>(profile.size()) - RankFigures::kPlaces) / 3;
  std::sort(blocks.begin(), blocks.end(),
            [](const Span& x, const Span& y) { return x.begin_ns < y.begin_ns; });
  // The busy time of [x, y): its length less the waits inside it.
  auto busy = [&](int64_t x, int64_t y) {
    if (y <= x) return 0.0;
    return static_cast<double>(y - x - ExposedNs(mine, rank, kWaitStream, x, y)) * ns;
  };
  int64_t opt_b = e, opt_e = e;
  for (const Span& s : mine) {
    if (s.stream == kComputeStream && s.name == "optimizer step" && s.begin_ns >= b &&
        s.begin_ns < e) {
      opt_b = s.begin_ns;
      opt_e = s.end_ns;
    }
  }
  double* places = profile.data() + 3 * L;
  int64_t cursor = b;  // the end of the previous span
  bool in_backward = false;
  for (const Span& s : blocks) {
    const TraceArg* block = s.FindArg("block");
    const int i = block != nullptr && block->is_num ? static_cast<int>(block->num) : -1;
    if (i < 0 || i >= L) continue;
    const bool forward = s.name == "forward" && !in_backward;
    const double gap = busy(cursor, s.begin_ns);
    if (cursor == b) {
      places[0] += gap;  // before the first block
    } else if (forward) {
      places[1] += gap;
    } else if (!in_backward) {
      places[2] += gap;  // the head: the last forward to the first backward or recompute
    } else {
      places[3] += gap;
    }
    if (!forward) in_backward = true;
    const int col = forward ? 0 : s.name == "backward" ? 1 : 2;
    profile[col * L + i] += static_cast<double>(s.duration_ns()) * ns;
    cursor = s.end_ns;
  }
  places[4] += busy(cursor, opt_b);
  places[5] += busy(opt_e, e);
  // The waits by phase: [b, e) cut at the first block, the end of the last forward block, the
  // first backward (or recompute) block, the end of the last block and the optimizer's start.
  int64_t cuts[5] = {b, b, b, b, b};
  if (!blocks.empty()) {
    cuts[0] = blocks.front().begin_ns;
    cuts[1] = cuts[2] = cuts[0];
    for (const Span& s : blocks) {
      if (s.name != "forward") {
        cuts[2] = s.begin_ns;
        break;
      }
      cuts[1] = cuts[2] = s.end_ns;
    }
    cuts[3] = std::max(cuts[2], blocks.back().end_ns);
  }
  cuts[4] = std::max(cuts[3], std::min(opt_b, e));
  int64_t from = b;
  for (int k = 0; k < 6; ++k) {
    const int64_t to = k < 5 ? std::max(from, cuts[k]) : e;
    places[6 + k] += static_cast<double>(ExposedNs(mine, rank, kWaitStream, from, to)) * ns;
    from = to;
  }
}

// The timeline of one measured step [b, e) of `rank`, from its spans (`mine`).
void SplitStep(const std::vector<Span>& mine, int rank, int64_t b, int64_t e, RankFigures& f) {
  const double ns = 1e-9;
  std::vector<Span> blocks;
  double optimizer = 0, comm = 0, bus = 0, count = 0, comm_time = 0;
  for (const Span& s : mine) {
    if (s.begin_ns < b || s.begin_ns >= e) continue;
    if (s.stream == kComputeStream) {
      if (s.name == "optimizer step") {
        // The optimizer's own time: its span less the collectives it waited for inside it.
        optimizer += static_cast<double>(
            s.duration_ns() - ExposedNs(mine, rank, kWaitStream, s.begin_ns, s.end_ns));
      } else if (s.name == "forward" || s.name == "backward" || s.name == "recompute") {
        blocks.push_back(s);
      }
    } else if (s.stream == kCommStream) {
      const TraceArg* bytes = s.FindArg("bytes");
      const TraceArg* ranks = s.FindArg("ranks");
      const double size = bytes != nullptr && bytes->is_num ? static_cast<double>(bytes->num) : 0;
      const double n = ranks != nullptr && ranks->is_num ? static_cast<double>(ranks->num) : 1;
      comm += size;
      count += 1;
      // The collective's own time: its span less the time it waited for its peers to arrive.
      const TraceArg* peer_wait = s.FindArg("peer_wait_ns");
      const double waited =
          peer_wait != nullptr && peer_wait->is_num ? static_cast<double>(peer_wait->num) : 0;
      comm_time += std::max(0.0, static_cast<double>(s.duration_ns()) - waited);
      if (n > 1) {
        if (s.name == "all_gather" || s.name == "reduce_scatter" || s.name == "all_to_all") {
          bus += size * (n - 1) / n;
        } else if (s.name == "all_reduce") {
          bus += 2 * size * (n - 1) / n;
        } else if (s.name == "broadcast") {
          bus += size;
        }
      }
    }
  }
  f.compute.push_back(static_cast<double>(UnionNs(blocks, rank, kComputeStream, b, e)) * ns);
  AddProfile(mine, blocks, rank, b, e, f.profile);
  f.exposed.push_back(static_cast<double>(ExposedNs(mine, rank, kWaitStream, b, e)) * ns);
  f.optimizer.push_back(optimizer * ns);
  f.comm_bytes.push_back(comm);
  f.bus_bytes.push_back(bus);
  f.collectives.push_back(count);
  f.comm_time.push_back(comm_time * ns);
}

// Ranks of this process's host under mpirun (Open MPI's local size), else 1.
int RanksOnThisHost() {
  if (const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"); local != nullptr) {
    return std::max(1, std::atoi(local));
  }
  return 1;
}

struct Prepared {
  nn::ModelConfig model;
  int seq_len = 0;
  GemmPeak peak;
};

// max_cores: the cores the ranks share (ranks as threads of this process), 0 when unknown.
absl::StatusOr<BenchResult> RunRank(const BenchConfig& c, const Prepared& prep,
                                    Communicator& world, int ranks_sharing_cores, int max_cores,
                                    const BenchBackendFactory& make_backend) {
  TracerUse tracer_use;
  Tracer& tracer = Tracer::Global();
  SetTraceRank(world.rank());
  const nn::ModelConfig& mc = prep.model;
  const int B = c.batch_size, T = prep.seq_len, W = world.size(), rank = world.rank();
  const int shard = ResolveShardSize(c, W);
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, make_backend(rank));
  if (backend == nullptr) return absl::InvalidArgumentError("RunBench: the factory gave no backend");
  nn::ShardedModelOptions o;
  o.sharding.strategy = c.strategy;
  o.sharding.hybrid_shard_size = IsHybrid(c.strategy) ? shard : 0;
  o.sharding.forward_prefetch = o.sharding.backward_prefetch = c.prefetch > 0;
  o.sharding.max_prefetch_units = std::max(1, c.prefetch);
  o.sharding.max_grad_norm = c.max_grad_norm;
  o.sharding.mixed_precision.param_dtype = c.param_dtype;
  o.sharding.mixed_precision.reduce_dtype = c.reduce_dtype;
  o.sharding.communication = c.communication;
  o.sharding.secondary_shard_size = c.secondary_shard_size;
  o.batch_size = B;
  o.seq_len = T;
  o.checkpoint_every = c.checkpoint_every;
  FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(mc, backend.get(), world, o));

  // Synthetic token ids, different per rank and step (the figures do not depend on the data).
  const size_t n = static_cast<size_t>(B) * T;
  std::vector<int32_t> inputs(n), targets(n);
  const int V = mc.vocab_size();
  RankFigures f;
  f.profile.assign(RankFigures::ProfileSize(mc.num_layers()), 0.0);
  std::vector<std::pair<int64_t, int64_t>> windows;
  float loss = 0;
  for (int step = 0; step < c.warmup_steps + c.steps; ++step) {
    for (size_t i = 0; i < n; ++i) {
      const uint64_t x = i * 7919u + static_cast<uint64_t>(rank) * 104729u +
                         static_cast<uint64_t>(step) * 1299709u;
      inputs[i] = static_cast<int32_t>(x % static_cast<uint64_t>(V));
      targets[i] = static_cast<int32_t>((x + 1) % static_cast<uint64_t>(V));
    }
    const bool measured = step >= c.warmup_steps;
    if (step == c.warmup_steps) model->runtime().ResetPeaks();
    FSDP_RETURN_IF_ERROR(world.Barrier());  // every step starts on all ranks together
    const int64_t b = tracer.NowNs();
    FSDP_ASSIGN_OR_RETURN(loss, model->ForwardBackward(inputs.data(), targets.data()));
    FSDP_ASSIGN_OR_RETURN(StepStats stats, model->Step(1e-4f));
    const int64_t e = tracer.NowNs();
    if (!measured) continue;
    windows.emplace_back(b, e);
    f.step.push_back(static_cast<double>(e - b) * 1e-9);
    f.host_syncs += static_cast<double>(stats.host_syncs);
  }
  // Every collective of the measured steps has completed and been recorded by now: the
  // progress thread records a span before it runs the next collective.
  FSDP_RETURN_IF_ERROR(world.Barrier());
  f.memory = model->memory();
  // The threads the rank computes with: the CPU backend's own; otherwise as the registry's sim
  // resolves "threads" (threads_per_rank, or the cores divided among the ranks of the host).
  const auto* cpu = dynamic_cast<const CpuBackend*>(backend.get());
  f.threads = cpu != nullptr ? cpu->num_threads()
                             : ThreadsPerRank(c.threads_per_rank, ranks_sharing_cores);
  f.loss = loss;
  {
    std::vector<Span> mine;
    for (Span& s : tracer.Snapshot()) {
      if (s.rank == rank) mine.push_back(std::move(s));
    }
    for (const auto& [b, e] : windows) SplitStep(mine, rank, b, e, f);
  }

  // Every rank's figures to every rank.
  const std::vector<double> packed = f.Pack();
  const int L = mc.num_layers();
  const int size = RankFigures::Size(c.steps, L);
  if (packed.size() != static_cast<size_t>(size)) {  // Pack and Size must agree
    return absl::InternalError(absl::StrCat("RunBench: ", packed.size(), " figures packed, ",
                                            size, " expected"));
  }
  std::vector<double> all(static_cast<size_t>(size) * W);
  FSDP_RETURN_IF_ERROR(world.AllGather(packed.data(), all.data(), size, DType::kF64));
  // The tracer may be restored once every rank has read its spans.
  FSDP_RETURN_IF_ERROR(world.Barrier());
  std::vector<RankFigures> ranks;
  for (int r = 0; r < W; ++r) ranks.push_back(RankFigures::Unpack(all.data() + r * size, c.steps, L));

  BenchResult out;
  out.model = mc.name();
  out.strategy = std::string(StrategyName(c.strategy));
  out.world_size = W;
  out.hybrid_shard_size = shard;
  out.batch_size = B;
  out.seq_len = T;
  out.param_dtype = c.param_dtype;
  out.reduce_dtype = c.reduce_dtype;
  out.all_gather = c.communication.all_gather;
  out.reduction = c.communication.reduction;
  out.quant_block = c.communication.quantizes() ? c.communication.block_size : 0;
  out.secondary_shard_size = c.secondary_shard_size;
  out.checkpoint_every = c.checkpoint_every;
  out.prefetch = c.prefetch;
  out.warmup_steps = c.warmup_steps;
  out.steps = c.steps;
  const CommOptions& link = world.options();
  out.link_gbps = link.link_bytes_per_second / 1e9;
  out.link_latency_us = absl::ToDoubleMicroseconds(link.link_latency);
  out.ranks_per_host = link.ranks_per_host;
  out.inter_gbps = link.inter_host_bytes_per_second / 1e9;
  out.inter_latency_us = absl::ToDoubleMicroseconds(link.inter_host_latency);
  out.num_parameters = mc.num_parameters();

  double threads = 0;
  for (const RankFigures& r : ranks) threads = std::max(threads, r.threads);
  out.threads_per_rank = static_cast<int>(threads);
  out.step_times_s.resize(c.steps);
  double sum_step = 0, sum_compute = 0, sum_exposed = 0, sum_opt = 0, sum_comm = 0, sum_bus = 0,
         sum_coll = 0, sum_syncs = 0, sum_comm_time = 0;
  for (int s = 0; s < c.steps; ++s) {
    double slowest = 0;
    for (const RankFigures& r : ranks) {
      slowest = std::max(slowest, r.step[s]);
      sum_step += r.step[s];
      sum_compute += r.compute[s];
      sum_exposed += r.exposed[s];
      sum_opt += r.optimizer[s];
      sum_comm += r.comm_bytes[s];
      sum_bus += r.bus_bytes[s];
      sum_coll += r.collectives[s];
      sum_comm_time += r.comm_time[s];
    }
    out.step_times_s[s] = slowest;
  }
  for (const RankFigures& r : ranks) sum_syncs += r.host_syncs;
  const double samples = static_cast<double>(c.steps) * W;
  out.step_median_s = Percentile(out.step_times_s, 0.5);
  out.step_p10_s = Percentile(out.step_times_s, 0.1);
  out.step_p90_s = Percentile(out.step_times_s, 0.9);
  out.step_min_s = *std::min_element(out.step_times_s.begin(), out.step_times_s.end());
  out.step_max_s = *std::max_element(out.step_times_s.begin(), out.step_times_s.end());
  out.tokens_per_step = static_cast<int64_t>(B) * T * W;
  out.tokens_per_s = static_cast<double>(out.tokens_per_step) / out.step_median_s;
  out.model_flops_per_step = mc.flops_per_step(out.tokens_per_step, T);
  out.achieved_tflops = out.model_flops_per_step / out.step_median_s / 1e12;
  out.peak_gflops_per_core = prep.peak.gflops_per_core;
  out.peak_kind = prep.peak.kind;
  out.cores_used = W * out.threads_per_rank;
  if (max_cores > 0) out.cores_used = std::min(out.cores_used, max_cores);
  out.mfu = out.peak_gflops_per_core > 0
                ? out.achieved_tflops * 1e3 / (out.peak_gflops_per_core * out.cores_used)
                : 0;
  out.step_mean_s = sum_step / samples;
  out.compute_s = sum_compute / samples;
  out.exposed_comm_s = sum_exposed / samples;
  out.optimizer_s = sum_opt / samples;
  out.other_s = out.step_mean_s - out.compute_s - out.exposed_comm_s - out.optimizer_s;
  out.exposed_comm_fraction = out.exposed_comm_s / out.step_mean_s;
  out.comm_bytes_per_rank = sum_comm / samples;
  out.bus_bytes_per_rank = sum_bus / samples;
  out.collectives_per_step = std::llround(sum_coll / samples);
  out.comm_s = sum_comm_time / samples;
  for (const RankFigures& r : ranks) {
    for (int64_t MemoryReport::*field : kMemoryFields) {
      out.memory.*field = std::max(out.memory.*field, r.memory.*field);
    }
  }
  out.host_syncs_per_step = sum_syncs / samples;
  std::vector<double> profile(RankFigures::ProfileSize(L), 0.0);
  for (const RankFigures& r : ranks) {
    for (size_t k = 0; k < profile.size(); ++k) profile[k] += r.profile[k] / samples;
  }
  out.block_forward_s.assign(profile.begin(), profile.begin() + L);
  out.block_backward_s.assign(profile.begin() + L, profile.begin() + 2 * L);
  out.block_recompute_s.assign(profile.begin() + 2 * L, profile.begin() + 3 * L);
  const double* places = profile.data() + 3 * L;
  double* const fields[RankFigures::kPlaces] = {
      &out.before_blocks_s,    &out.forward_gaps_s,    &out.head_s,
      &out.backward_gaps_s,    &out.after_blocks_s,    &out.after_optimizer_s,
      &out.exposed_start_s,    &out.exposed_forward_s, &out.exposed_head_s,
      &out.exposed_backward_s, &out.exposed_tail_s,    &out.exposed_optimizer_s};
  for (int k = 0; k < RankFigures::kPlaces; ++k) *fields[k] = places[k];
  out.final_loss = static_cast<float>(ranks[0].loss);
  out.scaling_efficiency = std::numeric_limits<double>::quiet_NaN();
  out.baseline_tokens_per_s = std::numeric_limits<double>::quiet_NaN();
  return out;
}

// A run that cannot fit in this host's memory fails before anything is allocated (instead of
// paging the host to a crawl): the memory planner's peak per rank (fsdp/plan.h) times the
// ranks on this host, against the host's physical memory.
absl::Status CheckHostMemory(const BenchConfig& c, const nn::ModelConfig& mc, int world,
                             int seq_len, int ranks_here) {
  PlanRequest r;
  r.model = mc.name();
  r.config = mc;
  r.world_size = world;
  r.strategy = c.strategy;
  r.hybrid_shard_size = ResolveShardSize(c, world);
  r.param_dtype = c.param_dtype;
  r.reduce_dtype = c.reduce_dtype;
  r.communication = c.communication;
  r.secondary_shard_size = c.secondary_shard_size;
  r.checkpoint_every = c.checkpoint_every;
  r.batch_size = c.batch_size;
  r.seq_len = seq_len;
  r.forward_prefetch = r.backward_prefetch = c.prefetch > 0;
  r.max_prefetch_units = std::max(1, c.prefetch);
  const absl::StatusOr<MemoryPlan> plan = PlanMemory(r);
  if (!plan.ok()) return absl::OkStatus();  // the run itself says what is wrong
  return CheckPlanFits(*plan, 0, ranks_here, /*device_is_host=*/true);
}

absl::StatusOr<Prepared> Prepare(const BenchConfig& c, int world, int ranks_here) {
  Prepared p;
  FSDP_ASSIGN_OR_RETURN(p.model, ResolveModel(c));
  FSDP_RETURN_IF_ERROR(Check(c, p.model, world));
  p.seq_len = c.seq_len > 0 ? c.seq_len : p.model.block_size();
  FSDP_RETURN_IF_ERROR(CheckHostMemory(c, p.model, world, p.seq_len, ranks_here));
  return p;
}

}  // namespace

GemmPeak PeakGflopsPerCore(DType compute_dtype, int repeats) {
  GemmPeak p;
  // The peak of the GEMM the Linear layers run (kernels::cpu::lowp_gemm_choice).
  if (compute_dtype != DType::kF32 && kernels::cpu::matmul_lowp_native(compute_dtype)) {
    p.gflops_per_core = kernels::cpu::measure_gemm_gflops(2048, 1, repeats, compute_dtype);
    p.kind = absl::StrCat(std::string(DTypeName(compute_dtype)), " GEMM");
    return p;
  }
  p.gflops_per_core = kernels::cpu::measure_sgemm_gflops(2048, 1, repeats);
  p.kind = compute_dtype == DType::kF32
               ? "f32 GEMM"
               : absl::StrCat("f32 GEMM (", std::string(DTypeName(compute_dtype)),
                              " GEMMs widened: ",
                              kernels::cpu::lowp_gemm_choice(compute_dtype).reason, ")");
  return p;
}

BenchBackendFactory RegistryBenchBackend(const BenchConfig& config, int ranks_sharing_cores) {
  BackendOptions options = config.backend_options;
  if (config.backend == "cpu" || config.backend == "sim") {
    options.emplace("threads", absl::StrCat(config.threads_per_rank));
    options.emplace("ranks_sharing_cores", absl::StrCat(std::max(1, ranks_sharing_cores)));
  }
  return [name = config.backend, options](int rank) { return CreateBackend(name, options, rank); };
}

absl::StatusOr<BenchResult> RunBench(const BenchConfig& config) {
  return RunBench(config, RegistryBenchBackend(config, config.world_size));
}

absl::StatusOr<BenchResult> RunBench(const BenchConfig& config, Communicator& world) {
  return RunBench(config, world, RegistryBenchBackend(config, RanksOnThisHost()));
}

absl::StatusOr<BenchResult> RunBench(const BenchConfig& config,
                                     const BenchBackendFactory& make_backend) {
  FSDP_ASSIGN_OR_RETURN(Prepared prep, Prepare(config, config.world_size, config.world_size));
  if (config.peak_gflops_per_core > 0) {
    prep.peak = {config.peak_gflops_per_core, config.peak_kind};
  } else {
    prep.peak = PeakGflopsPerCore(config.param_dtype);
  }
  std::vector<BenchResult> results(config.world_size);
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(
      config.world_size, config.link, [&](Communicator& world) -> absl::Status {
        FSDP_ASSIGN_OR_RETURN(results[world.rank()],
                              RunRank(config, prep, world, config.world_size,
                                      HardwareThreads(), make_backend));
        return absl::OkStatus();
      }));
  return std::move(results[0]);
}

absl::StatusOr<BenchResult> RunBench(const BenchConfig& config, Communicator& world,
                                     const BenchBackendFactory& make_backend) {
  const int sharing = RanksOnThisHost();
  FSDP_ASSIGN_OR_RETURN(Prepared prep, Prepare(config, world.size(), sharing));
  // The peak: rank 0 measures it alone, while the others wait, and tells them.
  double peak[2] = {config.peak_gflops_per_core, 0};
  std::string kind = config.peak_kind;
  if (config.peak_gflops_per_core <= 0) {
    if (world.rank() == 0) {
      const GemmPeak p = PeakGflopsPerCore(config.param_dtype);
      peak[0] = p.gflops_per_core;
      peak[1] = p.kind.rfind("f32 GEMM", 0) == 0 ? 0 : 1;
    }
    FSDP_RETURN_IF_ERROR(world.Broadcast(peak, 2, DType::kF64, 0));
    kind = peak[1] == 0 ? (config.param_dtype == DType::kF32
                               ? std::string("f32 GEMM")
                               : absl::StrCat("f32 GEMM (no native ",
                                              std::string(DTypeName(config.param_dtype)), " GEMM)"))
                        : absl::StrCat(std::string(DTypeName(config.param_dtype)), " GEMM");
  }
  prep.peak = {peak[0], kind};
  return RunRank(config, prep, world, sharing, 0, make_backend);
}

void SetScalingEfficiency(std::vector<BenchResult>& results) {
  auto same = [](const BenchResult& a, const BenchResult& b) {
    return a.model == b.model && a.batch_size == b.batch_size && a.seq_len == b.seq_len &&
           a.param_dtype == b.param_dtype && a.reduce_dtype == b.reduce_dtype &&
           a.all_gather == b.all_gather && a.reduction == b.reduction &&
           a.quant_block == b.quant_block && a.secondary_shard_size == b.secondary_shard_size &&
           a.checkpoint_every == b.checkpoint_every && a.prefetch == b.prefetch &&
           a.threads_per_rank == b.threads_per_rank && a.pass == b.pass;
  };
  for (BenchResult& r : results) {
    const BenchResult* base = nullptr;
    for (const BenchResult& o : results) {
      if (o.world_size != 1 || !same(r, o)) continue;
      if (o.strategy == r.strategy) {
        base = &o;
        break;
      }
      if (base == nullptr) base = &o;
    }
    if (base == nullptr) {
      r.scaling_efficiency = std::numeric_limits<double>::quiet_NaN();
      r.baseline_tokens_per_s = std::numeric_limits<double>::quiet_NaN();
      continue;
    }
    r.baseline_tokens_per_s = base->tokens_per_s;
    r.scaling_efficiency = r.tokens_per_s / (r.world_size * base->tokens_per_s);
  }
}

}  // namespace fsdp
