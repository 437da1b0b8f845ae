// The safetensors export checked by value, not by a round trip through the library's own
// name <-> slot mapping: a nano GPT trained a few steps on 2 and on 3 ranks (threads) is
// exported in F32 and BF16, the file is parsed by the test's own reader
// (safetensors_ref_reader.h, no code of src/checkpoint), and every MODEL_SPEC.md tensor is
// compared with the values the model itself holds under that name: ShardedGpt's
// GatherModelUnits() (the model's flat units) at the ParamSpec's unit and offset. A swap of
// two names, or a tensor written at another offset, on both export and import, fails here.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "tests/checkpoint/ckpt_util.h"
#include "tests/checkpoint/safetensors_ref_reader.h"

namespace fsdp::testing {
namespace {

namespace fs = std::filesystem;
using ::testing::Contains;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

struct Layout {
  int world = 2;
  nn::WrapPolicy wrap;  // the runtime units (unit offsets differ from the model's otherwise)
};

// Trains the nano GPT 3 steps on `layout.world` ranks, exports it to `f32_path` and
// `bf16_path`, and returns the model's units (GatherModelUnits, GptParamSpecs order).
absl::StatusOr<std::vector<std::vector<float>>> TrainAndExportBoth(const Layout& layout,
                                                                   const std::string& f32_path,
                                                                   const std::string& bf16_path) {
  std::vector<std::vector<float>> units;
  const int world = layout.world;
  FSDP_RETURN_IF_ERROR(LocalWorld::Run(world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
    CkptRun run;
    run.wrap = layout.wrap;
    FSDP_ASSIGN_OR_RETURN(auto model, MakeModel(comm, backend.get(), run));
    for (int s = 0; s < 3; ++s) {
      nn::Batch b = RankBatch(TrainSpec{}, comm.rank(), world, s, 0);
      FSDP_RETURN_IF_ERROR(model->ForwardBackward(b.inputs.data(), b.targets.data()).status());
      FSDP_RETURN_IF_ERROR(model->Step(1e-2f).status());
    }
    SafetensorsExportOptions o;
    o.metadata["producer"] = "by-value test";
    o.dtype = DType::kF32;
    FSDP_RETURN_IF_ERROR(ExportSafetensors(model->runtime(), f32_path, o));
    o.dtype = DType::kBF16;
    FSDP_RETURN_IF_ERROR(ExportSafetensors(model->runtime(), bf16_path, o));
    FSDP_ASSIGN_OR_RETURN(auto p, model->GatherModelUnits());
    if (comm.rank() == 0) units = std::move(p);
    return absl::OkStatus();
  }));
  return units;
}

std::string ShapeStr(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) absl::StrAppend(&out, i ? ", " : "", s[i]);
  return out + "]";
}

// Every problem of `file` against the model's `units` (empty: the file is right): each
// GptParamSpecs tensor present with its shape and dtype and its values (F32: bitwise; BF16:
// the round-to-nearest-even bf16 of the f32 value), and no other tensor.
std::vector<std::string> CheckByValue(const ref_st::File& file, const nn::GptConfig& config,
                                      const std::vector<std::vector<float>>& units, DType dtype) {
  std::vector<std::string> problems;
  const std::string want_dtype = dtype == DType::kF32 ? "F32" : "BF16";
  std::set<std::string> names;
  for (const nn::ParamSpec& spec : nn::GptParamSpecs(config)) {
    names.insert(spec.name);
    auto it = file.tensors.find(spec.name);
    if (it == file.tensors.end()) {
      problems.push_back(absl::StrCat(spec.name, ": missing"));
      continue;
    }
    const ref_st::Tensor& t = it->second;
    if (t.dtype != want_dtype) {
      problems.push_back(absl::StrCat(spec.name, ": dtype ", t.dtype, ", want ", want_dtype));
      continue;
    }
    if (t.shape != spec.shape) {
      problems.push_back(
          absl::StrCat(spec.name, ": shape ", ShapeStr(t.shape), ", want ", ShapeStr(spec.shape)));
      continue;
    }
    const float* want = units.at(spec.unit).data() + spec.offset;
    if (spec.offset + spec.numel > static_cast<int64_t>(units.at(spec.unit).size())) {
      problems.push_back(absl::StrCat(spec.name, ": spec outside its unit"));
      continue;
    }
    int64_t bad = 0, first = -1;
    if (dtype == DType::kF32) {
      const std::vector<float> got = ref_st::F32Values(t);
      for (int64_t i = 0; i < spec.numel; ++i) {
        if (std::memcmp(&got[i], &want[i], 4) != 0) {
          if (bad++ == 0) first = i;
        }
      }
      if (bad > 0) {
        problems.push_back(absl::StrCat(
            spec.name, ": ", bad, " of ", spec.numel, " values differ, first at ", first, ": file ",
            ref_st::Show(got[first]), ", model ", ref_st::Show(want[first])));
      }
    } else {
      const std::vector<uint16_t> got = ref_st::U16Values(t);
      for (int64_t i = 0; i < spec.numel; ++i) {
        const uint16_t ref = ref_st::ReferenceBf16(want[i]);
        // The library's converter must agree with the definition, and the file with both.
        if (got[i] != ref || FloatToBf16(want[i]) != ref) {
          if (bad++ == 0) first = i;
        }
      }
      if (bad > 0) {
        problems.push_back(absl::StrCat(spec.name, ": ", bad, " of ", spec.numel,
                                        " bf16 values differ, first at ", first, ": file 0x",
                                        absl::Hex(got[first]), ", want 0x",
                                        absl::Hex(ref_st::ReferenceBf16(want[first])), " (f32 ",
                                        ref_st::Show(want[first]), ")"));
      }
    }
  }
  for (const auto& [name, t] : file.tensors) {
    if (!names.count(name)) problems.push_back(absl::StrCat(name, ": extra tensor in the file"));
  }
  return problems;
}

// Replaces every occurrence of `a` by `b` and of `b` by `a` in `s` (same length).
std::string SwapText(std::string s, const std::string& a, const std::string& b) {
  const std::string tmp(a.size(), '\x01');
  auto replace_all = [&](const std::string& from, const std::string& to) {
    for (size_t p = s.find(from); p != std::string::npos; p = s.find(from, p + to.size())) {
      s.replace(p, from.size(), to);
    }
  };
  replace_all(a, tmp);
  replace_all(b, a);
  replace_all(tmp, b);
  return s;
}

class SafetensorsByValueTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/fsdp_stv_", getpid(), "_", GetParam());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  Layout layout() const {
    Layout l;
    l.world = GetParam();
    if (l.world == 3) {
      // Block 0 joins the root unit: tensors of a runtime unit no longer start at the
      // model unit's offsets.
      l.wrap.kind = nn::WrapPolicy::Kind::kExplicit;
      l.wrap.modules = {"transformer.h.1"};
    }
    return l;
  }
  std::string dir_;
};

TEST_P(SafetensorsByValueTest, ExportHoldsEachNamedTensorsValues) {
  const std::string f32 = dir_ + "/model-f32.safetensors";
  const std::string bf16 = dir_ + "/model-bf16.safetensors";
  auto units = TrainAndExportBoth(layout(), f32, bf16);
  ASSERT_TRUE(units.ok()) << units.status();
  const nn::GptConfig config = *nn::GptConfig::FromName("nano");
  ASSERT_EQ(units->size(), static_cast<size_t>(nn::GptNumUnits(config)));
  for (int u = 0; u < nn::GptNumUnits(config); ++u) {
    ASSERT_EQ((*units)[u].size(), static_cast<size_t>(nn::GptUnitNumel(config, u)));
  }
  for (const auto& [path, dtype] :
       {std::make_pair(f32, DType::kF32), std::make_pair(bf16, DType::kBF16)}) {
    SCOPED_TRACE(path);
    auto file = ref_st::Parse(ReadAll(path));  // offsets in range, no overlap, no gap
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(file->header_len % 8, 0u);
    EXPECT_EQ(file->tensors.size(), nn::GptParamSpecs(config).size());
    EXPECT_EQ(file->data_bytes(), DTypeSize(dtype) * config.num_parameters());
    EXPECT_THAT(CheckByValue(*file, config, *units, dtype), IsEmpty());
    // The caller's pairs, and the model's configuration under kSafetensorsModelKeyPrefix.
    std::map<std::string, std::string> meta = {{"format", "pt"}, {"producer", "by-value test"}};
    for (const auto& [k, v] : nn::ModelConfig(config).Describe()) {
      meta[absl::StrCat(kSafetensorsModelKeyPrefix, k)] = v;
    }
    EXPECT_TRUE(file->has_metadata);
    EXPECT_EQ(file->metadata, meta);
    // After training no tensor is constant (biases start at 0, LayerNorm weights at 1): a
    // swap of two tensors that hold equal values everywhere would pass the check unseen.
    for (const nn::ParamSpec& spec : nn::GptParamSpecs(config)) {
      const float* v = (*units)[spec.unit].data() + spec.offset;
      EXPECT_TRUE(std::any_of(v, v + spec.numel, [&](float x) { return x != v[0]; }))
          << spec.name << " is constant";
    }
  }
}

// The check above can fail: the same export, altered the ways a buggy exporter (or importer)
// would alter it, is rejected by the reader or by the value check.
TEST_P(SafetensorsByValueTest, CheckDetectsSwappedNamesMovedDataAndCorruption) {
  const std::string f32 = dir_ + "/model-f32.safetensors";
  const std::string bf16 = dir_ + "/model-bf16.safetensors";
  auto units = TrainAndExportBoth(layout(), f32, bf16);
  ASSERT_TRUE(units.ok()) << units.status();
  const nn::GptConfig config = *nn::GptConfig::FromName("nano");
  for (const auto& [path, dtype] :
       {std::make_pair(f32, DType::kF32), std::make_pair(bf16, DType::kBF16)}) {
    SCOPED_TRACE(path);
    const std::string raw = ReadAll(path);
    auto original = ref_st::Parse(raw);
    ASSERT_TRUE(original.ok()) << original.status();
    ASSERT_THAT(CheckByValue(*original, config, *units, dtype), IsEmpty());
    const uint64_t data_start = 8 + original->header_len;

    // 1. Two tensors of the same shape swap names (the header alone is changed).
    {
      const std::string a = "\"transformer.h.0.attn.c_proj.weight\"";
      const std::string b = "\"transformer.h.1.attn.c_proj.weight\"";
      auto f = ref_st::Parse(SwapText(raw, a, b));
      ASSERT_TRUE(f.ok()) << f.status();
      const auto problems = CheckByValue(*f, config, *units, dtype);
      EXPECT_THAT(problems, Contains(HasSubstr("transformer.h.0.attn.c_proj.weight: ")));
      EXPECT_THAT(problems, Contains(HasSubstr("transformer.h.1.attn.c_proj.weight: ")));
    }
    // 2. A tensor's data at another tensor's offset (the data of two same-sized tensors
    //    exchanged; the header unchanged).
    {
      const ref_st::Tensor& w = original->tensors.at("transformer.h.1.ln_2.weight");
      const ref_st::Tensor& b = original->tensors.at("transformer.h.1.ln_2.bias");
      std::string moved = raw;
      std::swap_ranges(moved.begin() + data_start + w.begin, moved.begin() + data_start + w.end,
                       moved.begin() + data_start + b.begin);
      auto f = ref_st::Parse(std::move(moved));
      ASSERT_TRUE(f.ok()) << f.status();
      const auto problems = CheckByValue(*f, config, *units, dtype);
      EXPECT_THAT(problems, Contains(HasSubstr("transformer.h.1.ln_2.weight: ")));
      EXPECT_THAT(problems, Contains(HasSubstr("transformer.h.1.ln_2.bias: ")));
    }
    // 3. The lowest bit of one value flipped (the last element of wpe).
    {
      const ref_st::Tensor& t = original->tensors.at("transformer.wpe.weight");
      std::string flipped = raw;
      flipped[data_start + t.end - DTypeSize(dtype)] ^= 1;
      auto f = ref_st::Parse(std::move(flipped));
      ASSERT_TRUE(f.ok()) << f.status();
      const int64_t numel = static_cast<int64_t>(config.block_size) * config.channels;
      EXPECT_THAT(CheckByValue(*f, config, *units, dtype),
                  Contains(HasSubstr(absl::StrCat("transformer.wpe.weight: 1 of ", numel, " ",
                                                  dtype == DType::kF32 ? "" : "bf16 ",
                                                  "values differ, first at ", numel - 1))));
    }
    // 4. A tensor renamed to a name the model lacks: missing, and an extra tensor.
    {
      auto f =
          ref_st::Parse(SwapText(raw, "\"transformer.ln_f.bias\"", "\"transformer.ln_f.bia5\""));
      ASSERT_TRUE(f.ok()) << f.status();
      const auto problems = CheckByValue(*f, config, *units, dtype);
      EXPECT_THAT(problems, Contains("transformer.ln_f.bias: missing"));
      EXPECT_THAT(problems, Contains("transformer.ln_f.bia5: extra tensor in the file"));
    }
    // 5. Data that the header does not tile: a byte missing, a byte too many.
    EXPECT_THAT(ref_st::Parse(raw.substr(0, raw.size() - 1)).status().message(),
                HasSubstr("past the data section"));
    EXPECT_THAT(ref_st::Parse(raw + '\0').status().message(), HasSubstr("cover"));
    // 6. The expectation itself wrong: the model's units of two tensors exchanged.
    {
      std::vector<std::vector<float>> swapped = *units;
      const auto specs = nn::GptParamSpecs(config);
      const nn::ParamSpec* w = nullptr;
      const nn::ParamSpec* b = nullptr;
      for (const nn::ParamSpec& s : specs) {
        if (s.name == "transformer.h.0.ln_1.weight") w = &s;
        if (s.name == "transformer.h.0.ln_1.bias") b = &s;
      }
      ASSERT_TRUE(w != nullptr && b != nullptr);
      std::swap_ranges(swapped[w->unit].begin() + w->offset,
                       swapped[w->unit].begin() + w->offset + w->numel,
                       swapped[b->unit].begin() + b->offset);
      EXPECT_THAT(CheckByValue(*original, config, swapped, dtype),
                  Contains(HasSubstr("transformer.h.0.ln_1.weight: ")));
    }
  }
  // 7. An F32 file checked as the BF16 export: every tensor has the wrong dtype.
  auto f = ref_st::Parse(ReadAll(f32));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_THAT(CheckByValue(*f, config, *units, DType::kBF16),
              Contains("transformer.wte.weight: dtype F32, want BF16"));
}

INSTANTIATE_TEST_SUITE_P(Worlds, SafetensorsByValueTest, ::testing::Values(2, 3),
                         [](const ::testing::TestParamInfo<int>& p) {
                           return absl::StrCat(p.param, "Ranks");
                         });

TEST(ReferenceBf16Test, RoundsToNearestEven) {
  // Exact, halfway (ties to even, both directions), above and below halfway, negative,
  // the largest values, subnormals.
  struct Case {
    uint32_t f32;
    uint16_t bf16;
  } cases[] = {
      {0x3f800000u, 0x3f80}, {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81},
      {0x3f807fffu, 0x3f80}, {0xbf808001u, 0xbf81}, {0x7f7fffffu, 0x7f80}, {0x7f7f7fffu, 0x7f7f},
      {0x00008000u, 0x0000}, {0x00018000u, 0x0002}, {0x80000000u, 0x8000}, {0x00000001u, 0x0000},
  };
  for (const Case& c : cases) {
    const float x = std::bit_cast<float>(c.f32);
    EXPECT_EQ(ref_st::ReferenceBf16(x), c.bf16) << std::hex << c.f32;
    EXPECT_EQ(FloatToBf16(x), c.bf16) << std::hex << c.f32;
  }
}

}  // namespace
}  // namespace fsdp::testing
