// The checkpoint format readers on their own: CRC32C, the JSON reader's defences, safetensors
// header validation, metadata.json, the shard header and the COMMIT marker.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "src/checkpoint/crc32c.h"
#include "src/core/json.h"
#include "src/checkpoint/metadata.h"
#include "src/checkpoint/safetensors_format.h"
#include "src/checkpoint/shard_file.h"

namespace fsdp::checkpoint {
namespace {

using ::testing::HasSubstr;

std::string Msg(const absl::Status& s) { return std::string(s.message()); }

TEST(Crc32cTest, KnownValuesAndIncremental) {
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);  // the standard check value
  EXPECT_EQ(Crc32c(""), 0u);
  const std::string s(1000, 'x');
  EXPECT_EQ(Crc32cExtend(Crc32c(s.data(), 333), s.data() + 333, 667), Crc32c(s));
}

TEST(JsonTest, ParsesValues) {
  auto v = json::Parse(R"( {"a": [1, -2, 3.5, true, false, null], "b": "x\u00e9\ud83d\ude00\n"} )");
  ASSERT_TRUE(v.ok()) << v.status();
  const json::Value* a = v->Find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->items().size(), 6u);
  EXPECT_EQ(a->items()[1].int_value(), -2);
  EXPECT_FALSE(a->items()[2].is_int());
  EXPECT_EQ(a->items()[2].number(), 3.5);
  EXPECT_EQ(v->Find("b")->str(), "x\xc3\xa9\xf0\x9f\x98\x80\n");
  EXPECT_TRUE(json::Parse("9223372036854775807")->is_int());
  EXPECT_FALSE(json::Parse("9223372036854775808")->is_int());  // kept, but not as an int
}

TEST(JsonTest, RejectsHostileInput) {
  const std::pair<std::string, const char*> cases[] = {
      {R"({"a": 1, "a": 2})", "duplicate key"},
      {std::string(100, '[') + std::string(100, ']'), "nesting deeper"},
      {"\"\xff\"", "invalid UTF-8"},
      {"\"\xc0\xaf\"", "invalid UTF-8"},      // overlong '/'
      {"\"\xed\xa0\x80\"", "invalid UTF-8"},  // a surrogate in UTF-8
      {R"("\ud800")", "lone high surrogate"},
      {R"("\udc00")", "lone low surrogate"},
      {"\"a\x01\"", "control character"},
      {"[1, 2", "expected ',' or ']'"},
      {"{} x", "unexpected data after"},
      {"01", "unexpected data after"},
      {"1e999", "out of range"},
      {"-", "malformed number"},
      {"", "unexpected end"},
      {"\"abc", "unterminated string"},
  };
  for (const auto& [text, want] : cases) {
    auto v = json::Parse(text);
    ASSERT_FALSE(v.ok()) << text;
    EXPECT_THAT(Msg(v.status()), HasSubstr(want)) << text;
  }
}

TEST(JsonTest, WriterRoundTrips) {
  json::Writer w;
  w.BeginObject().Key("k\"ey").String("v\x01\n").Key("n").Int(-5).Key("l").BeginArray();
  w.Int(1).Bool(true).EndArray().EndObject();
  auto v = json::Parse(w.text());
  ASSERT_TRUE(v.ok()) << v.status() << " " << w.text();
  EXPECT_EQ(v->Find("k\"ey")->str(), "v\x01\n");
  EXPECT_EQ(v->Find("n")->int_value(), -5);
}

// A safetensors file from a header text and a data section of `data` bytes.
std::string File(const std::string& header, size_t data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  return out + header + std::string(data, '\0');
}

TEST(SafetensorsFormatTest, BuildsAndParses) {
  std::vector<SafetensorsTensor> t = {{"a", DType::kF32, {2, 3}, 6, 0, 0},
                                      {"b", DType::kBF16, {5}, 5, 0, 0}};
  const std::string header = BuildSafetensorsHeader(t, {{"format", "pt"}});
  EXPECT_EQ((header.size() - 8) % 8, 0u);
  EXPECT_EQ(t[1].begin, 24u);
  EXPECT_EQ(t[1].end, 34u);
  auto h = ParseSafetensorsFile(header + std::string(34, '\0'));
  ASSERT_TRUE(h.ok()) << h.status();
  EXPECT_EQ(h->tensors.size(), 2u);
  EXPECT_EQ(h->Find("b")->dtype, DType::kBF16);
  EXPECT_EQ(h->metadata.size(), 1u);
}

TEST(SafetensorsFormatTest, RejectsBadFiles) {
  const std::pair<std::string, const char*> cases[] = {
      {std::string("\xff\xff\xff\xff\0\0\0\0", 8) + "{}", "exceeds the limit"},
      {std::string("\x40\0\0\0\0\0\0\0", 8) + "{}", "runs past the end"},
      {"abc", "too short"},
      {File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
            12),
       "(overlap)"},
      {File(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), "(gap)"},
      {File(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 8), "trailing bytes"},
      {File(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8), "truncated"},
      {File(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8), "need 12"},
      {File(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8),
       "overflows"},
      {File(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8), "dtype F64"},
      {File(R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,8]}})", 8), "unknown dtype"},
      {File(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}})", 8), ">= 0"},
      {File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8), "not a range"},
      {File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"x":1}})", 8),
       "unexpected field"},
      {File(R"({"__metadata__":{"k":1}})", 0), "is not a string"},
      {File(R"([1])", 0), "does not start with '{'"},
      {File(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{}})", 8),
       "duplicate key"},
  };
  for (const auto& [file, want] : cases) {
    auto h = ParseSafetensorsFile(file);
    ASSERT_FALSE(h.ok()) << want;
    EXPECT_THAT(Msg(h.status()), HasSubstr(want));
  }
}

CheckpointMetadata SmallMetadata() {
  CheckpointMetadata m;
  m.world_size = 2;
  m.replicate_size = 1;
  m.shard_size = 2;
  m.strategy = "FULL_SHARD";
  m.optimizer = "adamw";
  m.step = 3;
  m.optimizer_step = 3;
  m.state_names = {"exp_avg"};
  m.files = {{"shard-00000-of-00002.bin", 64 + 48, 1}, {"shard-00001-of-00002.bin", 64 + 48, 2}};
  // w: 10 elements, 6 in file 0 and 4 in file 1; b: 2 elements in file 1. Each file holds
  // its parameter pieces, then their exp_avg pieces.
  m.tensors.push_back({"w",
                       {2, 5},
                       10,
                       {{0, 0, 6, 64}, {1, 6, 10, 64}},
                       {{{0, 0, 6, 64 + 24}, {1, 6, 10, 64 + 24}}}});
  m.tensors.push_back({"b", {2}, 2, {{1, 0, 2, 64 + 16}}, {{{1, 0, 2, 64 + 40}}}});
  m.data_loader = std::make_pair(uint64_t{18446744073709551615u}, int64_t{3});
  m.values = {{"k", "v"}};
  return m;
}

TEST(MetadataTest, RoundTrips) {
  const CheckpointMetadata m = SmallMetadata();
  auto back = ParseMetadata(SerializeMetadata(m));
  ASSERT_TRUE(back.ok()) << back.status() << SerializeMetadata(m);
  EXPECT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].param[1].offset, 64u);
  EXPECT_EQ(back->data_loader->first, 18446744073709551615u);
  EXPECT_EQ(back->files[1].crc32c, 2u);
  EXPECT_TRUE(back->model.empty());  // older checkpoints record no model: nothing to compare
}

// The model's configuration round-trips in order; a bad entry is an error naming the key.
TEST(MetadataTest, RecordsTheModel) {
  CheckpointMetadata m = SmallMetadata();
  m.model = {{"family", "llama"}, {"name", "llama-nano"}, {"num_heads", "4"}};
  auto back = ParseMetadata(SerializeMetadata(m));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model, m.model);
  std::string text = SerializeMetadata(m);
  text.replace(text.find("\"4\""), 3, "4");
  EXPECT_THAT(Msg(ParseMetadata(text).status()),
              HasSubstr("model: \"num_heads\" must be a non-empty key with a string value"));
  // What differs, for every key but "name"; nothing when either side records nothing.
  const ModelDescription mine = {{"family", "llama"}, {"name", "x"}, {"num_heads", "8"},
                                 {"num_kv_heads", "4"}};
  EXPECT_THAT(ModelDifferences(m.model, mine, "the checkpoint"),
              ::testing::ElementsAre("num_heads: 4 in the checkpoint, 8 in this model",
                                     "num_kv_heads: (not recorded) in the checkpoint, 4 in this "
                                     "model"));
  EXPECT_TRUE(ModelDifferences({}, mine, "the checkpoint").empty());
  EXPECT_TRUE(ModelDifferences(mine, {}, "the checkpoint").empty());
}

TEST(MetadataTest, RejectsInconsistentMetadata) {
  auto expect_bad = [](CheckpointMetadata m, const char* want) {
    auto r = ParseMetadata(SerializeMetadata(m));
    ASSERT_FALSE(r.ok()) << want;
    EXPECT_THAT(Msg(r.status()), HasSubstr(want));
  };
  CheckpointMetadata m = SmallMetadata();
  m.files[0].name = "../../etc/passwd";
  expect_bad(m, "expected \"shard-00000-of-00002.bin\"");
  m = SmallMetadata();
  m.tensors[1].param[0].offset = 64 + 44;  // runs past the end of the file
  expect_bad(m, "lies outside");
  m = SmallMetadata();
  m.tensors[1].param[0].offset = 64;  // shares bytes with w's piece
  expect_bad(m, "overlap in shard-00001-of-00002.bin");
  m = SmallMetadata();
  m.tensors[0].param.pop_back();
  expect_bad(m, "elements [6, 10) are in no shard file");
  m = SmallMetadata();
  m.tensors[1].name = "w";
  expect_bad(m, "listed twice");
  m = SmallMetadata();
  m.tensors[0].shape = {4294967296, 4294967296};
  expect_bad(m, "product fits");
  m = SmallMetadata();
  m.replicate_size = 2;
  expect_bad(m, "'mesh'");
  // A mesh whose product overflows int64 (found by metadata_fuzz; UBSan flags the multiply).
  std::string text = SerializeMetadata(SmallMetadata());
  const size_t mesh = text.find("\"mesh\"");
  ASSERT_NE(mesh, std::string::npos) << text;
  text.replace(mesh, text.find(']', mesh) + 1 - mesh, "\"mesh\": [4444444444444444444, 214]");
  EXPECT_THAT(Msg(ParseMetadata(text).status()), HasSubstr("'mesh'")) << text;
  EXPECT_THAT(Msg(ParseMetadata("{\"format\": \"x\"}").status()), HasSubstr("format is"));
  EXPECT_THAT(Msg(ParseMetadata("[]").status()), HasSubstr("not a JSON object"));
}

TEST(ShardFileTest, HeaderAndCommitRoundTripAndDetectDamage) {
  ShardHeader h;
  h.rank = 3;
  h.world_size = 8;
  h.tensor_bytes = 1000;
  h.rank_state_bytes = 7;
  h.payload_crc32c = 0xdeadbeef;
  std::string enc = EncodeShardHeader(h);
  ASSERT_EQ(enc.size(), kShardHeaderBytes);
  auto back = DecodeShardHeader(enc, "f");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->file_bytes(), 64u + 1000 + 7);
  enc[13] ^= 1;
  EXPECT_THAT(Msg(DecodeShardHeader(enc, "f").status()), HasSubstr("f: shard header checksum"));
  EXPECT_THAT(Msg(DecodeShardHeader("short", "f").status()), HasSubstr("truncated"));

  const std::string c = EncodeCommit({42, 1234, 0xabcdef01});
  auto commit = DecodeCommit(c);
  ASSERT_TRUE(commit.ok()) << commit.status() << c;
  EXPECT_EQ(commit->step, 42);
  EXPECT_EQ(commit->metadata_bytes, 1234u);
  EXPECT_EQ(commit->metadata_crc32c, 0xabcdef01u);
  std::string bad = c;
  bad[bad.find("42")] = '7';
  EXPECT_THAT(Msg(DecodeCommit(bad).status()), HasSubstr("checksum mismatch"));
  EXPECT_THAT(Msg(DecodeCommit(c.substr(0, c.size() - 3)).status()), HasSubstr("COMMIT"));
}

// The fuzzers' seed corpora must stay valid inputs as the format evolves.
TEST(FuzzSeedsTest, SeedsAreAccepted) {
  const std::string root = std::string(FSDP_SOURCE_DIR) + "/fuzz/corpus";
  auto read = [](const std::filesystem::path& p) {
    std::ifstream f(p, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
  };
  int seen = 0;
  // safetensors_fuzz takes each input as a file and as a Hugging Face index: *.index.json
  // seeds are indexes.
  for (const auto& e : std::filesystem::directory_iterator(root + "/safetensors")) {
    const std::string text = read(e.path());
    if (e.path().filename().string().ends_with(".index.json")) {
      EXPECT_TRUE(ParseSafetensorsIndex(text).ok()) << e.path();
    } else {
      EXPECT_TRUE(ParseSafetensorsFile(text).ok()) << e.path();
    }
    ++seen;
  }
  for (const auto& e : std::filesystem::directory_iterator(root + "/metadata")) {
    const std::string text = read(e.path());
    const std::string name = e.path().filename().string();
    bool ok = true;
    if (name.ends_with(".json")) ok = ParseMetadata(text).ok();
    if (name == "COMMIT") ok = DecodeCommit(text).ok();
    if (name == "shard_header.bin") ok = DecodeShardHeader(text, name).ok();
    EXPECT_TRUE(ok) << name;
    ++seen;
  }
  EXPECT_GE(seen, 8);
}

}  // namespace
}  // namespace fsdp::checkpoint
