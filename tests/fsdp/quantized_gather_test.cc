// Quantized communication (ShardingOptions::communication, fsdp/wire_format.h): for the
// parameter all-gather, what every rank computes with and the master shards staying exact; for
// the gradient reduction, the mean of once-quantized gradients (its error does not grow with
// the ranks) and replicas that agree bitwise; a GPT trained with both; bad input. Runs once
// per backend (cpu, sim; on pjrt, which has no quantization ops, the refusal).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/kernels_cpu.h"
#include "fsdp/local_world.h"
#include "fsdp/sharding.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing {
namespace {

using ::testing::HasSubstr;

CommOptions ShortTimeout() {
  CommOptions o;
  o.timeout = absl::Seconds(20);
  return o;
}

// Element j of the unit: blocks of very different magnitudes, so each block's scale matters.
float Init(int64_t j) {
  return std::ldexp(std::sin(0.37f * static_cast<float>(j) + 0.1f), static_cast<int>(j / 16) % 9 - 4);
}

// What every rank must see gathered in `dtype`: each rank's shard of `flat` (padded with zeros
// to ranks x shard) quantized on its own, decoded, rounded to `dtype` and read back as f32.
std::vector<float> Expected(const std::vector<float>& flat, int ranks, int64_t shard,
                            int64_t block, WireFormat format, DType dtype) {
  std::vector<float> padded(flat);
  padded.resize(ranks * shard, 0.0f);
  std::vector<float> out(ranks * shard);
  const QuantizedLayout layout{shard, block};
  for (int r = 0; r < ranks; ++r) {
    std::vector<uint8_t> codes(shard);
    std::vector<float> scales(layout.blocks());
    kernels::cpu::quantize_blocks(codes.data(), scales.data(), padded.data() + r * shard, shard,
                                  block, format);
    kernels::cpu::dequantize_blocks(out.data() + r * shard, DType::kF32, codes.data(),
                                    scales.data(), shard, block, format);
  }
  for (float& x : out) {
    if (dtype == DType::kBF16) x = Bf16ToFloat(FloatToBf16(x));
  }
  out.resize(flat.size());
  return out;
}

std::vector<float> AsF32(const std::vector<uint16_t>& bf16) {
  std::vector<float> out(bf16.size());
  for (size_t i = 0; i < bf16.size(); ++i) out[i] = Bf16ToFloat(bf16[i]);
  return out;
}

absl::StatusOr<std::vector<float>> Gathered(Backend* backend, const UnitView& v) {
  const View data = v.data_view.Slice(0, v.numel);
  if (v.dtype == DType::kBF16) {
    FSDP_ASSIGN_OR_RETURN(std::vector<uint16_t> bits, ToHost<uint16_t>(backend, data));
    return AsF32(bits);
  }
  return ToHost<float>(backend, data);
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) return false;
  }
  return true;
}

// FULL_SHARD on 3 ranks (a padded last shard, blocks cut by the shard edges): the forward and
// the backward's regather hold exactly the decoded codes of every rank's master shard, the same
// on every rank; the optimizer updates the exact f32 master; the next forward quantizes the
// updated master. A backend without the ops refuses the option when the runtime is created.
TEST(QuantizedGatherTest, EveryRankComputesWithTheDecodedMasterShards) {
  constexpr int kRanks = 3;
  constexpr int64_t kNumel = 1000, kBlock = 32;
  constexpr float kLr = 0.5f;
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    for (DType dtype : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(absl::StrCat(std::string(WireFormatName(format)), " ",
                                std::string(DTypeName(dtype))));
      std::vector<std::vector<float>> forward(kRanks), backward(kRanks), second(kRanks),
          master(kRanks);
      int64_t shard = 0;
      bool refused = false;
      const absl::Status s = LocalWorld::Run(kRanks, ShortTimeout(), [&](Communicator& comm) {
        FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
        ShardingOptions so;
        so.optimizer = OptimizerKind::kSgd;
        so.mixed_precision.param_dtype = dtype;
        so.communication.all_gather = format;
        so.communication.block_size = kBlock;
        auto created = ShardingRuntime::Create(backend.get(), comm, so);
        if (!backend->runtime_ops().supports_wire_format(format)) {
          EXPECT_EQ(created.status().code(), absl::StatusCode::kInvalidArgument);
          EXPECT_THAT(created.status().message(),
                      HasSubstr("backend does not implement (the cpu, sim, cuda and pjrt "
                                    "backends do); use dtype"));
          refused = true;
          return absl::OkStatus();
        }
        FSDP_ASSIGN_OR_RETURN(auto rt, std::move(created));
        FSDP_ASSIGN_OR_RETURN(int u, rt->RegisterUnit("a", {{"w", {kNumel}}}));
        FSDP_RETURN_IF_ERROR(rt->Finalize(
            [](int, const ParamInfo&, int64_t b, int64_t e, float* out) {
              for (int64_t j = b; j < e; ++j) out[j - b] = Init(j);
            }));
        if (comm.rank() == 0) shard = rt->param_shard(u).count;
        const int r = comm.rank();
        FSDP_ASSIGN_OR_RETURN(UnitView v, rt->PreForward(u));
        FSDP_ASSIGN_OR_RETURN(forward[r], Gathered(rt->backend(), v));
        FSDP_RETURN_IF_ERROR(rt->PostForward(u));
        FSDP_ASSIGN_OR_RETURN(UnitView g, rt->PreBackward(u));
        FSDP_ASSIGN_OR_RETURN(backward[r], Gathered(rt->backend(), g));
        std::vector<float> grad(kNumel);
        // Multiples of 1/64: their mean over the ranks and lr times them are exact.
        for (int64_t j = 0; j < kNumel; ++j) grad[j] = static_cast<float>(j % 7) / 64.0f;
        FSDP_RETURN_IF_ERROR(
            rt->backend()->CopyFromHost(g.grads_view.Slice(0, kNumel), grad.data()));
        FSDP_RETURN_IF_ERROR(rt->PostBackward(u));
        FSDP_RETURN_IF_ERROR(rt->FinishBackward());
        FSDP_RETURN_IF_ERROR(rt->Step(kLr).status());
        master[r].resize(kNumel);
        FSDP_RETURN_IF_ERROR(rt->GatherUnit(u, master[r].data()));
        FSDP_ASSIGN_OR_RETURN(UnitView again, rt->PreForward(u));
        FSDP_ASSIGN_OR_RETURN(second[r], Gathered(rt->backend(), again));
        FSDP_RETURN_IF_ERROR(rt->PostForward(u));
        FSDP_RETURN_IF_ERROR(rt->FinishForwardOnly());
        return absl::OkStatus();
      });
      ASSERT_TRUE(s.ok()) << s;
      if (refused) continue;
      std::vector<float> init(kNumel), updated(kNumel);
      for (int64_t j = 0; j < kNumel; ++j) {
        init[j] = Init(j);
        updated[j] = init[j] - kLr * (static_cast<float>(j % 7) / 64.0f);
      }
      const std::vector<float> want = Expected(init, kRanks, shard, kBlock, format, dtype);
      const std::vector<float> want2 = Expected(updated, kRanks, shard, kBlock, format, dtype);
      EXPECT_FALSE(BitEqual(want, init)) << "the test's values must not survive quantization";
      for (int r = 0; r < kRanks; ++r) {
        EXPECT_TRUE(BitEqual(forward[r], want)) << "rank " << r;
        EXPECT_TRUE(BitEqual(backward[r], want)) << "rank " << r << ": the regather";
        EXPECT_TRUE(BitEqual(master[r], updated)) << "rank " << r << ": the f32 master";
        EXPECT_TRUE(BitEqual(second[r], want2)) << "rank " << r << ": after the step";
      }
    }
  }
}

// A GPT trained with int8 and fp8 all-gathers stays close to the same training without them:
// the losses of every step within 2% (nano, 12 steps, FULL_SHARD on 2 ranks); the runtime's
// memory report (the codes included) is the backend's own count.
TEST(QuantizedGatherTest, GptTrainsCloseToTheUnquantizedRun) {
  TrainSpec spec;
  spec.steps = 12;
  spec.lr = 3e-3f;
  auto train = [&](WireFormat format, WireFormat reduction) -> absl::StatusOr<TrainResult> {
    std::vector<TrainResult> out(2);
    FSDP_RETURN_IF_ERROR(LocalWorld::Run(2, ShortTimeout(), [&](Communicator& comm) {
      ShardingOptions so;
      so.communication.all_gather = format;
      so.communication.reduction = reduction;
      so.communication.block_size = 64;
      FSDP_ASSIGN_OR_RETURN(out[comm.rank()], TrainSharded(comm, spec, so, 1));
      return absl::OkStatus();
    }));
    for (int r = 0; r < 2; ++r) {
      ExpectReportIsBackend(out[r].memory, out[r].backend_memory, absl::StrCat("rank ", r));
    }
    return out[0];
  };
  auto probe = MakeTestBackend(1);
  ASSERT_TRUE(probe.ok()) << probe.status();
  if (!(*probe)->runtime_ops().supports_wire_format(WireFormat::kInt8)) {
    GTEST_SKIP() << "skipped: the " << (*probe)->name()
                 << " backend has no quantization ops (its refusal is checked above)";
  }
  absl::StatusOr<TrainResult> plain = train(WireFormat::kDType, WireFormat::kDType);
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (auto [format, reduction] : {std::pair{WireFormat::kInt8, WireFormat::kDType},
                                   std::pair{WireFormat::kFp8E4M3, WireFormat::kDType},
                                   std::pair{WireFormat::kInt8, WireFormat::kInt8}}) {
    SCOPED_TRACE(absl::StrCat("all-gather ", std::string(WireFormatName(format)), ", reduction ",
                              std::string(WireFormatName(reduction))));
    absl::StatusOr<TrainResult> q = train(format, reduction);
    ASSERT_TRUE(q.ok()) << q.status();
    ASSERT_EQ(q->losses.size(), plain->losses.size());
    for (size_t i = 0; i < q->losses.size(); ++i) {
      EXPECT_NEAR(q->losses[i], plain->losses[i], 0.02 * plain->losses[i]) << "step " << i;
    }
    EXPECT_LT(q->losses.back(), q->losses.front() - 0.5f) << "it trains";
    EXPECT_NE(q->losses, plain->losses) << "the layers computed with the unquantized values";
    EXPECT_GT(q->memory.param_shard_bytes, plain->memory.param_shard_bytes)
        << "the codes of each shard are counted with the parameters";
  }
}

// Rank r's gradient of element j: the magnitudes of Init (blocks far apart), a factor in
// [0.75, 1.25) that differs between ranks.
float Grad(int r, int64_t j) {
  const float f = 0.618034f * static_cast<float>((r + 1) * (j % 13 + 1));
  return Init(j) * (0.75f + 0.5f * (f - std::floor(f)));
}

// What a quantized reduce-scatter over `ranks` ranks yields for the whole unit: rank q's padded
// gradient quantized in chunks of `shard` (chunk d for rank d), every chunk's codes decoded and
// added in rank order in f32, times 1 / ranks.
std::vector<float> EmulatedMean(int ranks, int64_t numel, int64_t shard, int64_t block,
                                WireFormat format) {
  std::vector<float> out(ranks * shard, 0.0f), term(shard);
  const QuantizedLayout layout{shard, block};
  std::vector<uint8_t> codes(shard);
  std::vector<float> scales(layout.blocks()), g(ranks * shard);
  for (int q = 0; q < ranks; ++q) {
    for (int64_t j = 0; j < ranks * shard; ++j) g[j] = j < numel ? Grad(q, j) : 0.0f;
    for (int d = 0; d < ranks; ++d) {
      kernels::cpu::quantize_blocks(codes.data(), scales.data(), g.data() + d * shard, shard,
                                    block, format);
      kernels::cpu::dequantize_blocks(term.data(), DType::kF32, codes.data(), scales.data(),
                                      shard, block, format);
      for (int64_t j = 0; j < shard; ++j) {
        float& o = out[d * shard + j];
        o = q == 0 ? term[j] : o + term[j];
      }
    }
  }
  for (float& x : out) x *= 1.0f / static_cast<float>(ranks);
  out.resize(numel);
  return out;
}

// The unit's gradient as Step() uses it (GatherUnitGradient) on every rank, after one backward
// (or `micro_batches` accumulated sharded) with rank r's gradient Grad(r, .) in each; empty
// when the backend lacks the format.
absl::StatusOr<std::vector<std::vector<float>>> ReducedGradients(int world, ShardingOptions so,
                                                                 int64_t numel,
                                                                 int micro_batches = 1,
                                                                 int64_t* shard = nullptr) {
  std::vector<std::vector<float>> out(world);
  bool refused = false;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, ShortTimeout(), [&](Communicator& comm) {
    FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
    if (!backend->runtime_ops().supports_wire_format(so.communication.reduction)) {
      refused = true;
      return absl::OkStatus();
    }
    FSDP_ASSIGN_OR_RETURN(auto rt, ShardingRuntime::Create(backend.get(), comm, so));
    FSDP_ASSIGN_OR_RETURN(int u, rt->RegisterUnit("a", {{"w", {numel}}}));
    FSDP_RETURN_IF_ERROR(rt->Finalize(
        [](int, const ParamInfo&, int64_t b, int64_t e, float* o) { std::fill(o, o + (e - b), 0.0f); }));
    if (shard != nullptr && comm.rank() == 0) *shard = rt->unit_shard_numel(u);
    std::vector<float> grad(numel);
    for (int64_t j = 0; j < numel; ++j) grad[j] = Grad(comm.rank(), j);
    for (int m = 0; m < micro_batches; ++m) {
      ConfigureMicroBatch(*rt, Accumulation::kSharded, m, micro_batches);
      FSDP_RETURN_IF_ERROR(rt->PreForward(u).status());
      FSDP_RETURN_IF_ERROR(rt->PostForward(u));
      FSDP_ASSIGN_OR_RETURN(UnitView g, rt->PreBackward(u));
      FSDP_RETURN_IF_ERROR(rt->backend()->CopyFromHost(g.grads_view.Slice(0, numel), grad.data()));
      FSDP_RETURN_IF_ERROR(rt->PostBackward(u));
      FSDP_RETURN_IF_ERROR(rt->FinishBackward());
    }
    out[comm.rank()].resize(numel);
    return rt->GatherUnitGradient(u, out[comm.rank()].data());
  }));
  if (refused) out.clear();
  return out;
}

// The shard group's quantized reduce-scatter (FULL_SHARD) on 2 to 8 ranks: every rank's unit
// gradient is the emulated mean bitwise, and its error against the exact mean, relative to the
// largest gradient of the element's block, stays within the format's bound and does not grow
// with the ranks (each gradient is quantized once and the sum is f32).
TEST(QuantizedReductionTest, TheMeanOfOnceQuantizedGradientsWhoseErrorDoesNotGrowWithTheRanks) {
  constexpr int64_t kNumel = 3000, kBlock = 64;
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    SCOPED_TRACE(std::string(WireFormatName(format)));
    std::vector<double> err(9, 0.0);
    for (int n = 2; n <= 8; ++n) {
      ShardingOptions so;
      so.communication.reduction = format;
      so.communication.block_size = kBlock;
      int64_t shard = 0;
      absl::StatusOr<std::vector<std::vector<float>>> got =
          ReducedGradients(n, so, kNumel, 1, &shard);
      ASSERT_TRUE(got.ok()) << got.status();
      if (got->empty()) GTEST_SKIP() << "skipped: the backend has no quantization ops";
      const std::vector<float> want = EmulatedMean(n, kNumel, shard, kBlock, format);
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(BitEqual((*got)[r], want)) << n << " ranks, rank " << r;
      }
      for (int64_t j = 0; j < kNumel; ++j) {
        double exact = 0, largest = 0;
        const int64_t b0 = j / shard * shard + (j % shard) / kBlock * kBlock;
        for (int q = 0; q < n; ++q) {
          exact += Grad(q, j);
          for (int64_t i = b0; i < std::min(b0 + kBlock, kNumel); ++i) {
            largest = std::max(largest, std::abs(static_cast<double>(Grad(q, i))));
          }
        }
        exact /= n;
        err[n] = std::max(err[n], std::abs((*got)[0][j] - exact) / largest);
      }
      std::printf("%s reduce-scatter over %d ranks: largest error %.3g of the block's largest "
                  "gradient\n",
                  std::string(WireFormatName(format)).c_str(), n, err[n]);
    }
    // int8: each term is off by at most half a step, max / 254; fp8 e4m3: 2^-4 of the value.
    const double bound = format == WireFormat::kInt8 ? 1.0 / 254 : 1.0 / 16;
    EXPECT_GT(err[2], 0.0) << "the gradients must not survive quantization exactly";
    for (int n = 2; n <= 8; ++n) {
      EXPECT_LE(err[n], bound * 1.001) << n << " ranks";
      EXPECT_LE(err[n], 1.25 * err[2]) << n << " ranks: the error grew with the ranks";
    }
  }
}

// Across replicas (HYBRID 2 x 2 and 3 x 2 with two micro-batches accumulated in the shard, so
// that the replicas reduce once; NO_SHARD on 3 ranks, also with a unit smaller than the
// replicas, whose last chunk is empty): every rank ends with the same gradient bitwise, within
// the bound of three quantizations (int8: a rank's gradient, the reduced shard's chunks, the
// replicas' mean chunk) of the exact mean.
TEST(QuantizedReductionTest, ReplicasAgreeBitwiseOnTheDecodedMean) {
  struct Shape {
    ShardingStrategy strategy;
    int world, shard, micro_batches;
    int64_t numel;
  };
  for (const Shape& c : {Shape{ShardingStrategy::kHybridShard, 4, 2, 2, 1000},
                         Shape{ShardingStrategy::kHybridShard, 6, 2, 2, 1000},
                         Shape{ShardingStrategy::kNoShard, 3, 0, 1, 1000},
                         Shape{ShardingStrategy::kNoShard, 3, 0, 1, 2}}) {
    const int64_t kNumel = c.numel;
    SCOPED_TRACE(absl::StrCat(std::string(StrategyName(c.strategy)), " on ", c.world,
                              " ranks, ", kNumel, " elements"));
    ShardingOptions so;
    so.strategy = c.strategy;
    so.hybrid_shard_size = c.shard;
    so.communication.reduction = WireFormat::kInt8;
    so.communication.block_size = 32;
    absl::StatusOr<std::vector<std::vector<float>>> got =
        ReducedGradients(c.world, so, kNumel, c.micro_batches);
    ASSERT_TRUE(got.ok()) << got.status();
    if (got->empty()) GTEST_SKIP() << "skipped: the backend has no quantization ops";
    double err = 0;
    for (int64_t j = 0; j < kNumel; ++j) {
      double exact = 0;
      for (int q = 0; q < c.world; ++q) exact += Grad(q, j);
      exact /= c.world;
      // Every block holding element j lies within 32 elements of it.
      double largest = 0;
      for (int q = 0; q < c.world; ++q) {
        for (int64_t i = std::max<int64_t>(0, j - 32); i < std::min(kNumel, j + 33); ++i) {
          largest = std::max(largest, std::abs(static_cast<double>(Grad(q, i))));
        }
      }
      err = std::max(err, std::abs((*got)[0][j] - exact) / largest);
    }
    for (int r = 1; r < c.world; ++r) {
      EXPECT_TRUE(BitEqual((*got)[r], (*got)[0])) << "rank " << r << " differs from rank 0";
    }
    // (A block of one element is exact: it is its own largest value.)
    if (kNumel > 100) {
      EXPECT_GT(err, 0.0);
    }
    // Each of the three quantizations is off by at most half a step, 1 / 254 of its block's
    // largest value.
    std::printf("%s on %d ranks, %lld elements: largest error %.3g of the largest gradient "
                "near the element\n",
                std::string(StrategyName(c.strategy)).c_str(), c.world,
                static_cast<long long>(kNumel), err);
    EXPECT_LE(err, 3 / 254.0 * 1.001);
  }
}

TEST(QuantizedGatherTest, BadBlockSizesAreRefusedNamingTheRange) {
  for (int block : {0, 8, 100, 131072}) {
    const absl::Status s = LocalWorld::Run(1, ShortTimeout(), [&](Communicator& comm) {
      FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
      ShardingOptions so;
      if (block == 100) {
        so.communication.reduction = WireFormat::kInt8;  // either format checks the block
      } else {
        so.communication.all_gather = WireFormat::kInt8;
      }
      so.communication.block_size = block;
      return ShardingRuntime::Create(backend.get(), comm, so).status();
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << block;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("communication.block_size is ", block,
                                                    "; allowed: a power of two from 16 to "
                                                    "65536")));
  }
}

// A quantized reduction encodes the f32 gradient: a low reduce_dtype, and the small gradients
// of dynamic loss scaling, are refused at start-up naming the option.
TEST(QuantizedReductionTest, IncompatibleSettingsAreRefusedNamingTheOption) {
  auto create = [](const ShardingOptions& so) {
    return LocalWorld::Run(2, ShortTimeout(), [&](Communicator& comm) {
      FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
      return ShardingRuntime::Create(backend.get(), comm, so).status();
    });
  };
  ShardingOptions so;
  so.communication.reduction = WireFormat::kInt8;
  so.mixed_precision.param_dtype = DType::kBF16;
  so.mixed_precision.reduce_dtype = DType::kBF16;
  absl::Status s = create(so);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  auto probe = MakeTestBackend(1);
  ASSERT_TRUE(probe.ok());
  if (!(*probe)->runtime_ops().supports_wire_format(WireFormat::kInt8)) {
    EXPECT_THAT(s.message(), HasSubstr("communication.reduction is int8, which the"));
    GTEST_SKIP() << "skipped: the backend has no quantization ops (its refusal is checked)";
  }
  EXPECT_THAT(s.message(), HasSubstr("communication.reduction is int8 with reduce_dtype bf16"));
  so.mixed_precision.reduce_dtype = DType::kF32;
  so.mixed_precision.param_dtype = DType::kF16;
  so.mixed_precision.dynamic_loss_scale = true;
  s = create(so);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("communication.reduction is int8 with dynamic loss scaling"));
  so.mixed_precision.dynamic_loss_scale = false;
  EXPECT_TRUE(create(so).ok());
}

}  // namespace
}  // namespace fsdp::testing
