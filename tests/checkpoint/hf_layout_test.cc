// The Hugging Face directory layout (ExportSafetensorsDirectory, ImportSafetensors of an index
// or a directory), ranks as threads: a Llama whose bf16 tensors exceed every rank's device
// memory exports on 8 ranks into several files with an index, each file within the limit and
// readable by an independent reader, and imports back on 3 ranks bitwise (f32) from the
// directory and from the index; the export's device and host memory stay within one unit; an
// earlier export is replaced, anything else is not; a damaged or inconsistent index is an error
// naming the file and the tensor; a directory written by transformers imports, and libfsdp's
// export of it holds the same tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "absl/strings/str_format.h"
#include "src/core/json.h"
#include "tests/checkpoint/ckpt_util.h"
#include "tests/checkpoint/safetensors_ref_reader.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

// llama-nano with 12 layers: about 0.58 M parameters, a block unit 46 K of them.
nn::LlamaConfig TestLlama() {
  nn::LlamaConfig c = *nn::LlamaConfig::FromName("llama-nano");
  c.num_layers = 12;
  return c;
}

int64_t LargestUnitBytes(ShardingRuntime& rt) {
  int64_t largest = 0;
  for (int u = 0; u < rt.num_units(); ++u) largest = std::max(largest, rt.unit_numel(u) * 4);
  return largest;
}

struct Exported {
  std::vector<std::vector<float>> params;
  SafetensorsExportReport report;
  int64_t device_limit = 0, model_bf16_bytes = 0, largest_unit = 0, export_device_peak = 0;
};

// A model on `world` ranks (FULL_SHARD, SGD: no optimizer state), exported to `dir`. On 8
// ranks each has 9/10 of the model's bf16 bytes as its device memory.
absl::StatusOr<Exported> MakeAndExport(int world, const std::string& dir,
                                       SafetensorsExportOptions options) {
  Exported out;
  const nn::LlamaConfig config = TestLlama();
  out.model_bf16_bytes = config.num_parameters() * 2;
  out.device_limit = world >= 8 ? out.model_bf16_bytes * 9 / 10 : 0;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1,
                                                            .memory_limit_bytes = out.device_limit}));
    nn::ShardedModelOptions o;
    o.sharding.optimizer = OptimizerKind::kSgd;
    o.batch_size = 1;
    o.seq_len = 4;
    FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(config, backend.get(), comm, o));
    ShardingRuntime& rt = model->runtime();
    backend->ResetPeak();
    const int64_t before = backend->memory_stats().bytes_in_use;
    FSDP_ASSIGN_OR_RETURN(SafetensorsExportReport report,
                          ExportSafetensorsDirectory(rt, dir, options));
    const int64_t peak = backend->memory_stats().peak_bytes - before;
    FSDP_ASSIGN_OR_RETURN(auto p, model->GatherModelUnits());
    if (comm.rank() == 0) {
      out.params = std::move(p);
      out.report = report;
      out.largest_unit = LargestUnitBytes(rt);
      out.export_device_peak = peak;
    }
    return absl::OkStatus();
  }));
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> Import(int world, const std::string& path) {
  std::vector<std::vector<float>> params;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    nn::ShardedModelOptions o;
    o.sharding.strategy = ShardingStrategy::kShardGradOp;
    o.seed = 5;
    o.batch_size = 1;
    o.seq_len = 16;
    FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(TestLlama(), backend.get(), comm, o));
    FSDP_RETURN_IF_ERROR(ImportSafetensors(model->runtime(), path));
    FSDP_ASSIGN_OR_RETURN(auto p, model->GatherModelUnits());
    if (comm.rank() == 0) params = std::move(p);
    return absl::OkStatus();
  }));
  return params;
}


std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

class HfLayoutTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/fsdp_hf_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
};

TEST_F(HfLayoutTest, ShardedExportOfAModelLargerThanARanksMemoryImportsBackBitwise) {
  const std::string out = dir_ + "/export";
  SafetensorsExportOptions o;
  o.max_file_bytes = 256 << 10;  // bytes of f32: several files
  o.max_host_bytes = 1 << 20;
  o.extra_files["config.json"] = TestLlama().HuggingFaceConfigJson(DType::kF32);
  auto ex = MakeAndExport(8, out, o);
  ASSERT_TRUE(ex.ok()) << ex.status();
  std::printf("llama-nano L=12 (%lld bf16 bytes) on 8 ranks of %lld bytes of device memory: "
              "%d files, %llu bytes; export peak per rank: device %lld bytes, host %llu bytes "
              "(largest unit gathered: %lld bytes)\n",
              static_cast<long long>(ex->model_bf16_bytes),
              static_cast<long long>(ex->device_limit), ex->report.files,
              static_cast<unsigned long long>(ex->report.total_size),
              static_cast<long long>(ex->export_device_peak),
              static_cast<unsigned long long>(ex->report.host_bytes_per_rank),
              static_cast<long long>(ex->largest_unit));
  EXPECT_GT(ex->model_bf16_bytes, ex->device_limit) << "the model fits a rank: not the case";
  EXPECT_LE(ex->export_device_peak, ex->largest_unit) << "the export held more than one unit";
  EXPECT_LE(ex->report.host_bytes_per_rank, static_cast<uint64_t>(2 * ex->largest_unit));
  ASSERT_GT(ex->report.files, 2);

  // The directory: the files, the index, config.json, nothing else.
  std::set<std::string> want = {"model.safetensors.index.json", "config.json"};
  for (int k = 1; k <= ex->report.files; ++k) {
    want.insert(absl::StrFormat("model-%05d-of-%05d.safetensors", k, ex->report.files));
  }
  EXPECT_EQ(Entries(out), want);
  auto index = json::Parse(ReadAll(out + "/model.safetensors.index.json"));
  ASSERT_TRUE(index.ok()) << index.status();
  const json::Value* total = index->Find("metadata")->Find("total_size");
  ASSERT_NE(total, nullptr);
  EXPECT_EQ(static_cast<uint64_t>(total->int_value()), ex->report.total_size);
  const json::Value* map = index->Find("weight_map");
  ASSERT_NE(map, nullptr);
  EXPECT_TRUE(std::is_sorted(map->keys().begin(), map->keys().end()));
  // Every file: the public format, within the limit (or one tensor), its tensors mapped to it.
  uint64_t bytes = 0;
  size_t tensors = 0;
  for (int k = 1; k <= ex->report.files; ++k) {
    const std::string name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", k, ex->report.files);
    auto f = ref_st::Parse(ReadAll(out + "/" + name));
    ASSERT_TRUE(f.ok()) << name << ": " << f.status();
    uint64_t data = 0;
    for (const auto& [t, v] : f->tensors) {
      data += v.end - v.begin;
      EXPECT_EQ(v.dtype, "F32");
      const json::Value* mapped = map->Find(t);
      ASSERT_NE(mapped, nullptr) << t;
      EXPECT_EQ(mapped->str(), name) << t;
    }
    EXPECT_TRUE(data <= o.max_file_bytes || f->tensors.size() == 1) << name << ": " << data;
    bytes += data;
    tensors += f->tensors.size();
  }
  EXPECT_EQ(bytes, ex->report.total_size);
  EXPECT_EQ(tensors, map->keys().size());
  auto config = json::Parse(ReadAll(out + "/config.json"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->Find("num_hidden_layers")->int_value(), 12);
  EXPECT_EQ(config->Find("num_key_value_heads")->int_value(), TestLlama().num_kv_heads);
  EXPECT_EQ(config->Find("model_type")->str(), "llama");

  // Back on 3 ranks, from the directory and from the index: bitwise.
  for (const std::string& from : {out, out + "/model.safetensors.index.json"}) {
    auto back = Import(3, from);
    ASSERT_TRUE(back.ok()) << from << ": " << back.status();
    EXPECT_TRUE(BitEqual(*back, ex->params)) << from;
  }

  // Exported again with one file: model.safetensors alone replaces the earlier export.
  o.max_file_bytes = 5'000'000'000;
  o.extra_files.clear();
  auto again = MakeAndExport(8, out, o);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->report.files, 1);
  EXPECT_EQ(Entries(out), std::set<std::string>{"model.safetensors"});
  auto single = Import(3, out);
  ASSERT_TRUE(single.ok()) << single.status();
  EXPECT_TRUE(BitEqual(*single, again->params));
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string(), "export") << "left behind";
  }
}

TEST_F(HfLayoutTest, OnlyAnEarlierExportIsReplacedAndTheHostBoundIsKept) {
  SafetensorsExportOptions o;
  o.max_file_bytes = 64 << 10;
  // A directory holding a file of the user's: refused, the file kept.
  const std::string mine = dir_ + "/mine";
  fs::create_directories(mine);
  std::ofstream(mine + "/notes.txt") << "keep";
  auto refused = MakeAndExport(2, mine, o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("notes.txt"));
  EXPECT_EQ(Entries(mine), std::set<std::string>{"notes.txt"});
  // A regular file where the directory would go.
  const std::string file = dir_ + "/file";
  std::ofstream(file) << "x";
  refused = MakeAndExport(2, file, o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("not a directory"));
  // Host memory below what one unit needs: refused before anything is written.
  o.max_host_bytes = 1000;
  refused = MakeAndExport(2, dir_ + "/small", o);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()), HasSubstr("max_host_bytes"));
  EXPECT_FALSE(fs::exists(dir_ + "/small"));
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << "left behind";
  }
}

// A damaged or inconsistent index: each an error on every rank naming the file and the tensor,
// nothing imported.
TEST_F(HfLayoutTest, BadIndexesAreErrorsNamingTheFileAndTheTensor) {
  const std::string good = dir_ + "/good";
  SafetensorsExportOptions o;
  o.max_file_bytes = 64 << 10;
  ASSERT_TRUE(MakeAndExport(2, good, o).ok());
  const std::string index_name = "model.safetensors.index.json";
  const std::string text = ReadAll(good + "/" + index_name);
  auto index = json::Parse(text);
  ASSERT_TRUE(index.ok());
  const json::Value* map = index->Find("weight_map");
  const std::string first = map->keys().front(), first_file = map->items().front().str();
  // A second file's name and one of its tensors.
  std::string other_file, other_tensor;
  for (size_t i = 0; i < map->keys().size(); ++i) {
    if (map->items()[i].str() != first_file) {
      other_file = map->items()[i].str();
      other_tensor = map->keys()[i];
      break;
    }
  }
  ASSERT_FALSE(other_file.empty());
  auto replace = [](std::string s, const std::string& from, const std::string& to) {
    const size_t at = s.find(from);
    return at == std::string::npos ? s : s.replace(at, from.size(), to);
  };
  const std::string total = std::to_string(index->Find("metadata")->Find("total_size")->int_value());
  struct Case {
    const char* what;
    std::function<void(const std::string& d)> apply;
    std::vector<std::string> says;
  };
  const std::vector<Case> cases = {
      {"a file of the weight_map missing",
       [&](const std::string& d) { fs::remove(d + "/" + other_file); },
       {other_file, "'" + other_tensor + "'"}},
      {"a tensor mapped to a file that lacks it",
       [&](const std::string& d) {
         std::ofstream(d + "/" + index_name, std::ios::trunc)
             << replace(text, "\"" + first + "\":\"" + first_file + "\"",
                        "\"" + first + "\":\"" + other_file + "\"");
       },
       {"'" + first + "'", other_file}},
      {"a tensor in two files",
       [&](const std::string& d) {
         fs::copy_file(d + "/" + first_file, d + "/extra.safetensors");
         std::ofstream(d + "/" + index_name, std::ios::trunc)
             << replace(text, "}}", ",\"zz.extra\":\"extra.safetensors\"}}");
       },
       {"(shards overlap)", "extra.safetensors"}},
      {"the total size wrong",
       [&](const std::string& d) {
         std::ofstream(d + "/" + index_name, std::ios::trunc)
             << replace(text, "\"total_size\":" + total, "\"total_size\":" + total + "0");
       },
       {index_name, "total_size"}},
      {"a file outside the directory",
       [&](const std::string& d) {
         std::ofstream(d + "/" + index_name, std::ios::trunc)
             << replace(text, "\"" + first + "\":\"" + first_file + "\"",
                        "\"" + first + "\":\"../" + first_file + "\"");
       },
       {"'" + first + "'", "not a name in the index's directory"}},
      {"two indexes",
       [&](const std::string& d) { fs::copy_file(d + "/" + index_name, d + "/b.index.json"); },
       {"more than one index", "b.index.json"}},
      {"no index and several files",
       [&](const std::string& d) { fs::remove(d + "/" + index_name); },
       {"no model.safetensors.index.json"}},
      {"not JSON",
       [&](const std::string& d) {
         std::ofstream(d + "/" + index_name, std::ios::trunc) << "{\"weight_map\": ";
       },
       {index_name}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    const std::string d = dir_ + "/bad";
    fs::remove_all(d);
    fs::copy(good, d);
    c.apply(d);
    auto r = Import(2, d);
    ASSERT_FALSE(r.ok());
    for (const std::string& s : c.says) {
      EXPECT_THAT(std::string(r.status().message()), HasSubstr(s));
    }
  }
}

// A directory written by transformers' save_pretrained (tests/checkpoint/golden/
// tiny_llama_hf_sharded: 6 files of at most 4 KB, the index, config.json; made by
// make_hf_sharded_golden.py from the model of tests/nn/golden/make_llama_golden.py) imports on
// 2 ranks bitwise as that model's single-file state_dict does and computes transformers' loss.
// Exported again by libfsdp in files of at most 4000 bytes: the same tensors, bitwise, the
// same total_size and total_parameters, each file within the limit.
TEST_F(HfLayoutTest, ShardedDirectoryFromTransformersImportsAndExportsBack) {
  const std::string source = std::string(FSDP_SOURCE_DIR) + "/tests/";
  const std::string golden = source + "checkpoint/golden/tiny_llama_hf_sharded";
  auto expect = ref_st::Parse(ReadAll(source + "nn/golden/tiny_llama_hf.safetensors"));
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
  const int world = 2, T = 8;
  const std::string out = dir_ + "/out";
  std::vector<float> losses(world);
  std::vector<std::vector<float>> from_dir, from_file;
  absl::Status s = LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    nn::ShardedModelOptions o;
    o.batch_size = 1;
    o.seq_len = T;
    FSDP_ASSIGN_OR_RETURN(auto model, nn::ShardedModel::Create(config, backend.get(), comm, o));
    FSDP_RETURN_IF_ERROR(ImportSafetensors(model->runtime(), golden));
    const int r = comm.rank();
    FSDP_ASSIGN_OR_RETURN(float loss, model->Forward(idx.data() + r * T, tgt.data() + r * T));
    FSDP_ASSIGN_OR_RETURN(losses[r], model->MeanOverRanks(loss));
    FSDP_ASSIGN_OR_RETURN(auto a, model->GatherModelUnits());
    SafetensorsExportOptions e;
    e.max_file_bytes = 4000;
    FSDP_RETURN_IF_ERROR(ExportSafetensorsDirectory(model->runtime(), out, e).status());
    FSDP_RETURN_IF_ERROR(ImportSafetensors(
        model->runtime(), source + "nn/golden/tiny_llama_hf_model.safetensors"));
    FSDP_ASSIGN_OR_RETURN(auto b, model->GatherModelUnits());
    if (r == 0) {
      from_dir = std::move(a);
      from_file = std::move(b);
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(s.ok()) << s;
  for (float l : losses) EXPECT_NEAR(l, want_loss, 2e-6 * want_loss);
  EXPECT_TRUE(BitEqual(from_dir, from_file)) << "the directory and the file differ";

  auto theirs = json::Parse(ReadAll(golden + "/model.safetensors.index.json"));
  auto ours = json::Parse(ReadAll(out + "/model.safetensors.index.json"));
  ASSERT_TRUE(theirs.ok() && ours.ok());
  for (const char* key : {"total_size", "total_parameters"}) {
    EXPECT_EQ(ours->Find("metadata")->Find(key)->int_value(),
              theirs->Find("metadata")->Find(key)->int_value())
        << key;
  }
  const json::Value* their_map = theirs->Find("weight_map");
  const json::Value* our_map = ours->Find("weight_map");
  EXPECT_EQ(our_map->keys(), their_map->keys());
  std::map<std::string, ref_st::File> files;
  auto tensor = [&](const std::string& dir, const json::Value* map,
                    const std::string& name) -> const ref_st::Tensor* {
    const std::string path = dir + "/" + map->Find(name)->str();
    if (!files.count(path)) {
      auto f = ref_st::Parse(ReadAll(path));
      if (!f.ok()) return nullptr;
      files.emplace(path, *std::move(f));
    }
    auto it = files.at(path).tensors.find(name);
    return it == files.at(path).tensors.end() ? nullptr : &it->second;
  };
  for (const std::string& name : their_map->keys()) {
    const ref_st::Tensor* a = tensor(golden, their_map, name);
    const ref_st::Tensor* b = tensor(out, our_map, name);
    ASSERT_TRUE(a != nullptr && b != nullptr) << name;
    EXPECT_EQ(b->dtype, a->dtype) << name;
    EXPECT_EQ(b->shape, a->shape) << name;
    EXPECT_TRUE(b->bytes == a->bytes) << name << ": data differs";
  }
  for (const auto& e : fs::directory_iterator(out)) {
    if (e.path().extension() != ".safetensors") continue;
    auto f = ref_st::Parse(ReadAll(e.path().string()));
    ASSERT_TRUE(f.ok());
    uint64_t data = 0;
    for (const auto& [n, t] : f->tensors) data += t.end - t.begin;
    EXPECT_TRUE(data <= 4000 || f->tensors.size() == 1) << e.path() << ": " << data;
  }
}

}  // namespace
}  // namespace fsdp::testing
