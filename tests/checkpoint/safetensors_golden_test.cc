// The safetensors export against a golden file written by an independent implementation:
// tests/checkpoint/golden/tiny_gpt_f32.safetensors, made by golden/make_golden.py with the
// reference `safetensors` Python library from MODEL_SPEC.md's names and shapes and a formula
// for the values. A tiny GPT (V=16, T=8, L=2, H=2, C=8) with its parameters set to the same
// formula is exported on 2 ranks and the two files are compared tensor by tensor (names,
// dtype, shape, bitwise data, metadata); then the golden file is imported on 3 ranks and the
// model's values are checked against the formula. Python never runs here: the golden file is
// committed (see make_golden.py for how it was produced).
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/checkpoint/ckpt_util.h"
#include "tests/checkpoint/safetensors_ref_reader.h"

#ifndef FSDP_SOURCE_DIR
#error "FSDP_SOURCE_DIR must be defined (tests/checkpoint/CMakeLists.txt)"
#endif

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

std::string GoldenPath() {
  return std::string(FSDP_SOURCE_DIR) + "/tests/checkpoint/golden/tiny_gpt_f32.safetensors";
}

// The model of make_golden.py.
constexpr int kV = 16, kT = 8, kL = 2, kH = 2, kC = 8;

nn::GptConfig TinyConfig() {
  nn::GptConfig c;
  c.name = "tiny-golden";
  c.vocab_size = kV;
  c.block_size = kT;
  c.num_layers = kL;
  c.num_heads = kH;
  c.channels = kC;
  return c;
}

// The header metadata both writers set ("format": "pt" is added by libfsdp's exporter).
const std::map<std::string, std::string>& GoldenMetadata() {
  static const auto* m = new std::map<std::string, std::string>{
      {"format", "pt"},
      {"producer", "libfsdp golden test"},
      {"config", "V=16 T=8 L=2 H=2 C=8"},
      {"formula", "(-1)^(t+i) * ((t+1)*1024 + i) * 2^-(6 + i%5)"},
  };
  return *m;
}

// (name, shape) in MODEL_SPEC.md order, written out from the spec (as make_golden.py does),
// not taken from the library's GptParamSpecs.
std::vector<std::pair<std::string, std::vector<int64_t>>> ModelSpecTensors() {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out = {
      {"transformer.wte.weight", {kV, kC}}, {"transformer.wpe.weight", {kT, kC}}};
  for (int i = 0; i < kL; ++i) {
    const std::string p = absl::StrCat("transformer.h.", i, ".");
    out.push_back({p + "ln_1.weight", {kC}});
    out.push_back({p + "ln_1.bias", {kC}});
    out.push_back({p + "attn.c_attn.weight", {3 * kC, kC}});
    out.push_back({p + "attn.c_attn.bias", {3 * kC}});
    out.push_back({p + "attn.c_proj.weight", {kC, kC}});
    out.push_back({p + "attn.c_proj.bias", {kC}});
    out.push_back({p + "ln_2.weight", {kC}});
    out.push_back({p + "ln_2.bias", {kC}});
    out.push_back({p + "mlp.c_fc.weight", {4 * kC, kC}});
    out.push_back({p + "mlp.c_fc.bias", {4 * kC}});
    out.push_back({p + "mlp.c_proj.weight", {kC, 4 * kC}});
    out.push_back({p + "mlp.c_proj.bias", {kC}});
  }
  out.push_back({"transformer.ln_f.weight", {kC}});
  out.push_back({"transformer.ln_f.bias", {kC}});
  return out;
}

// make_golden.py's value(t, i) = (-1)^(t + i) * ((t + 1) * 1024 + i) * 2^-(6 + i % 5): exact.
float Formula(int64_t t, int64_t i) {
  const float magnitude =
      std::ldexp(static_cast<float>((t + 1) * 1024 + i), -static_cast<int>(6 + i % 5));
  return (t + i) % 2 == 1 ? -magnitude : magnitude;
}

struct Expected {
  std::vector<int64_t> shape;
  std::vector<float> values;
};
using Expectation = std::map<std::string, Expected>;

// The formula's tensors; `swap` exchanges the formula indices of two tensors (to show that
// a wrong expectation is detected).
Expectation FormulaTensors(const std::pair<std::string, std::string>& swap = {}) {
  const auto specs = ModelSpecTensors();
  Expectation out;
  for (size_t t = 0; t < specs.size(); ++t) {
    const auto& [name, shape] = specs[t];
    size_t index = t;
    for (size_t o = 0; o < specs.size(); ++o) {
      if ((name == swap.first && specs[o].first == swap.second) ||
          (name == swap.second && specs[o].first == swap.first)) {
        index = o;
      }
    }
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    Expected e{shape, std::vector<float>(n)};
    for (int64_t i = 0; i < n; ++i) e.values[i] = Formula(static_cast<int64_t>(index), i);
    out.emplace(name, std::move(e));
  }
  return out;
}

// The model's units (GptParamSpecs layout) holding `want`.
std::vector<std::vector<float>> UnitsOf(const Expectation& want) {
  const nn::GptConfig config = TinyConfig();
  std::vector<std::vector<float>> units(nn::GptNumUnits(config));
  for (int u = 0; u < nn::GptNumUnits(config); ++u) units[u].assign(nn::GptUnitNumel(config, u), 0);
  for (const nn::ParamSpec& spec : nn::GptParamSpecs(config)) {
    const Expected& e = want.at(spec.name);
    std::copy(e.values.begin(), e.values.end(), units[spec.unit].begin() + spec.offset);
  }
  return units;
}

// Problems of an F32 file against an expectation (empty: none).
std::vector<std::string> CheckFile(const ref_st::File& f, const Expectation& want) {
  std::vector<std::string> problems;
  for (const auto& [name, e] : want) {
    auto it = f.tensors.find(name);
    if (it == f.tensors.end()) {
      problems.push_back(name + ": missing");
      continue;
    }
    if (it->second.dtype != "F32") problems.push_back(name + ": dtype " + it->second.dtype);
    if (it->second.shape != e.shape) {
      problems.push_back(name + ": shape differs");
      continue;
    }
    if (it->second.dtype != "F32") continue;
    const std::vector<float> got = ref_st::F32Values(it->second);
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &e.values[i], 4) != 0) {
        problems.push_back(absl::StrCat(name, ": element ", i, " is ", ref_st::Show(got[i]),
                                        ", want ", ref_st::Show(e.values[i])));
        break;
      }
    }
  }
  for (const auto& [name, t] : f.tensors) {
    if (!want.count(name)) problems.push_back(name + ": extra tensor");
  }
  return problems;
}

// Problems of file `a` against file `b`, semantically: names, dtypes, shapes, the bytes of
// each tensor, the metadata.
std::vector<std::string> CompareFiles(const ref_st::File& a, const ref_st::File& b) {
  std::vector<std::string> problems;
  for (const auto& [name, ta] : a.tensors) {
    auto it = b.tensors.find(name);
    if (it == b.tensors.end()) {
      problems.push_back(name + ": only in the first file");
      continue;
    }
    const ref_st::Tensor& tb = it->second;
    if (ta.dtype != tb.dtype) problems.push_back(name + ": dtype " + ta.dtype + " vs " + tb.dtype);
    if (ta.shape != tb.shape) problems.push_back(name + ": shapes differ");
    if (ta.bytes != tb.bytes) {
      size_t i = 0;
      while (i < std::min(ta.bytes.size(), tb.bytes.size()) && ta.bytes[i] == tb.bytes[i]) ++i;
      problems.push_back(absl::StrCat(name, ": data differs from byte ", i));
    }
  }
  for (const auto& [name, tb] : b.tensors) {
    if (!a.tensors.count(name)) problems.push_back(name + ": only in the second file");
  }
  if (a.metadata != b.metadata) problems.push_back("__metadata__ differs");
  return problems;
}

// Problems of a model's gathered units against an expectation, by GptParamSpecs.
std::vector<std::string> CheckUnits(const std::vector<std::vector<float>>& units,
                                    const Expectation& want) {
  std::vector<std::string> problems;
  for (const nn::ParamSpec& spec : nn::GptParamSpecs(TinyConfig())) {
    const std::vector<float>& e = want.at(spec.name).values;
    const float* got = units.at(spec.unit).data() + spec.offset;
    for (int64_t i = 0; i < spec.numel; ++i) {
      if (std::memcmp(&got[i], &e[i], 4) != 0) {
        problems.push_back(absl::StrCat(spec.name, ": element ", i, " is ", ref_st::Show(got[i]),
                                        ", want ", ref_st::Show(e[i])));
        break;
      }
    }
  }
  return problems;
}

absl::StatusOr<std::unique_ptr<nn::ShardedGpt>> MakeTiny(Communicator& comm, Backend* backend,
                                                         const nn::WrapPolicy& wrap) {
  nn::ShardedGptOptions o;
  o.sharding.strategy = ShardingStrategy::kFullShard;
  o.batch_size = 1;
  o.seq_len = kT;
  o.wrap = wrap;
  o.seed = 99;
  return nn::ShardedGpt::Create(TinyConfig(), backend, comm, o);
}

// Sets this rank's shards of a model of one runtime unit per model unit (the default wrap
// policy) so that the model holds `units`: shard k of a unit is elements
// [k * shard_numel, (k + 1) * shard_numel) of its flat buffer, zero-padded. The caller checks
// the result with GatherModelUnits.
absl::Status SetUnits(nn::ShardedGpt& model, const std::vector<std::vector<float>>& units) {
  ShardingRuntime& rt = model.runtime();
  const int k = rt.shard_group().rank();
  for (size_t m = 0; m < units.size(); ++m) {
    const int u = model.module_unit()[m];
    if (u != static_cast<int>(m) || rt.unit_numel(u) != static_cast<int64_t>(units[m].size())) {
      return absl::InternalError("SetUnits needs one runtime unit per model unit");
    }
    const int64_t sn = rt.unit_shard_numel(u);
    std::vector<float> shard(sn, 0.0f);
    for (int64_t i = 0; i < sn; ++i) {
      const int64_t g = k * sn + i;
      if (g < static_cast<int64_t>(units[m].size())) shard[i] = units[m][g];
    }
    FSDP_RETURN_IF_ERROR(rt.backend()->CopyFromHost(rt.param_shard(u), shard.data()));
  }
  return absl::OkStatus();
}

// A tiny model holding the formula's values, exported to `path` on `world` ranks.
absl::Status ExportFormulaModel(int world, const std::string& path) {
  const std::vector<std::vector<float>> units = UnitsOf(FormulaTensors());
  return LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    FSDP_ASSIGN_OR_RETURN(auto model, MakeTiny(comm, backend.get(), {}));
    FSDP_RETURN_IF_ERROR(SetUnits(*model, units));
    FSDP_ASSIGN_OR_RETURN(auto gathered, model->GatherModelUnits());
    if (gathered != units) return absl::InternalError("setting the parameters did not work");
    SafetensorsExportOptions o;
    for (const auto& [k, v] : GoldenMetadata()) {
      if (k != "format") o.metadata[k] = v;  // the exporter adds "format": "pt" itself
    }
    return ExportSafetensors(model->runtime(), path, o);
  });
}

// A fresh tiny model (its own seeded init) on `world` ranks imports `path`; its units.
absl::StatusOr<std::vector<std::vector<float>>> ImportTiny(int world, const std::string& path) {
  std::vector<std::vector<float>> units;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    nn::WrapPolicy wrap;  // block 1 joins the root unit: another layout than the export's
    wrap.kind = nn::WrapPolicy::Kind::kExplicit;
    wrap.modules = {"transformer.h.0"};
    FSDP_ASSIGN_OR_RETURN(auto model, MakeTiny(comm, backend.get(), wrap));
    FSDP_RETURN_IF_ERROR(ImportSafetensors(model->runtime(), path));
    FSDP_ASSIGN_OR_RETURN(auto p, model->GatherModelUnits());
    if (comm.rank() == 0) units = std::move(p);
    return absl::OkStatus();
  }));
  return units;
}

class SafetensorsGoldenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/fsdp_stg_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    auto golden = ref_st::Parse(ReadAll(GoldenPath()));
    ASSERT_TRUE(golden.ok()) << GoldenPath() << ": " << golden.status();
    golden_ = std::move(*golden);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_;
  ref_st::File golden_;
};

TEST_F(SafetensorsGoldenTest, GoldenFileHoldsTheFormulaUnderModelSpecNames) {
  // The hand-written MODEL_SPEC.md list agrees with the library's specs (names and shapes).
  std::map<std::string, std::vector<int64_t>> spec_list, library;
  for (const auto& [name, shape] : ModelSpecTensors()) spec_list[name] = shape;
  for (const nn::ParamSpec& s : nn::GptParamSpecs(TinyConfig())) library[s.name] = s.shape;
  EXPECT_EQ(spec_list, library);
  EXPECT_EQ(spec_list.size(), 4u + 12u * kL);
  // The golden file (reference writer) holds exactly the formula (C++ and Python agree).
  EXPECT_EQ(golden_.header_len % 8, 0u);
  EXPECT_THAT(CheckFile(golden_, FormulaTensors()), IsEmpty());
  EXPECT_EQ(golden_.metadata, GoldenMetadata());
  EXPECT_LT(golden_.raw.size(), 20000u);
}

TEST_F(SafetensorsGoldenTest, ExportOnTwoRanksEqualsTheGoldenFile) {
  const std::string path = dir_ + "/tiny.safetensors";
  const absl::Status exported_ok = ExportFormulaModel(2, path);
  ASSERT_TRUE(exported_ok.ok()) << exported_ok;
  auto exported = ref_st::Parse(ReadAll(path));
  ASSERT_TRUE(exported.ok()) << exported.status();
  // libfsdp adds the model's configuration (kSafetensorsModelKeyPrefix keys): compared apart.
  std::map<std::string, std::string> model;
  for (auto it = exported->metadata.begin(); it != exported->metadata.end();) {
    if (it->first.starts_with(kSafetensorsModelKeyPrefix)) {
      model[it->first.substr(std::string_view(kSafetensorsModelKeyPrefix).size())] = it->second;
      it = exported->metadata.erase(it);
    } else {
      ++it;
    }
  }
  const auto described = nn::ModelConfig(TinyConfig()).Describe();
  EXPECT_EQ(model, (std::map<std::string, std::string>(described.begin(), described.end())));
  EXPECT_THAT(CompareFiles(*exported, golden_), IsEmpty());
  EXPECT_THAT(CheckFile(*exported, FormulaTensors()), IsEmpty());
  EXPECT_EQ(exported->metadata, GoldenMetadata());
  // Equal as safetensors files, not byte for byte (so no whole-file comparison): the
  // reference library orders the tensors by dtype and name (in the header and in the data
  // section) and the metadata in hash-map order; libfsdp writes the tensors in unit order and
  // the metadata sorted by key.
  EXPECT_EQ(exported->data_bytes(), golden_.data_bytes());
}

TEST_F(SafetensorsGoldenTest, GoldenFileImportsOnThreeRanks) {
  auto units = ImportTiny(3, GoldenPath());
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_THAT(CheckUnits(*units, FormulaTensors()), IsEmpty());
  EXPECT_EQ(*units, UnitsOf(FormulaTensors()));
}

// The comparisons above can fail: a corrupted copy of the golden file, a wrong expectation
// and other metadata are all reported, naming the tensor.
TEST_F(SafetensorsGoldenTest, ComparisonsDetectCorruptionAndSwaps) {
  const std::string c_fc = "transformer.h.1.mlp.c_fc.weight";
  // One bit of one value of c_fc flipped (element 37).
  std::string corrupt = golden_.raw;
  corrupt[8 + golden_.header_len + golden_.tensors.at(c_fc).begin + 37 * 4] ^= 0x01;
  auto bad = ref_st::Parse(corrupt);
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_THAT(CompareFiles(*bad, golden_), ElementsAre(c_fc + ": data differs from byte 148"));
  EXPECT_THAT(CheckFile(*bad, FormulaTensors()), ElementsAre(HasSubstr(c_fc + ": element 37 ")));
  // ... and imported: the model's values differ from the formula there.
  const std::string bad_path = dir_ + "/corrupt.safetensors";
  std::ofstream(bad_path, std::ios::binary) << corrupt;
  auto units = ImportTiny(3, bad_path);
  ASSERT_TRUE(units.ok()) << units.status();
  EXPECT_THAT(CheckUnits(*units, FormulaTensors()), ElementsAre(HasSubstr(c_fc + ": element 37 ")));

  // An expectation with two same-shaped tensors' values swapped.
  const Expectation swapped =
      FormulaTensors({"transformer.h.0.ln_1.weight", "transformer.h.0.ln_1.bias"});
  EXPECT_THAT(CheckFile(golden_, swapped),
              UnorderedElementsAre(HasSubstr("transformer.h.0.ln_1.weight: element 0 "),
                                   HasSubstr("transformer.h.0.ln_1.bias: element 0 ")));
  auto good = ImportTiny(3, GoldenPath());
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_THAT(CheckUnits(*good, swapped), Contains(HasSubstr("transformer.h.0.ln_1.bias")));

  // Two names swapped in the header (the data left in place), and a metadata value changed.
  std::string renamed = golden_.raw;
  const std::string a = "\"transformer.h.0.attn.c_proj.weight\"";
  const std::string b = "\"transformer.h.1.attn.c_proj.weight\"";
  const size_t pa = renamed.find(a), pb = renamed.find(b);
  ASSERT_NE(pa, std::string::npos);
  ASSERT_NE(pb, std::string::npos);
  renamed.replace(pa, a.size(), b);
  renamed.replace(pb, b.size(), a);
  auto r = ref_st::Parse(renamed);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_THAT(CompareFiles(*r, golden_),
              UnorderedElementsAre(HasSubstr("transformer.h.0.attn.c_proj.weight: data differs"),
                                   HasSubstr("transformer.h.1.attn.c_proj.weight: data differs")));
  std::string meta = golden_.raw;
  const size_t pm = meta.find("libfsdp golden test");
  ASSERT_NE(pm, std::string::npos);
  meta[pm] = 'L';
  auto m = ref_st::Parse(meta);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(CompareFiles(*m, golden_), ElementsAre("__metadata__ differs"));
}

}  // namespace
}  // namespace fsdp::testing
