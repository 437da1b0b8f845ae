// Shared by the sharding tests (threads and mpirun): train a bundled model (GPT or Llama) with a strategy on N
// ranks, and the single-rank reference that trains on the concatenated batches.
#pragma once

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/backend.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/communicator.h"
#include "fsdp/nn/data.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/optim.h"
#include "gtest/gtest.h"
#include "tests/test_backend.h"

namespace fsdp::testing {

struct TrainSpec {
  std::string config = "nano";  // any ModelConfig name, e.g. "llama-nano"
  int batch_size = 2;  // per rank and micro-batch
  int seq_len = 32;
  int steps = 20;
  int micro_batches = 1;  // > 1: accumulate as `accumulation` says
  Accumulation accumulation = Accumulation::kNoSync;
  float lr = 1e-3f;
  float max_grad_norm = 0.5f;
  std::vector<std::string> frozen;
  nn::WrapPolicy wrap;
  int checkpoint_every = 0;
  int64_t memory_limit_bytes = 0;  // the backend's device memory (0: unlimited)
};

struct TrainResult {
  std::vector<float> losses;                // mean over ranks, per step
  std::vector<double> grad_norms;           // global gradient norm before clipping, per step
  std::vector<std::vector<float>> first_grads;  // model units' gradients of the first step
  std::vector<std::vector<float>> params;   // model units after the last step
  int clipped_steps = 0;                    // steps whose clip coefficient was < 1
  int skipped_steps = 0;                    // steps skipped for inf/NaN (loss scaling)
  std::vector<int64_t> host_syncs;          // StepStats::host_syncs, per step
  std::vector<int64_t> throttle_waits;      // StepStats::throttle_waits, per step
  MemoryReport memory;
  MemoryStats backend_memory;  // the backend's own count, at the same moment as `memory`
  int num_units = 0;
  std::vector<int64_t> unit_shard_numel;  // per unit, elements per rank
  // Issued on this rank's shard group over every step, as its communicator counts them (a host
  // backend's data plane; a device's planes run their own collectives: then -1).
  int64_t shard_all_gathers = 0;
  std::vector<int> offloaded_units;  // ShardingOptions::offload
  OffloadStats offload;
};

// The runtime's memory report must be the backend's allocations: nothing allocated outside
// the report's categories, nothing counted twice, at the same moment and at peak. (The model
// and the runtime share the backend; the model's part is its activation report.)
inline void ExpectReportIsBackend(const MemoryReport& r, const MemoryStats& b,
                                  const std::string& where) {
  EXPECT_EQ(r.bytes_in_use(), b.bytes_in_use)
      << where << ": the runtime reports " << r.bytes_in_use() << " bytes in use, the backend "
      << "holds " << b.bytes_in_use << " (" << FormatMemoryReport(r) << ")";
  EXPECT_EQ(r.peak_bytes, b.peak_bytes)
      << where << ": the runtime's peak is " << r.peak_bytes << " bytes, the backend's "
      << b.peak_bytes;
}

inline const nn::TokenDataset& TestCorpus() {
  static const nn::TokenDataset* data =
      new nn::TokenDataset(nn::TokenDataset::FromText(nn::EmbeddedCorpus()));
  return *data;
}

// Rows of micro-batch j of step s for data-parallel rank r of n: DataLoader step s*k + j.
inline nn::Batch RankBatch(const TrainSpec& spec, int rank, int world, int64_t step, int micro) {
  nn::DataLoaderOptions o;
  o.batch_size = spec.batch_size;
  o.seq_len = spec.seq_len;
  o.rank = rank;
  o.world_size = world;
  o.seed = 7;
  auto loader = nn::DataLoader::Create(&TestCorpus(), o);
  return loader->At(step * spec.micro_batches + micro);
}

// Trains on `comm`'s ranks. `threads_per_rank` OpenMP threads for the kernels.
inline absl::StatusOr<TrainResult> TrainSharded(Communicator& comm, const TrainSpec& spec,
                                                ShardingOptions sharding, int threads_per_rank,
                                                const std::string& backend_name =
                                                    TestBackendName()) {
  FSDP_ASSIGN_OR_RETURN(nn::ModelConfig config, nn::ModelConfig::FromName(spec.config));
  FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(threads_per_rank, spec.memory_limit_bytes,
                                                      backend_name));
  nn::ShardedModelOptions o;
  sharding.max_grad_norm = spec.max_grad_norm;
  o.sharding = sharding;
  o.batch_size = spec.batch_size;
  o.seq_len = spec.seq_len;
  o.frozen = spec.frozen;
  o.wrap = spec.wrap;
  o.checkpoint_every = spec.checkpoint_every;
  FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(config, backend.get(), comm, o));
  TrainResult result;
  for (int s = 0; s < spec.steps; ++s) {
    double loss_sum = 0;
    for (int j = 0; j < spec.micro_batches; ++j) {
      ConfigureMicroBatch(model->runtime(), spec.accumulation, j, spec.micro_batches);
      nn::Batch b = RankBatch(spec, comm.rank(), comm.size(), s, j);
      FSDP_ASSIGN_OR_RETURN(float loss, model->ForwardBackward(b.inputs.data(), b.targets.data()));
      loss_sum += loss;
    }
    FSDP_ASSIGN_OR_RETURN(float mean,
                          model->MeanOverRanks(static_cast<float>(loss_sum / spec.micro_batches)));
    result.losses.push_back(mean);
    if (s == 0) {
      FSDP_ASSIGN_OR_RETURN(result.first_grads, model->GatherModelGradients());
    }
    FSDP_ASSIGN_OR_RETURN(StepStats st, model->Step(spec.lr));
    result.grad_norms.push_back(st.grad_norm);
    result.host_syncs.push_back(st.host_syncs);
    result.throttle_waits.push_back(st.throttle_waits);
    if (st.clip_coefficient < 1.0f) ++result.clipped_steps;
    if (st.skipped) ++result.skipped_steps;
  }
  FSDP_ASSIGN_OR_RETURN(result.params, model->GatherModelUnits());
  result.memory = model->memory();
  result.backend_memory = backend->memory_stats();
  result.num_units = model->runtime().num_units();
  for (int u = 0; u < result.num_units; ++u) {
    result.unit_shard_numel.push_back(model->runtime().unit_shard_numel(u));
  }
  result.offloaded_units = model->runtime().offloaded_units();
  result.offload = model->runtime().offload_stats();
  result.shard_all_gathers =
      backend->is_host() ? model->runtime().shard_group().issued(CollectiveKind::kAllGather) : -1;
  return result;
}

// The reference, independent of the sharding runtime: one rank whose batch is the
// concatenation of every rank's micro-batches, trained with the model's plain Forward /
// Backward over whole units, per-unit AdamW and global-norm clipping.
inline absl::StatusOr<TrainResult> TrainReference(const TrainSpec& spec, int world, int threads) {
  const int B = spec.batch_size * world * spec.micro_batches;
  FSDP_ASSIGN_OR_RETURN(nn::ModelConfig config, nn::ModelConfig::FromName(spec.config));
  FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = threads}));
  backend->BindCurrentThread();
  FSDP_ASSIGN_OR_RETURN(auto model, config.CreateModel(backend.get(), B, spec.seq_len));
  const int U = model->num_units();
  // The reference runs on the CPU backend, whose buffers the host reads and writes directly.
  std::vector<Buffer> params(U), grads(U);
  std::vector<std::unique_ptr<AdamW>> opts;
  for (int u = 0; u < U; ++u) {
    const size_t bytes = static_cast<size_t>(model->unit_numel(u)) * sizeof(float);
    FSDP_ASSIGN_OR_RETURN(params[u], Buffer::Create(backend.get(), bytes));
    FSDP_ASSIGN_OR_RETURN(grads[u], Buffer::Create(backend.get(), bytes));
    for (const nn::ParamSpec* p : model->unit_params(u)) {
      config.InitParamSlice(*p, 1337, 0, p->numel, params[u].as<float>() + p->offset);
    }
    std::vector<DecayRange> ranges;
    for (const nn::ParamSpec* p : model->unit_params(u)) {
      bool frozen = false;
      for (const std::string& f : spec.frozen) frozen |= f == p->name;
      if (!frozen) ranges.push_back({p->offset, p->offset + p->numel, p->weight_decay});
    }
    FSDP_ASSIGN_OR_RETURN(auto opt, AdamW::Create(backend.get(), model->unit_numel(u), ranges));
    opts.push_back(std::move(opt));
  }
  FSDP_ASSIGN_OR_RETURN(Buffer in, Buffer::Create(backend.get(), sizeof(int32_t) * B * spec.seq_len));
  FSDP_ASSIGN_OR_RETURN(Buffer tg, Buffer::Create(backend.get(), sizeof(int32_t) * B * spec.seq_len));
  TrainResult result;
  const int rows = spec.batch_size * spec.seq_len;
  auto unit = [&](std::vector<Buffer>& v, int u) { return v[u].as<float>(); };
  auto numel = [&](int u) { return model->unit_numel(u); };
  for (int s = 0; s < spec.steps; ++s) {
    int32_t* pin = in.as<int32_t>();
    int32_t* ptg = tg.as<int32_t>();
    for (int j = 0; j < spec.micro_batches; ++j) {
      for (int r = 0; r < world; ++r) {
        nn::Batch b = RankBatch(spec, r, world, s, j);
        pin = std::copy_n(b.inputs.begin(), rows, pin);
        ptg = std::copy_n(b.targets.begin(), rows, ptg);
      }
    }
    std::vector<View> pu, gu;
    for (int u = 0; u < U; ++u) {
      std::fill_n(unit(grads, u), numel(u), 0.0f);
      pu.push_back(params[u].view());
      gu.push_back(grads[u].view());
    }
    FSDP_ASSIGN_OR_RETURN(float loss,
                          model->Forward(pu, in.view(DType::kI32), tg.view(DType::kI32)));
    FSDP_RETURN_IF_ERROR(model->Backward(pu, gu));
    result.losses.push_back(loss);
    for (const std::string& f : spec.frozen) {
      for (const nn::ParamSpec& p : model->params()) {
        if (p.name == f) std::fill_n(unit(grads, p.unit) + p.offset, p.numel, 0.0f);
      }
    }
    double sq = 0;
    for (int u = 0; u < U; ++u) {
      for (int64_t i = 0; i < numel(u); ++i) sq += double(unit(grads, u)[i]) * unit(grads, u)[i];
    }
    result.grad_norms.push_back(std::sqrt(sq));
    if (s == 0) {
      for (int u = 0; u < U; ++u) {
        result.first_grads.emplace_back(unit(grads, u), unit(grads, u) + numel(u));
      }
    }
    const float coef = ClipCoefficient(std::sqrt(sq), spec.max_grad_norm);
    if (coef < 1.0f) ++result.clipped_steps;
    for (int u = 0; u < U; ++u) {
      if (coef != 1.0f) {
        for (int64_t i = 0; i < numel(u); ++i) unit(grads, u)[i] *= coef;
      }
      opts[u]->set_lr(spec.lr);
      FSDP_RETURN_IF_ERROR(opts[u]->Step(params[u].view(), grads[u].view()));
    }
  }
  for (int u = 0; u < U; ++u) result.params.emplace_back(unit(params, u), unit(params, u) + numel(u));
  return result;
}

// ||a - b|| / ||b|| over a whole unit: the relative error of the parameters as a vector.
inline double NormRelDiff(const std::vector<float>& a, const std::vector<float>& b);

// How the strategy parity tests clip: off, on the steps whose gradient norm is above the
// median of the unclipped run's (some clipped, some not), or on every step.
enum class Clip { kOff, kSome, kAlways };
inline const char* ClipName(Clip c) {
  return c == Clip::kOff ? "noclip" : c == Clip::kSome ? "clipsome" : "clipall";
}

// max_grad_norm for `clip`, given the unclipped reference run's gradient norms.
inline float ClipThreshold(Clip clip, std::vector<double> unclipped_norms) {
  if (clip == Clip::kOff) return 0.0f;
  if (clip == Clip::kAlways) return 0.5f;
  if (unclipped_norms.empty()) return 0.0f;
  std::nth_element(unclipped_norms.begin(), unclipped_norms.begin() + unclipped_norms.size() / 2,
                   unclipped_norms.end());
  return static_cast<float>(unclipped_norms[unclipped_norms.size() / 2]);
}

// Strategy parity: `got` (one rank's view of a sharded run) against the single-rank reference
// on the concatenated batch. AdamW and clipping remove a uniform scale from the gradients, so
// parameters and losses alone cannot see a sum where a mean belongs: the pre-clip gradient
// norm of every step and the reduced gradient of every unit at the first step are compared
// too. Losses and norms relative to each value; gradients and parameters as ||got - ref|| /
// ||ref|| per unit (elementwise, Adam turns rounding-level differences of near-zero gradients
// into larger relative ones). The reference runs the CPU kernels; on pjrt, XLA's programs sum
// in their own order, and 20 AdamW steps make that a little over 1e-5 of the parameters
// (1.06e-5 for FULL_SHARD on one rank without clipping), so the default tolerance there is
// 1e-4 (a sum where a mean belongs is off by far more).
inline double DefaultParityTolerance() {
  return TestBackendName() == "pjrt" || TestBackendName() == "cuda" ? 1e-4 : 1e-5;
}
inline void ExpectMatchesReference(const TrainResult& got, const TrainResult& ref, Clip clip,
                                   const std::string& where,
                                   double tol = DefaultParityTolerance()) {
  const int steps = static_cast<int>(ref.losses.size());
  switch (clip) {
    case Clip::kOff: ASSERT_EQ(ref.clipped_steps, 0) << where; break;
    case Clip::kSome:
      ASSERT_GT(ref.clipped_steps, 0) << where << ": max_grad_norm too large, clipping never ran";
      ASSERT_LT(ref.clipped_steps, steps) << where << ": max_grad_norm too small, every step "
                                          << "clipped";
      break;
    case Clip::kAlways: ASSERT_EQ(ref.clipped_steps, steps) << where; break;
  }
  EXPECT_EQ(got.clipped_steps, ref.clipped_steps) << where;
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << where;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * ref.losses[i]) << where << " step " << i;
  }
  ASSERT_EQ(got.grad_norms.size(), ref.grad_norms.size()) << where;
  for (size_t i = 0; i < ref.grad_norms.size(); ++i) {
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], tol * ref.grad_norms[i])
        << where << " step " << i << ": the pre-clip gradient norm";
  }
  ASSERT_EQ(got.first_grads.size(), ref.first_grads.size()) << where;
  for (size_t u = 0; u < ref.first_grads.size(); ++u) {
    EXPECT_LT(NormRelDiff(got.first_grads[u], ref.first_grads[u]), tol)
        << where << " unit " << u << ": the reduced gradient of the first step";
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << where;
  for (size_t u = 0; u < ref.params.size(); ++u) {
    EXPECT_LT(NormRelDiff(got.params[u], ref.params[u]), tol) << where << " unit " << u;
  }
  ExpectReportIsBackend(got.memory, got.backend_memory, where);
}

// Trains `base` sharded on `world` (one rank per process, under mpirun) and on one rank, for each
// clipping mode (the threshold from the unclipped run's norms), and expects parity.
inline void ExpectParityOnWorld(Communicator& world, const ShardingOptions& sharding, TrainSpec base,
                                std::initializer_list<Clip> clips) {
  for (Clip clip : clips) {
    TrainSpec spec = base;
    spec.max_grad_norm = 0;
    auto unclipped = TrainReference(spec, world.size(), 1);
    ASSERT_TRUE(unclipped.ok()) << unclipped.status();
    spec.max_grad_norm = ClipThreshold(clip, unclipped->grad_norms);
    auto ref = TrainReference(spec, world.size(), 1);
    ASSERT_TRUE(ref.ok()) << ref.status();
    auto got = TrainSharded(world, spec, sharding, 1);
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectMatchesReference(*got, *ref, clip, std::string("rank ") + std::to_string(world.rank()) +
                                                 " " + ClipName(clip));
  }
}

// Largest |a - b| / (|b| + floor) over all elements; floor keeps near-zero values from
// dominating (parameters here are ~0.02 to 1).
inline double MaxRelDiff(const std::vector<float>& a, const std::vector<float>& b,
                         double floor = 1e-2) {
  double worst = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    worst = std::max(worst, std::fabs(double(a[i]) - b[i]) / (std::fabs(double(b[i])) + floor));
  }
  return a.size() == b.size() ? worst : INFINITY;
}

// ||a - b|| / ||b|| over a whole unit: the relative error of the parameters as a vector.
inline double NormRelDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace fsdp::testing
