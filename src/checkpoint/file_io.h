// POSIX file helpers for checkpoints: durable writes (fsync of files and directories),
// positioned reads that report truncation by file name, checksums of file ranges, and the
// directory operations of the commit protocol.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/status.h"
#include "src/checkpoint/shard_file.h"

namespace fsdp::checkpoint {

// A new file (it must not exist), written sequentially or at offsets. Close() fsyncs.
class OutFile {
 public:
  static absl::StatusOr<OutFile> Create(const std::string& path);
  OutFile(OutFile&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_) { o.fd_ = -1; }
  OutFile& operator=(OutFile&&) = delete;
  ~OutFile();

  absl::Status WriteAt(uint64_t offset, const void* data, size_t n);
  absl::Status SyncAndClose();
  const std::string& path() const { return path_; }

 private:
  OutFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
};

class InFile {
 public:
  static absl::StatusOr<InFile> Open(const std::string& path);
  InFile(InFile&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), size_(o.size_) {
    o.fd_ = -1;
  }
  InFile& operator=(InFile&&) = delete;
  ~InFile();

  uint64_t size() const { return size_; }
  // Exactly n bytes at offset, or DataLoss naming the file when it ends first.
  absl::Status ReadAt(uint64_t offset, void* data, size_t n) const;
  // CRC32C of bytes [offset, offset + n), read in chunks.
  absl::StatusOr<uint32_t> Crc32cOf(uint64_t offset, uint64_t n) const;
  const std::string& path() const { return path_; }

 private:
  InFile(std::string path, int fd, uint64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// An exclusive flock(2) on a file, held until destroyed (or the process ends): marks a file
// being written, so that a cleanup of dead temporaries in another process leaves it alone.
class HeldFileLock {
 public:
  // FailedPrecondition when another open file description holds it.
  static absl::StatusOr<HeldFileLock> Take(const std::string& path);
  HeldFileLock(HeldFileLock&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  HeldFileLock& operator=(HeldFileLock&&) = delete;
  ~HeldFileLock();

 private:
  explicit HeldFileLock(int fd) : fd_(fd) {}
  int fd_ = -1;
};

// Creates `path`, writes `data`, fsyncs and closes it.
absl::Status WriteFileDurably(const std::string& path, std::string_view data);
// The whole file, failing when it is larger than max_bytes.
absl::StatusOr<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes);
absl::Status SyncDirectory(const std::string& path);
bool PathExists(const std::string& path);
absl::Status MakeDirectory(const std::string& path);  // parents too
absl::Status RemoveTree(const std::string& path);
// rename(2), then fsync of the parent directory.
absl::Status RenameDurably(const std::string& from, const std::string& to);
// The directory holding `path` ("." for a bare name), and the last component.
std::string ParentOf(const std::string& path);
std::string BaseName(const std::string& path);

// Whether `name` (one path component) is that of a temporary directory SaveCheckpoint
// writes into: "<target>.tmp-<pid>-<hex>". Such a directory left behind is a crashed save.
bool IsCheckpointTemporaryName(std::string_view name);
// Whether `name` is that of a checkpoint a save was replacing: "<target>.old-<pid>-<hex>"
// (the old copy is renamed aside, the new one renamed in, then the old one removed).
bool IsReplacedCheckpointName(std::string_view name);

// The COMMIT marker of the checkpoint directory `dir`, verified: present, well formed, and
// matching the size and CRC32C of metadata.json (whose text goes to `metadata_text` when
// given). NotFound when `dir` does not exist; otherwise DataLoss saying what is wrong. The
// shard files are not read (LoadCheckpoint verifies them).
absl::StatusOr<CommitRecord> ReadVerifiedCommit(const std::string& dir,
                                                std::string* metadata_text = nullptr);

// True when `dir` is a directory (not a symbolic link) holding files of a sharded checkpoint
// and nothing else: at least one of COMMIT, metadata.json, shard-*.bin, each a regular file,
// and no other entry. Such a directory without a valid COMMIT marker is an incomplete or
// damaged checkpoint, which a save of the same name may replace; any other directory is never
// replaced.
bool HoldsOnlyCheckpointFiles(const std::string& dir);
// The entries of `dir` with a checkpoint file's name that are not regular files, each as
// "COMMIT is a FIFO" (sorted): what keeps a damaged checkpoint from being replaced.
std::vector<std::string> CheckpointFilesOfOtherKinds(const std::string& dir);
// True when `dir` is a directory with at least one entry named as a checkpoint file, of any
// kind: a checkpoint, maybe damaged, that LatestCheckpoint reports when it passes over it.
bool LooksLikeCheckpoint(const std::string& dir);

}  // namespace fsdp::checkpoint
