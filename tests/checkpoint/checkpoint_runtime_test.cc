// Checkpoints of a model written directly on the runtime's hooks (not the GPT), ranks as
// threads: two units with a frozen tensor and odd sizes (so shards cut tensors and carry
// padding), dynamic loss scaling with a skipped step. Exact resume restores the loss scaler
// too; a load on other world sizes and strategies reproduces the saved parameters bitwise.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "fsdp/checkpoint.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/local_world.h"

namespace fsdp {
namespace {

ShardingOptions Options(ShardingStrategy strategy, int hybrid = 0) {
  ShardingOptions o;
  o.strategy = strategy;
  o.hybrid_shard_size = hybrid;
  o.mixed_precision.dynamic_loss_scale = true;
  o.mixed_precision.initial_loss_scale = 1024.0f;
  o.mixed_precision.growth_interval = 2;
  return o;
}

absl::StatusOr<std::unique_ptr<ShardingRuntime>> MakeRuntime(Backend* backend, Communicator& comm,
                                                             const ShardingOptions& options,
                                                             float init_offset) {
  FSDP_ASSIGN_OR_RETURN(auto rt, ShardingRuntime::Create(backend, comm, options));
  FSDP_RETURN_IF_ERROR(rt->RegisterUnit("a", {{"a.w", {5, 3}}, {"a.b", {5}}}).status());
  FSDP_RETURN_IF_ERROR(
      rt->RegisterUnit("b", {{"b.w", {7, 2}}, {"b.frozen", {3}, false}, {"b.b", {7}}}).status());
  FSDP_RETURN_IF_ERROR(rt->Finalize([&](int, const ParamInfo& p, int64_t b, int64_t e, float* out) {
    for (int64_t i = b; i < e; ++i) {
      out[i - b] =
          init_offset + 0.01f * static_cast<float>(i) + 0.1f * static_cast<float>(p.name.size());
    }
  }));
  return rt;
}

// One step of a made-up model: gradient = loss_scale * sin(3 p + step) (the same on every
// rank, so any world size trains the same way); at step 3 one rank sees an inf (skipped).
absl::Status FakeStep(ShardingRuntime& rt, int step) {
  for (int u = 0; u < rt.num_units(); ++u) {
    FSDP_RETURN_IF_ERROR(rt.PreForward(u).status());
    FSDP_RETURN_IF_ERROR(rt.PostForward(u));
  }
  for (int u = rt.num_units() - 1; u >= 0; --u) {
    FSDP_ASSIGN_OR_RETURN(UnitView v, rt.PreBackward(u));
    for (int64_t i = 0; i < v.numel; ++i) {
      v.grads[i] += rt.loss_scale() * std::sin(3.0f * v.params[i] + static_cast<float>(step));
    }
    if (step == 3 && rt.world().rank() == rt.world().size() - 1) v.grads[0] = INFINITY;
    FSDP_RETURN_IF_ERROR(rt.PostBackward(u));
  }
  FSDP_RETURN_IF_ERROR(rt.FinishBackward());
  return rt.Step(0.05f).status();
}

struct Snapshot {
  std::vector<std::vector<float>> units;
  ShardingRuntime::LossScaleState loss_scale;
  int64_t steps = 0, optimizer_step = 0;
};

absl::StatusOr<Snapshot> Take(ShardingRuntime& rt) {
  Snapshot s;
  for (int u = 0; u < rt.num_units(); ++u) {
    s.units.emplace_back(rt.unit_numel(u));
    FSDP_RETURN_IF_ERROR(rt.GatherUnit(u, s.units.back().data()));
  }
  s.loss_scale = rt.loss_scale_state();
  s.steps = rt.steps();
  s.optimizer_step = rt.optimizer(0).step();
  return s;
}

void ExpectSame(const Snapshot& a, const Snapshot& b, const std::string& what) {
  ASSERT_EQ(a.units.size(), b.units.size()) << what;
  for (size_t u = 0; u < a.units.size(); ++u) {
    EXPECT_EQ(std::memcmp(a.units[u].data(), b.units[u].data(), a.units[u].size() * 4), 0)
        << what << " unit " << u;
  }
  EXPECT_EQ(a.loss_scale.scale, b.loss_scale.scale) << what;
  EXPECT_EQ(a.loss_scale.good_steps, b.loss_scale.good_steps) << what;
  EXPECT_EQ(a.loss_scale.skipped_steps, b.loss_scale.skipped_steps) << what;
  EXPECT_EQ(a.steps, b.steps) << what;
  EXPECT_EQ(a.optimizer_step, b.optimizer_step) << what;
}

// Runs `steps` fake steps on `world` ranks, after loading `load` and before saving `save`
// (either may be empty). Returns rank 0's snapshot after the load and at the end.
absl::StatusOr<std::pair<Snapshot, Snapshot>> RunRanks(int world, const ShardingOptions& options,
                                                       int first_step, int steps,
                                                       const std::string& load,
                                                       const std::string& save) {
  std::vector<std::pair<Snapshot, Snapshot>> out(world);
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto rt, MakeRuntime(backend.get(), comm, options, load.empty() ? 0 : 5));
    if (!load.empty()) FSDP_RETURN_IF_ERROR(LoadCheckpoint(*rt, load).status());
    FSDP_ASSIGN_OR_RETURN(out[comm.rank()].first, Take(*rt));
    for (int s = 0; s < steps; ++s) FSDP_RETURN_IF_ERROR(FakeStep(*rt, first_step + s));
    if (!save.empty()) FSDP_RETURN_IF_ERROR(SaveCheckpoint(*rt, save));
    FSDP_ASSIGN_OR_RETURN(out[comm.rank()].second, Take(*rt));
    return absl::OkStatus();
  }));
  return out[0];
}

TEST(CheckpointRuntimeTest, ExactResumeIncludingTheLossScaler) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "/fsdp_ckpt_rt_", getpid());
  std::filesystem::remove_all(dir);
  const ShardingOptions o = Options(ShardingStrategy::kFullShard);
  auto full = RunRanks(2, o, 0, 9, "", "");
  ASSERT_TRUE(full.ok()) << full.status();
  EXPECT_EQ(full->second.loss_scale.skipped_steps, 1);
  EXPECT_EQ(full->second.optimizer_step, 8);
  auto first = RunRanks(2, o, 0, 5, "", dir + "/five");
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = RunRanks(2, o, 5, 4, dir + "/five", "");
  ASSERT_TRUE(second.ok()) << second.status();
  ExpectSame(second->first, first->second, "right after the load");
  ExpectSame(second->second, full->second, "after resuming");

  // Other world sizes and strategies load the same parameters and state, bitwise.
  struct Layout {
    int world;
    ShardingOptions options;
  };
  for (const Layout& l : {Layout{1, Options(ShardingStrategy::kNoShard)},
                          Layout{3, Options(ShardingStrategy::kFullShard)},
                          Layout{4, Options(ShardingStrategy::kHybridShardGradOp, 2)},
                          Layout{5, Options(ShardingStrategy::kShardGradOp)}}) {
    auto loaded = RunRanks(l.world, l.options, 5, 4, dir + "/five", "");
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    ExpectSame(loaded->first, first->second, absl::StrCat("loaded on ", l.world));
    // The fake gradient is the same on every rank, so training continues identically, bitwise
    // where averaging over ranks is exact (powers of two).
    if ((l.world & (l.world - 1)) == 0) {
      ExpectSame(loaded->second, full->second, absl::StrCat("resumed on ", l.world));
    } else {
      for (size_t u = 0; u < full->second.units.size(); ++u) {
        for (size_t i = 0; i < full->second.units[u].size(); ++i) {
          const float want = full->second.units[u][i];
          EXPECT_NEAR(loaded->second.units[u][i], want, 1e-5 * (std::fabs(want) + 1e-2))
              << "resumed on " << l.world << " unit " << u << " element " << i;
        }
      }
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace fsdp
