// Full-model safetensors, ranks as threads: export on 2 ranks, import on 3 (and other
// layouts) gives identical parameters (f32 bitwise, bf16 to bf16 rounding); the file has the
// MODEL_SPEC.md names and shapes and follows the public format; mismatches are errors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "src/checkpoint/safetensors_format.h"
#include "tests/checkpoint/safetensors_ref_reader.h"
#include "tests/checkpoint/ckpt_util.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// Trains 3 steps on `world` ranks and exports; returns the model's units.
absl::StatusOr<std::vector<std::vector<float>>> TrainAndExport(int world, const CkptRun& run,
                                                               const std::string& path,
                                                               DType dtype) {
  std::vector<std::vector<float>> params;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), run));
    for (int s = 0; s < 3; ++s) {
      nn::Batch b = RankBatch(TrainSpec{}, comm.rank(), world, s, 0);
      FSDP_RETURN_IF_ERROR(model->ForwardBackward(b.inputs.data(), b.targets.data()).status());
      FSDP_RETURN_IF_ERROR(model->Step(1e-2f).status());
    }
    SafetensorsExportOptions o;
    o.dtype = dtype;
    o.metadata["producer"] = "libfsdp test";
    // One gathered unit at a time: the export's device memory peaks at the largest unit.
    ShardingRuntime& rt = model->runtime();
    int64_t largest = 0;
    for (int u = 0; u < rt.num_units(); ++u) {
      largest = std::max(largest, rt.unit_shard_numel(u) * rt.shard_group().size() * 4);
    }
    backend->ResetPeak();
    const int64_t before = backend->memory_stats().bytes_in_use;
    FSDP_RETURN_IF_ERROR(ExportSafetensors(rt, path, o));
    if (backend->memory_stats().peak_bytes - before > largest) {
      return absl::InternalError(
          absl::StrCat("export peaked at ", backend->memory_stats().peak_bytes - before,
                       " bytes, more than the largest unit (", largest, ")"));
    }
    FSDP_ASSIGN_OR_RETURN(auto p, model->GatherModelUnits());
    if (comm.rank() == 0) params = std::move(p);
    return absl::OkStatus();
  }));
  return params;
}

// A fresh model (another seed) on `world` ranks imports `path`; returns its units.
absl::StatusOr<std::vector<std::vector<float>>> Import(int world, const CkptRun& run,
                                                       const std::string& path,
                                                       SafetensorsImportOptions options = {}) {
  std::vector<std::vector<float>> params;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    CkptRun fresh = run;
    fresh.init_seed = 5;
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), fresh));
    FSDP_RETURN_IF_ERROR(ImportSafetensors(model->runtime(), path, options));
    FSDP_ASSIGN_OR_RETURN(auto p, model->GatherModelUnits());
    if (comm.rank() == 0) params = std::move(p);
    return absl::OkStatus();
  }));
  return params;
}

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/fsdp_st_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(SafetensorsTest, F32ExportOnTwoImportOnThreeIsBitwiseIdentical) {
  const std::string path = dir_ + "/model.safetensors";
  auto exported = TrainAndExport(2, CkptRun{}, path, DType::kF32);
  ASSERT_TRUE(exported.ok()) << exported.status();
  CkptRun three;
  three.strategy = ShardingStrategy::kShardGradOp;
  auto imported = Import(3, three, path);
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_EQ(imported->size(), exported->size());
  for (size_t u = 0; u < exported->size(); ++u) {
    ASSERT_EQ((*imported)[u].size(), (*exported)[u].size());
    EXPECT_EQ(std::memcmp((*imported)[u].data(), (*exported)[u].data(), (*exported)[u].size() * 4),
              0)
        << "unit " << u;
  }
  // Other layouts: HYBRID 2x2, NO_SHARD on one rank, one unit for the whole model.
  CkptRun hybrid;
  hybrid.strategy = ShardingStrategy::kHybridShard;
  hybrid.hybrid_shard = 2;
  CkptRun single;
  single.strategy = ShardingStrategy::kNoShard;
  single.wrap.kind = nn::WrapPolicy::Kind::kExplicit;
  for (auto [world, run] : {std::make_pair(4, hybrid), std::make_pair(1, single)}) {
    auto again = Import(world, run, path);
    ASSERT_TRUE(again.ok()) << again.status();
    for (size_t u = 0; u < exported->size(); ++u) {
      EXPECT_EQ(std::memcmp((*again)[u].data(), (*exported)[u].data(), (*exported)[u].size() * 4),
                0)
          << "world " << world << " unit " << u;
    }
  }
}

// Llama exports under the Hugging Face names, and a state_dict written by PyTorch
// (tests/nn/golden/tiny_llama_hf_model.safetensors, make_llama_golden.py: LlamaForCausalLM
// with grouped-query attention) imports into the sharded Llama and computes transformers'
// loss; exported again, every tensor is the file's, bitwise.
TEST_F(SafetensorsTest, LlamaStateDictFromTransformersImportsAndExportsBack) {
  const std::string golden = std::string(FSDP_SOURCE_DIR) + "/tests/nn/golden/";
  auto state = ref_st::Parse(ReadAll(golden + "tiny_llama_hf_model.safetensors"));
  ASSERT_TRUE(state.ok()) << state.status();
  auto expect = ref_st::Parse(ReadAll(golden + "tiny_llama_hf.safetensors"));
  ASSERT_TRUE(expect.ok()) << expect.status();
  const float want_loss = ref_st::F32Values(expect->tensors.at("out.loss")).at(0);
  auto tokens = [&](const char* name) {
    const std::string& b = expect->tensors.at(name).bytes;
    std::vector<int32_t> v(b.size() / 4);
    std::memcpy(v.data(), b.data(), b.size());
    return v;
  };
  const std::vector<int32_t> idx = tokens("tokens.idx"), tgt = tokens("tokens.tgt");
  nn::LlamaConfig config = *nn::LlamaConfig::FromName("llama-nano");
  config.vocab_size = 32;
  config.block_size = 8;
  config.channels = 16;
  config.mlp_hidden = 24;  // L = 2, H = 4, Hkv = 2 as llama-nano
  const int world = 2, T = 8;  // one of the file's two sequences per rank
  const std::string back = dir_ + "/back.safetensors";
  std::vector<float> losses(world);
  absl::Status s = LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    nn::ShardedModelOptions o;
    o.sharding.strategy = ShardingStrategy::kFullShard;
    o.batch_size = 1;
    o.seq_len = T;
    FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(config, backend.get(), comm, o));
    FSDP_RETURN_IF_ERROR(ImportSafetensors(model->runtime(),
                                           golden + "tiny_llama_hf_model.safetensors"));
    const int r = comm.rank();
    FSDP_ASSIGN_OR_RETURN(float loss, model->Forward(idx.data() + r * T, tgt.data() + r * T));
    FSDP_ASSIGN_OR_RETURN(losses[r], model->MeanOverRanks(loss));
    return ExportSafetensors(model->runtime(), back);
  });
  ASSERT_TRUE(s.ok()) << s;
  for (float l : losses) EXPECT_NEAR(l, want_loss, 2e-6 * want_loss);
  auto exported = ref_st::Parse(ReadAll(back));
  ASSERT_TRUE(exported.ok()) << exported.status();
  ASSERT_EQ(exported->tensors.size(), state->tensors.size());
  for (const auto& [name, t] : state->tensors) {
    auto it = exported->tensors.find(name);
    ASSERT_NE(it, exported->tensors.end()) << name << " was not exported";
    EXPECT_EQ(it->second.dtype, t.dtype) << name;
    EXPECT_EQ(it->second.shape, t.shape) << name;
    EXPECT_TRUE(it->second.bytes == t.bytes) << name << ": data differs";
  }
}

TEST_F(SafetensorsTest, FileFollowsThePublicFormatWithModelSpecNames) {
  const std::string path = dir_ + "/model.safetensors";
  ASSERT_TRUE(TrainAndExport(3, CkptRun{}, path, DType::kF32).ok());
  const std::string file = ReadAll(path);
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(file[8], '{');
  auto header = checkpoint::ParseSafetensorsFile(file);
  ASSERT_TRUE(header.ok()) << header.status();
  auto config = nn::GptConfig::FromName("nano");
  const std::vector<nn::ParamSpec> specs = nn::GptParamSpecs(*config);
  ASSERT_EQ(header->tensors.size(), specs.size());  // lm_head is tied: not stored again
  for (const nn::ParamSpec& spec : specs) {
    const checkpoint::SafetensorsTensor* t = header->Find(spec.name);
    ASSERT_NE(t, nullptr) << spec.name;
    EXPECT_EQ(t->shape, spec.shape) << spec.name;
    EXPECT_EQ(t->dtype, DType::kF32);
  }
  EXPECT_EQ(header->Find("lm_head.weight"), nullptr);
  EXPECT_EQ(header->data_start + 4 * config->num_parameters(), file.size());
  bool producer = false, format = false;
  for (const auto& [k, v] : header->metadata) {
    producer |= k == "producer" && v == "libfsdp test";
    format |= k == "format" && v == "pt";
  }
  EXPECT_TRUE(producer && format);
  // No temporary file is left next to it.
  for (const auto& e : fs::directory_iterator(dir_)) EXPECT_EQ(e.path(), path);
}

TEST_F(SafetensorsTest, Bf16RoundTripIsWithinBf16Rounding) {
  const std::string path = dir_ + "/model-bf16.safetensors";
  auto exported = TrainAndExport(2, CkptRun{}, path, DType::kBF16);
  ASSERT_TRUE(exported.ok()) << exported.status();
  auto config = nn::GptConfig::FromName("nano");
  EXPECT_LT(fs::file_size(path), 2 * config->num_parameters() + 8192);
  auto imported = Import(3, CkptRun{}, path);
  ASSERT_TRUE(imported.ok()) << imported.status();
  for (size_t u = 0; u < exported->size(); ++u) {
    for (size_t i = 0; i < (*exported)[u].size(); ++i) {
      const float want = Bf16ToFloat(FloatToBf16((*exported)[u][i]));
      ASSERT_EQ((*imported)[u][i], want) << "unit " << u << " element " << i;
    }
  }
}

TEST_F(SafetensorsTest, MismatchesAreErrors) {
  const std::string path = dir_ + "/model.safetensors";
  ASSERT_TRUE(TrainAndExport(2, CkptRun{}, path, DType::kF32).ok());
  CkptRun narrow;
  narrow.config = "nano-narrow";
  absl::Status s = Import(2, narrow, path).status();
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("tensor 'transformer.wte.weight' has shape [256, 64] in the file but "
                        "[256, 32] in this model"));
  // Truncated file: a clear error naming it.
  const std::string cut = dir_ + "/cut.safetensors";
  fs::copy_file(path, cut);
  fs::resize_file(cut, fs::file_size(cut) - 16);
  s = Import(2, CkptRun{}, cut).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("cut.safetensors: safetensors: the tensors cover"));
  // A file with an extra tensor: an error unless asked to ignore it.
  std::vector<checkpoint::SafetensorsTensor> tensors;
  auto header = checkpoint::ParseSafetensorsFile(ReadAll(path));
  ASSERT_TRUE(header.ok());
  tensors = header->tensors;
  tensors.push_back({"lm_head.weight", DType::kF32, {1}, 1, 0, 0});
  std::string extra = checkpoint::BuildSafetensorsHeader(tensors, {});
  const std::string data = ReadAll(path).substr(header->data_start);
  extra += data + std::string(4, '\0');
  std::ofstream(dir_ + "/extra.safetensors", std::ios::binary) << extra;
  s = Import(2, CkptRun{}, dir_ + "/extra.safetensors").status();
  EXPECT_THAT(std::string(s.message()), HasSubstr("holds tensor 'lm_head.weight'"));
  SafetensorsImportOptions ignore;
  ignore.ignore_extra_tensors = true;
  EXPECT_TRUE(Import(2, CkptRun{}, dir_ + "/extra.safetensors", ignore).ok());
}

}  // namespace
}  // namespace fsdp::testing
