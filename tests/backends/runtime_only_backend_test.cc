// A runtime-only backend (tests/backends/minimal_backend.h: host memory, synchronous streams,
// the host data plane and the eight runtime ops, no model ops) trains a framework's own model
// through the hooks: FULL_SHARD, SHARD_GRAD_OP and HYBRID_SHARD match the one-rank reference
// and the CPU backend's run bitwise. It registers by name beside the built-in backends, and the
// bundled models refuse it at creation with an error that says why.
#include <gtest/gtest.h>

#include "fsdp/local_world.h"
#include "fsdp/nn/gpt.h"
#include "fsdp/registry.h"
#include "tests/backends/minimal_backend.h"
#include "tests/fsdp/uneven_model.h"

namespace fsdp::testing::uneven {
namespace {

CommOptions Deadline() {
  CommOptions o;
  o.timeout = absl::Seconds(20);
  return o;
}

TEST(RuntimeOnlyBackendTest, HasTheRuntimeOpsAndNoLayers) {
  MinimalBackend b;
  EXPECT_EQ(b.model_ops(), nullptr);
  nn::GptConfig config = *nn::GptConfig::FromName("nano");
  const absl::Status s = nn::Gpt::Create(config, &b, 2, 8).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("runtime-only"), std::string::npos) << s;
  EXPECT_NE(s.message().find("hooks"), std::string::npos) << s;
}

TEST(RuntimeOnlyBackendTest, RegistersByName) {
  BackendRegistration r;
  r.name = "minimal";
  r.summary = "host memory, synchronous streams, the runtime's ops only";
  r.create = [](const BackendOptions&, int) -> absl::StatusOr<std::unique_ptr<Backend>> {
    return std::unique_ptr<Backend>(std::make_unique<MinimalBackend>());
  };
  ASSERT_TRUE(RegisterBackend(r).ok());
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend("minimal");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->name(), "minimal");
  EXPECT_EQ((*b)->description(), "minimal backend");
}

struct Case {
  ShardingStrategy strategy;
  int world;
  int hybrid_shard = 0;
};

// The same model trained on both backends, every rank's results kept.
std::vector<Result> Train(const Model& m, const Spec& spec, const Case& c, bool minimal) {
  std::vector<Result> results(c.world);
  const ShardingOptions options = Options(c.strategy, c.hybrid_shard, spec);
  const absl::Status s = LocalWorld::Run(c.world, Deadline(), [&](Communicator& comm) {
    std::function<absl::StatusOr<std::unique_ptr<Backend>>()> make;
    if (minimal) {
      make = []() -> absl::StatusOr<std::unique_ptr<Backend>> {
        return std::unique_ptr<Backend>(std::make_unique<MinimalBackend>());
      };
    }
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], TrainSharded(comm, m, spec, options, make));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
  return results;
}

TEST(RuntimeOnlyBackendTest, TrainsAFrameworksOwnModelThroughTheHooks) {
  const Model m = Mlp(16, 15, 8);
  const Reference ref = MakeReference(m);
  ASSERT_GT(ref.result.clipped_steps, 0);
  using S = ShardingStrategy;
  for (const Case& c : {Case{S::kFullShard, 3}, Case{S::kShardGradOp, 2},
                        Case{S::kHybridShard, 4, 2}}) {
    const std::string where = absl::StrCat(std::string(StrategyName(c.strategy)), " on ",
                                           c.world, " ranks");
    const std::vector<Result> got = Train(m, ref.spec, c, /*minimal=*/true);
    const std::vector<Result> cpu = Train(m, ref.spec, c, /*minimal=*/false);
    ASSERT_EQ(got.size(), cpu.size());
    for (int r = 0; r < c.world; ++r) {
      ExpectParity(got[r], ref.result, where);
      // The same kernels in the same order as the CPU backend: bitwise its results.
      EXPECT_EQ(got[r].losses, cpu[r].losses) << where;
      EXPECT_EQ(got[r].grad_norms, cpu[r].grad_norms) << where;
      EXPECT_EQ(got[r].params, cpu[r].params) << where;
      // The runtime's report counts what this backend allocated.
      ExpectReportIsBackend(got[r].memory, got[r].backend_memory, where);
    }
  }
}

}  // namespace
}  // namespace fsdp::testing::uneven
