// The quantized parameter all-gather (ShardingOptions::communication, fsdp/wire_format.h): what
// every rank computes with, the master shards staying exact, a GPT trained with it, and bad
// input. Runs once per backend (cpu, sim; on pjrt, which has no quantization ops, the refusal).
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
                      HasSubstr("backend does not implement (the cpu, sim and cuda "
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
  auto train = [&](WireFormat format) -> absl::StatusOr<TrainResult> {
    std::vector<TrainResult> out(2);
    FSDP_RETURN_IF_ERROR(LocalWorld::Run(2, ShortTimeout(), [&](Communicator& comm) {
      ShardingOptions so;
      so.communication.all_gather = format;
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
  absl::StatusOr<TrainResult> plain = train(WireFormat::kDType);
  ASSERT_TRUE(plain.ok()) << plain.status();
  for (WireFormat format : {WireFormat::kInt8, WireFormat::kFp8E4M3}) {
    SCOPED_TRACE(std::string(WireFormatName(format)));
    absl::StatusOr<TrainResult> q = train(format);
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

TEST(QuantizedGatherTest, BadBlockSizesAreRefusedNamingTheRange) {
  for (int block : {0, 8, 100, 131072}) {
    const absl::Status s = LocalWorld::Run(1, ShortTimeout(), [&](Communicator& comm) {
      FSDP_ASSIGN_OR_RETURN(auto backend, MakeTestBackend(1));
      ShardingOptions so;
      so.communication.all_gather = WireFormat::kInt8;
      so.communication.block_size = block;
      return ShardingRuntime::Create(backend.get(), comm, so).status();
    });
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << block;
    EXPECT_THAT(s.message(), HasSubstr(absl::StrCat("communication.block_size is ", block,
                                                    "; allowed: a power of two from 16 to "
                                                    "65536")));
  }
}

}  // namespace
}  // namespace fsdp::testing
