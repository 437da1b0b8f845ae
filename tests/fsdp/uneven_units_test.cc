// Uneven and degenerate units, ranks as threads: a framework's own MLPs of awkward shapes and a
// model of degenerate units (1 element, 3 elements on up to 8 ranks, every parameter frozen,
// biases only; tests/fsdp/uneven_model.h) trained through the hooks with every strategy on 1 to
// 8 ranks, against one rank on the concatenated batch; checkpoints saved on one world size and
// loaded on another; the safetensors export; the layout math of a unit past 2^31 bytes (never
// allocated); and configurations that cannot work failing at once, before any gather.
//
// Every multi-rank case runs with a 20 s communicator deadline, so a hang is a failure.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <climits>
#include <filesystem>
#include <map>
#include <mutex>

#include "fsdp/local_world.h"
#include "src/checkpoint/shard_plan.h"
#include "src/fsdp/flat_layout.h"
#include "tests/fsdp/uneven_model.h"

namespace fsdp::testing::uneven {
namespace {

constexpr absl::Duration kDeadline = absl::Seconds(20);
// An error that every rank can see without waiting for a peer comes well before the deadline.
constexpr double kQuickSeconds = 5.0;

CommOptions Deadline() {
  CommOptions o;
  o.timeout = kDeadline;
  return o;
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The reference of a model (MakeReference), computed once.
const Reference& ReferenceOf(const std::string& model) {
  static std::mutex mu;
  static std::map<std::string, Reference> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(model);
  if (it == cache.end()) it = cache.emplace(model, MakeReference(ModelByName(model))).first;
  return it->second;
}

// ---- parity ------------------------------------------------------------------------------------

struct Case {
  std::string model;
  ShardingStrategy strategy;
  int world;
  int hybrid_shard = 0;
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  std::string s =
      absl::StrCat(info.param.model, "_", std::string(StrategyName(info.param.strategy)), "_N",
                   info.param.world);
  if (info.param.hybrid_shard) absl::StrAppend(&s, "_S", info.param.hybrid_shard);
  return s;
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.model << " " << StrategyName(c.strategy) << " on " << c.world << " ranks";
  if (c.hybrid_shard) *os << " (shard groups of " << c.hybrid_shard << ")";
}

class UnevenParityTest : public ::testing::TestWithParam<Case> {};

TEST_P(UnevenParityTest, MatchesOneRankOnTheConcatenatedBatch) {
  const Case& c = GetParam();
  const Reference& ref = ReferenceOf(c.model);
  ASSERT_GT(ref.result.clipped_steps, 0);
  ASSERT_LT(ref.result.clipped_steps, ref.spec.steps);
  // The parity is over real training, not a constant.
  ASSERT_LT(ref.result.losses.back(), 0.9 * ref.result.losses.front());
  const Model m = ModelByName(c.model);
  const ShardingOptions options = Options(c.strategy, c.hybrid_shard, ref.spec);
  std::vector<Result> results(c.world);
  const absl::Status s = LocalWorld::Run(c.world, Deadline(), [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], TrainSharded(comm, m, ref.spec, options));
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (int r = 0; r < c.world; ++r) {
    const std::string where = "rank " + std::to_string(r);
    ExpectParity(results[r], ref.result, where);
    ExpectReportIsBackend(results[r].memory, results[r].backend_memory, where);
  }
}

// Every model on every world size from 1 to 8 with FULL_SHARD, SHARD_GRAD_OP and NO_SHARD (one
// rank: FULL_SHARD only, the others are the same run), HYBRID_SHARD with every shard group size
// that properly divides the world (4 = 2 x 2, 6 = 3 x 2 and 2 x 3, 8 = 4 x 2 and 2 x 4), and
// HYBRID_SHARD_GRAD_OP on the degenerate units: 110 cases, about 4 s in Release.
std::vector<Case> ParityCases() {
  using S = ShardingStrategy;
  std::vector<Case> cases;
  for (const Model& m : AllModels()) {
    cases.push_back({m.name, S::kFullShard, 1});
    for (int n = 2; n <= 8; ++n) {
      for (S s : {S::kFullShard, S::kShardGradOp, S::kNoShard}) cases.push_back({m.name, s, n});
      for (int shard = 2; shard < n; ++shard) {
        if (n % shard == 0) cases.push_back({m.name, S::kHybridShard, n, shard});
      }
    }
  }
  const std::string degenerate = Degenerate(7, 15, 3).name;
  cases.push_back({degenerate, S::kHybridShardGradOp, 6, 3});
  cases.push_back({degenerate, S::kHybridShardGradOp, 8, 4});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Grid, UnevenParityTest, ::testing::ValuesIn(ParityCases()), CaseName);

// ---- checkpoints across world sizes, and the export --------------------------------------------

struct ChainCase {
  std::string model;
  std::vector<Leg> legs;  // trained one after the other, each resuming from the last checkpoint
};

void PrintTo(const ChainCase& c, std::ostream* os) {
  *os << c.model;
  for (const Leg& l : c.legs) *os << " -> " << StrategyName(l.strategy) << " on " << l.world;
}

std::string ChainName(const ::testing::TestParamInfo<ChainCase>& info) {
  std::string s = info.param.model;
  for (const Leg& l : info.param.legs) {
    absl::StrAppend(&s, "_", std::string(StrategyName(l.strategy)), "_N", l.world);
    if (l.hybrid_shard) absl::StrAppend(&s, "_S", l.hybrid_shard);
  }
  return s;
}

std::string MakeTempDir() {
  std::string tmpl = ::testing::TempDir() + "/uneven_units_XXXXXX";
  return mkdtemp(tmpl.data()) != nullptr ? tmpl : std::string();
}

class UnevenCheckpointTest : public ::testing::TestWithParam<ChainCase> {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir();
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_;
};

// Each leg loads the previous leg's checkpoint on another world size (and strategy), trains its
// steps and saves; the steps of all legs together must be the reference's steps, and the last
// leg's export must hold exactly its parameters.
TEST_P(UnevenCheckpointTest, ResumesOnAnotherWorldSizeAndExports) {
  const ChainCase& c = GetParam();
  const Reference& ref = ReferenceOf(c.model);
  const Model m = ModelByName(c.model);
  Result chained;  // rank 0's view of every leg
  int step = 0;
  std::string previous;
  const std::string exported = dir_ + "/model.safetensors";
  for (size_t i = 0; i < c.legs.size(); ++i) {
    const Leg& leg = c.legs[i];
    const std::string ckpt = dir_ + "/leg" + std::to_string(i);
    const bool last = i + 1 == c.legs.size();
    std::vector<Result> results(leg.world);
    std::vector<LoadedCheckpoint> loaded(leg.world);
    const absl::Status s = LocalWorld::Run(leg.world, Deadline(), [&](Communicator& comm) {
      return RunLeg(comm, m, ref.spec, leg, step, previous, last ? "" : ckpt,
                    last ? exported : "", results[comm.rank()], &loaded[comm.rank()]);
    });
    ASSERT_TRUE(s.ok()) << "leg " << i << ": " << s;
    for (int r = 0; r < leg.world && i > 0; ++r) {
      EXPECT_EQ(loaded[r].step, step) << "leg " << i << " rank " << r;
      EXPECT_EQ(loaded[r].saved_world_size, c.legs[i - 1].world) << "leg " << i;
    }
    for (int r = 1; r < leg.world; ++r) {
      EXPECT_EQ(results[r].params, results[0].params) << "leg " << i << " rank " << r;
    }
    const Result& got = results[0];
    chained.losses.insert(chained.losses.end(), got.losses.begin(), got.losses.end());
    chained.grad_norms.insert(chained.grad_norms.end(), got.grad_norms.begin(),
                              got.grad_norms.end());
    chained.clipped_steps += got.clipped_steps;
    if (i == 0) chained.first_grads = got.first_grads;
    chained.params = got.params;
    step += leg.steps;
    previous = ckpt;
  }
  ASSERT_EQ(step, ref.spec.steps);
  ExpectParity(chained, ref.result, "chained");
  ExpectExportHolds(exported, m, chained.params, ref.result.params);
}

std::vector<ChainCase> ChainCases() {
  using S = ShardingStrategy;
  return {
      {Degenerate(7, 15, 3).name,
       {{8, S::kFullShard, 0, 3}, {3, S::kShardGradOp, 0, 1}, {5, S::kFullShard, 0, 2}}},
      {Mlp(16, 17, 8).name,
       {{8, S::kHybridShard, 4, 2}, {3, S::kFullShard, 0, 2}, {5, S::kNoShard, 0, 2}}},
  };
}

INSTANTIATE_TEST_SUITE_P(Worlds, UnevenCheckpointTest, ::testing::ValuesIn(ChainCases()),
                         ChainName);

// ---- a unit past 2^31 bytes: the layout math alone ---------------------------------------------

// The pieces of every shard of `l` tile each tensor exactly once, in rank order, at the right
// places of the padded buffer, and agree with the checkpoints' count of data elements.
void ExpectLayoutTiles(const internal::FlatLayout& l, const std::string& where) {
  const int S = l.shard_size;
  ASSERT_EQ(l.shard_numel * S, l.padded_numel) << where;
  ASSERT_GE(l.padded_numel, l.numel) << where;
  ASSERT_LT(l.padded_numel - l.numel, S) << where;
  std::vector<int64_t> next(l.tensors.size(), 0);  // the next element of each tensor expected
  int64_t data = 0;
  for (int k = 0; k < S; ++k) {
    EXPECT_EQ(l.shard_begin(k), static_cast<int64_t>(k) * l.shard_numel) << where;
    int64_t here = 0, trainable = 0;
    for (const internal::ShardPiece& p : l.Pieces(k)) {
      const internal::FlatTensor& t = l.tensors[p.tensor];
      const int64_t len = p.tensor_end - p.tensor_begin;
      ASSERT_GT(len, 0) << where << " shard " << k;
      ASSERT_EQ(p.tensor_begin, next[p.tensor]) << where << " shard " << k << " " << t.name;
      ASSERT_LE(p.tensor_end, t.numel) << where << " shard " << k << " " << t.name;
      ASSERT_GE(p.shard_offset, 0) << where << " shard " << k;
      ASSERT_LE(p.shard_offset + len, l.shard_numel) << where << " shard " << k;
      ASSERT_EQ(l.shard_begin(k) + p.shard_offset, t.offset + p.tensor_begin)
          << where << " shard " << k << " " << t.name;
      next[p.tensor] = p.tensor_end;
      here += len;
      if (t.requires_grad) trainable += len;
    }
    EXPECT_EQ(here, checkpoint::ShardDataNumel(l.numel, l.shard_numel, k)) << where << " " << k;
    int64_t ranged = 0;
    for (const DecayRange& r : l.ShardDecayRanges(k)) {
      ASSERT_GE(r.begin, 0) << where;
      ASSERT_LE(r.end, l.shard_numel) << where;
      ranged += r.end - r.begin;
    }
    EXPECT_EQ(ranged, trainable) << where << " shard " << k;
    data += here;
  }
  EXPECT_EQ(data, l.numel) << where;
  for (size_t i = 0; i < l.tensors.size(); ++i) {
    EXPECT_EQ(next[i], l.tensors[i].numel) << where << " " << l.tensors[i].name;
  }
}

TEST(UnevenLayoutTest, UnitPast2GiBHasExactPaddingOffsetsAndPieces) {
  const int64_t kBig = (int64_t{1} << 31) + 3;  // elements: past int32 on its own
  std::vector<internal::FlatTensor> tensors = {
      {"huge.weight", {3, int64_t{1} << 30}, 3 * (int64_t{1} << 30), 0, true, true},  // 12 GiB
      {"odd.bias", {7}, 7, 0, true, false},
      {"frozen.weight", {kBig, 1}, kBig, 0, false, true},
      {"tail", {5}, 5, 0, true, false},
  };
  const int64_t total = 3 * (int64_t{1} << 30) + 7 + kBig + 5;
  for (int S : {1, 2, 3, 7, 8, 1000, 4099}) {
    const internal::FlatLayout l = internal::FlatLayout::Build(tensors, S);
    const std::string where = "S=" + std::to_string(S);
    EXPECT_EQ(l.numel, total) << where;
    EXPECT_EQ(l.padded_numel, (total + S - 1) / S * S) << where;
    EXPECT_EQ(l.tensors[2].offset, 3 * (int64_t{1} << 30) + 7) << where;
    EXPECT_EQ(l.tensors[3].offset, 3 * (int64_t{1} << 30) + 7 + kBig) << where;
    EXPECT_GT(l.padded_numel * 4, int64_t{INT32_MAX}) << where;
    if (S >= 2 && S <= 8) {
      EXPECT_GT(l.shard_begin(S - 1), int64_t{INT32_MAX}) << where;
    }
    ExpectLayoutTiles(l, where);
  }
  // Dimensions past 32 bits are part of the fingerprint that ranks compare.
  std::vector<internal::FlatTensor> other = tensors;
  other[2].shape = {kBig + (int64_t{1} << 32), 1};
  EXPECT_NE(internal::FlatLayout::Build(other, 8).Fingerprint(),
            internal::FlatLayout::Build(tensors, 8).Fingerprint());
}

// The same unit registered with a runtime on 8 ranks: its sizes are reported and nothing is
// allocated (no Finalize).
TEST(UnevenLayoutTest, UnitPast2GiBRegistersWithoutAllocating) {
  const absl::Status s = LocalWorld::Run(8, Deadline(), [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto rt, ShardingRuntime::Create(backend.get(), comm, {}));
    FSDP_ASSIGN_OR_RETURN(int u, rt->RegisterUnit("huge", {{"huge.weight", {3, int64_t{1} << 30}},
                                                           {"huge.bias", {7}}}));
    const int64_t numel = 3 * (int64_t{1} << 30) + 7;
    EXPECT_EQ(rt->unit_numel(u), numel);
    EXPECT_EQ(rt->unit_shard_numel(u), (numel + 7) / 8);
    EXPECT_EQ(rt->unit_tensors(u)[1].offset, 3 * (int64_t{1} << 30));
    EXPECT_EQ(rt->memory().bytes_in_use(), 0);
    EXPECT_EQ(backend->memory_stats().bytes_in_use, 0);
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << s;
}

// ---- configurations that cannot work: an error on every rank, before any gather, at once -------

// Runs `body` on `world` ranks and returns each rank's status and the time until all returned.
std::pair<std::vector<absl::Status>, double> RunAll(
    int world, const std::function<absl::Status(Communicator&)>& body) {
  std::vector<absl::Status> out(world);
  const auto t0 = std::chrono::steady_clock::now();
  LocalWorld::Run(world, Deadline(), [&](Communicator& comm) {
    out[comm.rank()] = body(comm);
    return absl::OkStatus();
  }).IgnoreError();
  return {out, SecondsSince(t0)};
}

// Registers the degenerate model, changed on rank `odd` by `change`, and finalizes.
absl::Status RegisterAndFinalize(Communicator& comm, int odd,
                                 const std::function<void(Model&)>& change) {
  Model m = Degenerate(7, 15, 3);
  if (comm.rank() == odd) change(m);
  FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
  return BuildRuntime(backend.get(), comm, m, {}).status();
}

TEST(UnevenErrorsTest, HybridShardSizeThatDoesNotDivideTheWorld) {
  auto [statuses, seconds] = RunAll(8, [](Communicator& comm) {
    auto backend = *CpuBackend::Create({.num_threads = 1});
    ShardingOptions o;
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_shard_size = 3;
    return ShardingRuntime::Create(backend.get(), comm, o).status();
  });
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kInvalidArgument) << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("hybrid_shard_size (3) must be >= 1 and divide the "
                                         "world size (8)"),
              std::string::npos)
        << statuses[r];
  }
  EXPECT_LT(seconds, kQuickSeconds);
}

// One rank given a shard size that does not divide the world, the others a good one: the
// others must not wait for it at the mesh's first collective until the deadline.
TEST(UnevenErrorsTest, HybridShardSizeThatDoesNotDivideTheWorldOnOneRank) {
  auto [statuses, seconds] = RunAll(8, [](Communicator& comm) {
    auto backend = *CpuBackend::Create({.num_threads = 1});
    ShardingOptions o;
    o.strategy = ShardingStrategy::kHybridShard;
    o.hybrid_shard_size = comm.rank() == 3 ? 3 : 4;
    return ShardingRuntime::Create(backend.get(), comm, o).status();
  });
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kInvalidArgument) << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("hybrid_shard_size (3) must be >= 1 and divide the "
                                         "world size (8)"),
              std::string::npos)
        << r << ": " << statuses[r];
    if (r != 3) {
      EXPECT_NE(statuses[r].message().find("rank 3"), std::string::npos) << statuses[r];
    }
  }
  EXPECT_LT(seconds, kQuickSeconds);
}

TEST(UnevenErrorsTest, RankRegisteringOneUnitFewer) {
  auto [statuses, seconds] = RunAll(8, [](Communicator& comm) {
    return RegisterAndFinalize(comm, 5, [](Model& m) { m.stages.erase(m.stages.begin() + 2); });
  });
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kInvalidArgument) << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("rank 0 registered 6 units, rank 5 registered 5"),
              std::string::npos)
        << statuses[r];
  }
  EXPECT_LT(seconds, kQuickSeconds);
}

TEST(UnevenErrorsTest, RankRegisteringAnotherShapeOfADegenerateUnit) {
  auto [statuses, seconds] = RunAll(8, [](Communicator& comm) {
    // 3 elements on the other ranks, 4 on rank 2: its shards would be of another size.
    return RegisterAndFinalize(comm, 2, [](Model& m) { m.stages[3].params[1].shape = {3}; });
  });
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kInvalidArgument) << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("unit 3 ('scale_shift' on rank " + std::to_string(r) +
                                         ") differs between rank 0 and rank 2"),
              std::string::npos)
        << statuses[r];
  }
  EXPECT_LT(seconds, kQuickSeconds);
}

TEST(UnevenErrorsTest, RankFreezingAnotherParameter) {
  auto [statuses, seconds] = RunAll(4, [](Communicator& comm) {
    return RegisterAndFinalize(comm, 1,
                               [](Model& m) { m.stages[4].params[1].requires_grad = true; });
  });
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(statuses[r].code(), absl::StatusCode::kInvalidArgument) << r << ": " << statuses[r];
    EXPECT_NE(statuses[r].message().find("differs between rank 0 and rank 1"), std::string::npos)
        << statuses[r];
  }
  EXPECT_LT(seconds, kQuickSeconds);
}

// A parameter with no elements is refused where it is registered; the other ranks, already in
// Finalize's agreement, get that error at once rather than their deadline.
TEST(UnevenErrorsTest, EmptyParameterOnOneRank) {
  auto [statuses, seconds] = RunAll(8, [](Communicator& comm) {
    return RegisterAndFinalize(comm, 6, [](Model& m) { m.stages[2].params[0].shape = {0}; });
  });
  EXPECT_EQ(statuses[6].code(), absl::StatusCode::kInvalidArgument) << statuses[6];
  EXPECT_NE(statuses[6].message().find("parameter 'gain' has shape [0]; every dimension must be "
                                       ">= 1"),
            std::string::npos)
      << statuses[6];
  for (int r = 0; r < 8; ++r) {
    EXPECT_FALSE(statuses[r].ok()) << r;
    EXPECT_NE(statuses[r].code(), absl::StatusCode::kDeadlineExceeded) << r << ": "
                                                                       << statuses[r];
  }
  EXPECT_LT(seconds, kQuickSeconds);
}

}  // namespace
}  // namespace fsdp::testing::uneven
