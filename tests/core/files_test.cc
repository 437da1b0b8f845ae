// fsdp/files.h: outputs that create or replace only files of their own kind, inputs that never
// block, free space, sizes in words.
#include "fsdp/files.h"

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

class FilesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = absl::StrCat(::testing::TempDir(), "/fsdp_files_", getpid(), "_",
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  void Write(const std::string& name, const std::string& text) const {
    std::ofstream(Path(name), std::ios::binary) << text;
  }
  std::string Read(const std::string& name) const {
    std::ifstream f(Path(name), std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  std::string dir_;
};

// The smallest safetensors file: an 8-byte length, then "{}" padded to 8 bytes.
std::string TinySafetensors() {
  std::string s(8, '\0');
  s[0] = 8;
  return s + "{}      ";
}

TEST_F(FilesTest, NewFilesEmptyFilesAndFilesOfTheKindMayBeWritten) {
  EXPECT_TRUE(CheckOutputPath(Path("new.safetensors"), kSafetensorsFile).ok());
  Write("empty", "");
  EXPECT_TRUE(CheckOutputPath(Path("empty"), kCsvFile).ok());
  Write("m.safetensors", TinySafetensors());
  EXPECT_TRUE(CheckOutputPath(Path("m.safetensors"), kSafetensorsFile).ok());
  Write("t.json", "{\"traceEvents\":[\n]}");
  EXPECT_TRUE(CheckOutputPath(Path("t.json"), kChromeTraceFile).ok());
  Write("r.jsonl", "{\"model\":\"nano\"}\n{\"model\":\"mini\"}\n");
  EXPECT_TRUE(CheckOutputPath(Path("r.jsonl"), kJsonLinesFile).ok());
  Write("r.csv", "model,strategy,world_size\nnano,FULL_SHARD,2\n");
  EXPECT_TRUE(CheckOutputPath(Path("r.csv"), kCsvFile).ok());
  Write("p.svg", "<svg xmlns=\"http://www.w3.org/2000/svg\"></svg>");
  EXPECT_TRUE(CheckOutputPath(Path("p.svg"), kSvgFile).ok());
}

TEST_F(FilesTest, AnythingElseIsRefusedNamingWhatItIs) {
  Write("corpus.txt", "The quick brown fox, jumps over the lazy dog.\n");
  for (const OutputKind* kind :
       {&kSafetensorsFile, &kChromeTraceFile, &kJsonLinesFile, &kCsvFile, &kSvgFile}) {
    const absl::Status s = CheckOutputPath(Path("corpus.txt"), *kind);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << kind->name;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr(absl::StrCat("it exists and is not ", kind->name)));
  }
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0644), 0);
  absl::Status s = CheckOutputPath(Path("fifo"), kSafetensorsFile, {}, "export to");
  EXPECT_THAT(std::string(s.message()),
              HasSubstr(absl::StrCat("cannot export to ", Path("fifo"),
                                     ": it is a FIFO, not a regular file")));
  s = CheckOutputPath("/dev/null", kSafetensorsFile);
  EXPECT_THAT(std::string(s.message()), HasSubstr("it is a character device"));
  s = CheckOutputPath(dir_, kSafetensorsFile);
  EXPECT_THAT(std::string(s.message()), HasSubstr("it is a directory"));
  Write("m.safetensors", TinySafetensors());
  fs::create_symlink("m.safetensors", Path("link"));
  s = CheckOutputPath(Path("link"), kSafetensorsFile);
  EXPECT_THAT(std::string(s.message()), HasSubstr("it is a symbolic link to m.safetensors"));
  fs::create_symlink("loop", Path("loop"));
  EXPECT_EQ(DescribePath(Path("loop")), "a symbolic link loop");
  s = CheckOutputPath(Path("no/such/dir/x"), kSafetensorsFile);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not exist"));
}

TEST_F(FilesTest, AnOutputIsNeverAnInput) {
  Write("m.safetensors", TinySafetensors());
  fs::create_hard_link(Path("m.safetensors"), Path("same.safetensors"));
  const absl::Status s = CheckOutputPath(Path("same.safetensors"), kSafetensorsFile,
                                         {"--init_safetensors=" + Path("m.safetensors")});
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("it is the same file as --init_safetensors=" + Path("m.safetensors")));
  EXPECT_TRUE(SameFile(Path("m.safetensors"), Path("same.safetensors")));
  EXPECT_FALSE(SameFile(Path("m.safetensors"), Path("absent")));
}

TEST_F(FilesTest, WriteOutputFileReplacesWholeAndLeavesNothingBehind) {
  Write("r.csv", "a,b\n1,2\n");
  ASSERT_TRUE(WriteOutputFile(Path("r.csv"), "a,b\n3,4\n", kCsvFile).ok());
  EXPECT_EQ(Read("r.csv"), "a,b\n3,4\n");
  Write("notes.csv", "dear diary\n");
  EXPECT_FALSE(WriteOutputFile(Path("notes.csv"), "a,b\n", kCsvFile).ok());
  EXPECT_EQ(Read("notes.csv"), "dear diary\n");
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 2);  // no temporary file left
}

TEST_F(FilesTest, InputsNeverBlock) {
  ASSERT_EQ(::mkfifo(Path("fifo").c_str(), 0644), 0);
  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<int> fd = OpenRegularFileForReading(Path("fifo"));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  ASSERT_FALSE(fd.ok());
  EXPECT_THAT(std::string(fd.status().message()), HasSubstr("a FIFO, not a regular file"));
  fs::create_symlink("loop", Path("loop"));
  fd = OpenRegularFileForReading(Path("loop"));
  EXPECT_THAT(std::string(fd.status().message()), HasSubstr("a symbolic link loop"));
  Write("data", "12345");
  uint64_t size = 0;
  fd = OpenRegularFileForReading(Path("data"), &size);
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_EQ(size, 5u);
  ::close(*fd);
}

TEST_F(FilesTest, FreeSpaceAndSizes) {
  absl::StatusOr<uint64_t> free = FreeBytesAt(Path("not/yet/made"));  // its nearest parent
  ASSERT_TRUE(free.ok()) << free.status();
  EXPECT_GT(*free, 0u);
  EXPECT_TRUE(SameFileSystem(dir_, Path("not/yet/made")));
  EXPECT_EQ(FormatBytes(12), "12 bytes");
  EXPECT_EQ(FormatBytes(1536), "1.5 KiB");
  EXPECT_EQ(FormatBytes(uint64_t{3} << 30), "3.0 GiB");
}

}  // namespace
}  // namespace fsdp
