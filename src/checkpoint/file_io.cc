// POSIX implementations of file_io.h.
#include "src/checkpoint/file_io.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "fsdp/files.h"
#include "src/checkpoint/crc32c.h"

namespace fsdp::checkpoint {
namespace {

absl::Status Errno(std::string_view what, const std::string& path, int err) {
  std::string msg = absl::StrCat(path, ": ", std::string(what), " failed: ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EEXIST || err == ENOTEMPTY) return absl::AlreadyExistsError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

std::string Trimmed(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  return p;
}

}  // namespace

absl::StatusOr<OutFile> OutFile::Create(const std::string& path) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return Errno("create", path, errno);
  return OutFile(path, fd);
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status OutFile::WriteAt(uint64_t offset, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Errno("write", path_, errno);
    }
    p += w;
    offset += static_cast<uint64_t>(w);
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status OutFile::SyncAndClose() {
  if (::fsync(fd_) != 0) return Errno("fsync", path_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return Errno("close", path_, errno);
  return absl::OkStatus();
}

absl::StatusOr<InFile> InFile::Open(const std::string& path) {
  // Without blocking: a FIFO in place of a checkpoint file is an error, not a hang.
  uint64_t size = 0;
  absl::StatusOr<int> fd = OpenRegularFileForReading(path, &size);
  if (!fd.ok()) {
    if (absl::IsFailedPrecondition(fd.status())) {
      return absl::DataLossError(fd.status().message());
    }
    return fd.status();
  }
  return InFile(path, *fd, size);
}

InFile::~InFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status InFile::ReadAt(uint64_t offset, void* data, size_t n) const {
  char* p = static_cast<char*>(data);
  const uint64_t want_end = offset + n;
  while (n > 0) {
    const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return Errno("read", path_, errno);
    }
    if (r == 0) {
      return absl::DataLossError(absl::StrCat(path_, ": truncated: the file ends at byte ", offset,
                                              ", expected at least ", want_end));
    }
    p += r;
    offset += static_cast<uint64_t>(r);
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

absl::StatusOr<uint32_t> InFile::Crc32cOf(uint64_t offset, uint64_t n) const {
  std::vector<char> buf(std::min<uint64_t>(n, uint64_t{4} << 20));
  uint32_t crc = 0;
  while (n > 0) {
    const size_t chunk = static_cast<size_t>(std::min<uint64_t>(n, buf.size()));
    FSDP_RETURN_IF_ERROR(ReadAt(offset, buf.data(), chunk));
    crc = Crc32cExtend(crc, buf.data(), chunk);
    offset += chunk;
    n -= chunk;
  }
  return crc;
}

absl::StatusOr<HeldFileLock> HeldFileLock::Take(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
  if (fd < 0) return Errno("open", path, errno);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(path, ": in use by another process"));
    }
    // A file system without locks: nothing to hold.
  }
  return HeldFileLock(fd);
}

HeldFileLock::~HeldFileLock() {
  if (fd_ >= 0) ::close(fd_);
}

absl::Status WriteFileDurably(const std::string& path, std::string_view data) {
  FSDP_ASSIGN_OR_RETURN(OutFile f, OutFile::Create(path));
  FSDP_RETURN_IF_ERROR(f.WriteAt(0, data.data(), data.size()));
  return f.SyncAndClose();
}

absl::StatusOr<std::string> ReadWholeFile(const std::string& path, uint64_t max_bytes) {
  FSDP_ASSIGN_OR_RETURN(InFile f, InFile::Open(path));
  if (f.size() > max_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", f.size(), " bytes, more than the ",
                                            max_bytes, " this file may hold"));
  }
  std::string out(f.size(), '\0');
  FSDP_RETURN_IF_ERROR(f.ReadAt(0, out.data(), out.size()));
  return out;
}

absl::Status SyncDirectory(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open directory", path, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return Errno("fsync directory", path, err);
  return absl::OkStatus();
}

bool PathExists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

absl::Status MakeDirectory(const std::string& path) {
  std::error_code ec;
  std::filesystem::create_directories(path, ec);
  if (ec) return Errno("create directory", path, ec.value());
  return absl::OkStatus();
}

absl::Status RemoveTree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec) return Errno("remove", path, ec.value());
  return absl::OkStatus();
}

absl::Status RenameDurably(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) {
    return Errno(absl::StrCat("rename to ", to), from, errno);
  }
  return SyncDirectory(ParentOf(to));
}

std::string ParentOf(const std::string& path) {
  const std::string p = Trimmed(path);
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

std::string BaseName(const std::string& path) {
  const std::string p = Trimmed(path);
  const size_t slash = p.rfind('/');
  return slash == std::string::npos ? p : p.substr(slash + 1);
}

namespace {

// "<target>.<tag><pid>-<hex>", e.g. "step-4.tmp-1234-a3f0".
bool IsSaveScratchName(std::string_view name, std::string_view tag) {
  const size_t at = name.rfind(tag);
  if (at == std::string_view::npos || at == 0) return false;
  const std::string_view rest = name.substr(at + tag.size());  // "<pid>-<hex>"
  const size_t dash = rest.find('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == rest.size()) return false;
  const auto all = [](std::string_view s, auto pred) {
    return std::all_of(s.begin(), s.end(), [&](char c) { return pred(c); });
  };
  return all(rest.substr(0, dash), [](char c) { return c >= '0' && c <= '9'; }) &&
         all(rest.substr(dash + 1),
             [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

bool IsCheckpointFileName(std::string_view name) {
  return name == kCommitFile || name == kMetadataFile ||
         (name.starts_with("shard-") && name.ends_with(".bin"));
}

}  // namespace

bool IsCheckpointTemporaryName(std::string_view name) { return IsSaveScratchName(name, ".tmp-"); }
bool IsReplacedCheckpointName(std::string_view name) { return IsSaveScratchName(name, ".old-"); }

absl::StatusOr<CommitRecord> ReadVerifiedCommit(const std::string& dir,
                                                std::string* metadata_text) {
  constexpr uint64_t kMaxMetadataBytes = uint64_t{1} << 30;
  const std::string commit_path = absl::StrCat(dir, "/", kCommitFile);
  if (!PathExists(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": no such checkpoint directory"));
  }
  if (!PathExists(commit_path)) {
    return absl::DataLossError(
        absl::StrCat(commit_path,
                     ": missing: the checkpoint is incomplete (a save that did not finish) "
                     "or not a libfsdp checkpoint"));
  }
  absl::StatusOr<std::string> commit_text = ReadWholeFile(commit_path, 4096);
  if (!commit_text.ok()) {
    return absl::DataLossError(absl::StrCat(commit_path, ": unreadable: ",
                                            std::string(commit_text.status().message())));
  }
  absl::StatusOr<CommitRecord> commit = DecodeCommit(*commit_text);
  if (!commit.ok()) {
    return absl::DataLossError(absl::StrCat(dir, "/", std::string(commit.status().message())));
  }
  const std::string meta_path = absl::StrCat(dir, "/", kMetadataFile);
  absl::StatusOr<std::string> text = ReadWholeFile(meta_path, kMaxMetadataBytes);
  if (!text.ok()) {
    return absl::DataLossError(
        absl::StrCat(meta_path, ": missing or unreadable (", std::string(text.status().message()),
                     "), but the COMMIT marker records it"));
  }
  if (text->size() != commit->metadata_bytes || Crc32c(*text) != commit->metadata_crc32c) {
    return absl::DataLossError(absl::StrCat(
        meta_path, ": checksum mismatch: ", text->size(), " bytes with CRC32C ",
        CrcHex(Crc32c(*text)), ", but the COMMIT marker records ", commit->metadata_bytes,
        " bytes with ", CrcHex(commit->metadata_crc32c), " (corrupted or replaced)"));
  }
  if (metadata_text != nullptr) *metadata_text = std::move(*text);
  return *commit;
}

bool HoldsOnlyCheckpointFiles(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return false;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return false;
  int files = 0;
  for (const auto& e : it) {
    // symlink_status: a symbolic link is not a file a save wrote, whatever it points to.
    if (!IsCheckpointFileName(e.path().filename().string()) || !e.is_regular_file(ec) ||
        e.is_symlink(ec)) {
      return false;
    }
    ++files;
  }
  return files > 0;
}

std::vector<std::string> CheckpointFilesOfOtherKinds(const std::string& dir) {
  std::vector<std::string> out;
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return out;
  for (const auto& e : it) {
    const std::string name = e.path().filename().string();
    if (IsCheckpointFileName(name) && (e.is_symlink(ec) || !e.is_regular_file(ec))) {
      out.push_back(absl::StrCat(name, " is ", DescribePath(e.path().string())));
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool LooksLikeCheckpoint(const std::string& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return false;
  for (const auto& e : it) {
    if (IsCheckpointFileName(e.path().filename().string())) return true;
  }
  return false;
}

}  // namespace fsdp::checkpoint
