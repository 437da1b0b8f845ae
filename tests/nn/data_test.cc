// Token datasets, the embedded corpus and the data-parallel DataLoader.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fsdp/nn/data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp::nn {
namespace {

using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/" + std::to_string(getpid()) + "_" + name;
}

void WriteFile(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

std::string Le16(const std::vector<uint16_t>& tokens) {
  std::string s;
  for (uint16_t t : tokens) {
    s.push_back(static_cast<char>(t & 0xff));
    s.push_back(static_cast<char>(t >> 8));
  }
  return s;
}

TEST(DataTest, EmbeddedCorpusIsDataCorpusTxt) {
  std::ifstream in(std::string(FSDP_SOURCE_DIR) + "/data/corpus.txt", std::ios::binary);
  ASSERT_TRUE(in) << "data/corpus.txt not found";
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(EmbeddedCorpus(), file);
  EXPECT_GT(EmbeddedCorpus().size(), 200000u);
  EXPECT_THAT(std::string(EmbeddedCorpus().substr(0, 200)), HasSubstr("GNU GENERAL PUBLIC LICENSE"));
}

TEST(DataTest, TextIsBytesAndSplitKeepsTheLastTenPercentForValidation) {
  const TokenDataset d = TokenDataset::FromText("ab\xff");
  EXPECT_EQ(d.vocab_size(), 256);
  EXPECT_EQ(d.tokens(), (std::vector<uint16_t>{97, 98, 255}));
  const TokenDataset corpus = TokenDataset::FromText(EmbeddedCorpus());
  auto split = SplitTrainVal(corpus, 0.1);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(split->train.size() + split->val.size(), corpus.size());
  EXPECT_NEAR(static_cast<double>(split->val.size()) / corpus.size(), 0.1, 1e-4);
  EXPECT_EQ(split->val.tokens().back(), corpus.tokens().back());
  EXPECT_FALSE(SplitTrainVal(corpus, 1.5).ok());
}

TEST(DataTest, BinFilesNanoGptAndLlmc) {
  const std::vector<uint16_t> tokens = {0, 1, 50256, 300, 7};
  const std::string raw = TempPath("nanogpt.bin");
  WriteFile(raw, Le16(tokens));
  auto d = TokenDataset::FromBinFile(raw, 50304);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->tokens(), tokens);
  EXPECT_EQ(d->vocab_size(), 50304);

  // llm.c: 256 int32 header (magic, version, token count), then the tokens.
  std::string header(1024, '\0');
  const int32_t fields[3] = {20240520, 1, 5};
  for (int i = 0; i < 3; ++i) {
    for (int b = 0; b < 4; ++b) header[4 * i + b] = static_cast<char>((fields[i] >> (8 * b)) & 0xff);
  }
  const std::string llmc = TempPath("llmc.bin");
  WriteFile(llmc, header + Le16(tokens));
  auto e = TokenDataset::FromFile(llmc, 50304);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->tokens(), tokens);
  std::remove(raw.c_str());
  std::remove(llmc.c_str());
}

TEST(DataTest, BinFileErrors) {
  EXPECT_EQ(TokenDataset::FromBinFile(TempPath("missing.bin"), 256).status().code(),
            absl::StatusCode::kNotFound);
  const std::string odd = TempPath("odd.bin");
  WriteFile(odd, "abc");
  auto s = TokenDataset::FromBinFile(odd, 65536).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("3 bytes"));
  const std::string big = TempPath("big.bin");
  WriteFile(big, Le16({1, 2, 300}));
  s = TokenDataset::FromBinFile(big, 256).status();
  EXPECT_THAT(s.message(), HasSubstr("token 2 is 300"));
  std::remove(odd.c_str());
  std::remove(big.c_str());
  // Text needs at least the 256 byte values.
  const std::string txt = TempPath("t.txt");
  WriteFile(txt, "hello");
  EXPECT_FALSE(TokenDataset::FromFile(txt, 100).ok());
  EXPECT_EQ(TokenDataset::FromFile(txt, 256)->size(), 5);
  std::remove(txt.c_str());
}

// A directory, a device or a pipe is an error, never an exception or an endless read.
TEST(DataTest, OnlyRegularFilesAreRead) {
  const std::string dir = ::testing::TempDir();
  for (const std::string& path : {dir, dir + "/"}) {
    auto s = TokenDataset::FromFile(path, 256).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_THAT(s.message(), HasSubstr("is a directory, not a regular file")) << s;
  }
  auto s = TokenDataset::FromFile("/dev/zero", 256).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("'/dev/zero' is a character device, not a regular file"));
  const std::string fifo = TempPath("fifo.bin");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  s = TokenDataset::FromFile(fifo, 256).status();  // must not wait for a writer
  EXPECT_THAT(s.message(), HasSubstr("is a pipe, not a regular file")) << s;
  std::remove(fifo.c_str());
}

TEST(DataTest, FilesLargerThanTheLimitAreRefused) {
  const std::string txt = TempPath("limit.txt"), bin = TempPath("limit.bin");
  WriteFile(txt, std::string(1000, 'a'));
  WriteFile(bin, Le16(std::vector<uint16_t>(500, 7)));
  for (const std::string& path : {txt, bin}) {
    auto s = TokenDataset::FromFile(path, 256, 999).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_THAT(s.message(), HasSubstr("has 1000 bytes, more than the limit of 999 bytes")) << s;
    auto d = TokenDataset::FromFile(path, 256, 1000);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->size(), path == txt ? 1000 : 500);
    EXPECT_EQ(d->tokens().back(), path == txt ? 'a' : 7);
  }
  EXPECT_EQ(TokenDataset::kDefaultMaxFileBytes, uint64_t{4} << 30);
  std::remove(txt.c_str());
  std::remove(bin.c_str());
}

TEST(DataTest, BatchesAreConsecutiveTokensShiftedByOne) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text.push_back(static_cast<char>(i % 251));
  const TokenDataset d = TokenDataset::FromText(text);
  auto loader = DataLoader::Create(&d, {.batch_size = 3, .seq_len = 16, .seed = 5});
  ASSERT_TRUE(loader.ok());
  const Batch b = loader->Next();
  ASSERT_EQ(b.inputs.size(), 48u);
  for (int r = 0; r < 3; ++r) {
    for (int t = 0; t < 16; ++t) {
      EXPECT_EQ(b.targets[r * 16 + t], (b.inputs[r * 16 + t] + 1) % 251);
      if (t > 0) {
        EXPECT_EQ(b.inputs[r * 16 + t], b.targets[r * 16 + t - 1]);
      }
    }
  }
  EXPECT_NE(loader->Next().inputs, b.inputs);  // another step, other positions
}

TEST(DataTest, RankBatchesAreRowsOfTheSingleRankBatch) {
  const TokenDataset d = TokenDataset::FromText(EmbeddedCorpus());
  constexpr int kRanks = 4, kB = 3, kT = 32;
  for (SampleOrder order : {SampleOrder::kRandom, SampleOrder::kSequential}) {
    auto single = *DataLoader::Create(
        &d, {.batch_size = kRanks * kB, .seq_len = kT, .seed = 9, .order = order});
    for (int64_t step : {0, 1, 17}) {
      const Batch all = single.At(step);
      for (int r = 0; r < kRanks; ++r) {
        auto rank = *DataLoader::Create(&d, {.batch_size = kB, .seq_len = kT, .rank = r,
                                             .world_size = kRanks, .seed = 9, .order = order});
        const Batch mine = rank.At(step);
        const auto rows = [&](const std::vector<int32_t>& v) {
          return std::vector<int32_t>(v.begin() + r * kB * kT, v.begin() + (r + 1) * kB * kT);
        };
        EXPECT_EQ(mine.inputs, rows(all.inputs)) << "rank " << r << " step " << step;
        EXPECT_EQ(mine.targets, rows(all.targets)) << "rank " << r << " step " << step;
      }
    }
  }
}

TEST(DataTest, SequentialOrderVisitsEveryWindow) {
  const TokenDataset d = TokenDataset::FromText(std::string(1001, 'x'));
  auto loader = *DataLoader::Create(
      &d, {.batch_size = 4, .seq_len = 10, .order = SampleOrder::kSequential});
  EXPECT_EQ(loader.steps_per_epoch(), 25);  // 100 windows of 10 tokens (+1 target)
  EXPECT_EQ(loader.At(0).inputs.size(), 40u);
}

TEST(DataTest, StateRestoresTheDataOrder) {
  const TokenDataset d = TokenDataset::FromText(EmbeddedCorpus());
  auto a = *DataLoader::Create(&d, {.batch_size = 2, .seq_len = 8, .seed = 3});
  a.Next();
  a.Next();
  const DataLoaderState saved = a.state();
  EXPECT_EQ(saved.step, 2);
  const Batch third = a.Next();
  auto b = *DataLoader::Create(&d, {.batch_size = 2, .seq_len = 8, .seed = 3});
  ASSERT_TRUE(b.Restore(saved).ok());
  EXPECT_EQ(b.Next().inputs, third.inputs);
  auto other_seed = *DataLoader::Create(&d, {.batch_size = 2, .seq_len = 8, .seed = 4});
  EXPECT_EQ(other_seed.Restore(saved).code(), absl::StatusCode::kFailedPrecondition);
}

TEST(DataTest, LoaderErrors) {
  const TokenDataset d = TokenDataset::FromText("short");
  EXPECT_THAT(DataLoader::Create(&d, {.batch_size = 1, .seq_len = 5}).status().message(),
              HasSubstr("too few"));
  EXPECT_TRUE(DataLoader::Create(&d, {.batch_size = 1, .seq_len = 4}).ok());
  EXPECT_FALSE(DataLoader::Create(&d, {.batch_size = 0, .seq_len = 2}).ok());
  EXPECT_FALSE(DataLoader::Create(&d, {.batch_size = 1, .seq_len = 2, .rank = 2, .world_size = 2}).ok());
  EXPECT_FALSE(DataLoader::Create(nullptr, {}).ok());
}

}  // namespace
}  // namespace fsdp::nn
