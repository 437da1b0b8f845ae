// Outputs that never replace what is not theirs, and inputs that never block (fsdp/files.h).
#include "fsdp/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace fsdp {
namespace {

constexpr size_t kHeadBytes = 4096;

std::string_view TrimLeft(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\n' || s.front() == '\r' ||
                        s.front() == '\t')) {
    s.remove_prefix(1);
  }
  return s;
}

bool RecogniseSafetensors(std::string_view head, uint64_t size) {
  if (head.size() < 10 || size < 10) return false;
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(head[i]);
  return n >= 2 && n <= size - 8 && head[8] == '{';
}

bool RecogniseChromeTrace(std::string_view head, uint64_t) {
  return TrimLeft(head).starts_with("{\"traceEvents\"");
}

bool RecogniseJsonLines(std::string_view head, uint64_t) {
  if (!head.starts_with('{')) return false;
  const size_t nl = head.find('\n');
  if (nl == std::string_view::npos) return head.size() == kHeadBytes;  // a long first line
  size_t end = nl;
  while (end > 0 && (head[end - 1] == '\r' || head[end - 1] == ' ')) --end;
  return end > 0 && head[end - 1] == '}';
}

// A first line of two or more identifiers separated by commas.
bool RecogniseCsv(std::string_view head, uint64_t) {
  const size_t nl = head.find('\n');
  std::string_view line = head.substr(0, nl);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  int names = 0;
  bool at_start = true;
  for (char c : line) {
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    const bool digit = c >= '0' && c <= '9';
    if (c == ',') {
      if (at_start) return false;
      at_start = true;
    } else if (alpha || (digit && !at_start)) {
      if (at_start) ++names;
      at_start = false;
    } else {
      return false;
    }
  }
  return names >= 2 && !at_start;
}

bool RecogniseSvg(std::string_view head, uint64_t) {
  const std::string_view s = TrimLeft(head);
  return s.starts_with("<svg") || s.starts_with("<?xml");
}

// "LABEL=PATH" -> {LABEL, PATH}; a bare path has no label.
std::pair<std::string, std::string> SplitInput(const std::string& input) {
  const size_t eq = input.find('=');
  if (eq == std::string::npos || eq == 0 || input[0] != '-') return {"", input};
  return {input.substr(0, eq), input.substr(eq + 1)};
}

absl::Status ErrnoStatus(int err, std::string msg) {
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(msg);
  return absl::FailedPreconditionError(msg);
}

std::string ParentDirectory(const std::string& path) {
  std::string p = path;
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const size_t slash = p.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : p.substr(0, slash);
}

// The first bytes of the regular file `fd`.
std::string ReadHead(int fd) {
  std::string head(kHeadBytes, '\0');
  size_t got = 0;
  while (got < head.size()) {
    const ssize_t r = ::pread(fd, head.data() + got, head.size() - got, static_cast<off_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    got += static_cast<size_t>(r);
  }
  head.resize(got);
  return head;
}

}  // namespace

const OutputKind kSafetensorsFile = {"a safetensors file", RecogniseSafetensors};
const OutputKind kChromeTraceFile = {"a Chrome trace (JSON)", RecogniseChromeTrace};
const OutputKind kJsonLinesFile = {"a JSON-lines file", RecogniseJsonLines};
const OutputKind kCsvFile = {"a CSV file", RecogniseCsv};
const OutputKind kSvgFile = {"an SVG image", RecogniseSvg};

std::string DescribePath(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return "nothing";
  switch (st.st_mode & S_IFMT) {
    case S_IFREG: return "a regular file";
    case S_IFDIR: return "a directory";
    case S_IFCHR: return "a character device";
    case S_IFBLK: return "a block device";
    case S_IFIFO: return "a FIFO";
    case S_IFSOCK: return "a socket";
    case S_IFLNK: {
      struct stat target;
      if (::stat(path.c_str(), &target) != 0 && errno == ELOOP) return "a symbolic link loop";
      std::string to(4096, '\0');
      const ssize_t n = ::readlink(path.c_str(), to.data(), to.size());
      to.resize(n > 0 ? static_cast<size_t>(n) : 0);
      return absl::StrCat("a symbolic link to ", to);
    }
    default: return "not a regular file";
  }
}

bool SameFile(const std::string& a, const std::string& b) {
  struct stat sa, sb;
  if (::stat(a.c_str(), &sa) != 0 || ::stat(b.c_str(), &sb) != 0) return false;
  return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

absl::Status CheckOutputPath(const std::string& path, const OutputKind& kind,
                             const std::vector<std::string>& inputs, std::string_view action) {
  const std::string prefix = absl::StrCat("cannot ", std::string(action), " ", path, ": ");
  auto refuse = [&](std::string_view why) {
    return absl::FailedPreconditionError(absl::StrCat(prefix, std::string(why)));
  };
  if (path.empty()) return absl::InvalidArgumentError("the output file name is empty");
  if (path.back() == '/') return refuse("it names a directory, not a file");
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode)) {
      return refuse(absl::StrCat("it is ", DescribePath(path), ", not a regular file; ",
                                 "outputs only create files or replace ", kind.name,
                                 ". Give a new file name"));
    }
    for (const std::string& input : inputs) {
      const auto [label, in] = SplitInput(input);
      if (!in.empty() && SameFile(path, in)) {
        return refuse(absl::StrCat("it is the same file as ",
                                   label.empty() ? in : absl::StrCat(label, "=", in),
                                   ", which this run reads. Give another file name"));
      }
    }
    if (st.st_size > 0) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
      if (fd < 0) {
        const int err = errno;
        return ErrnoStatus(err, absl::StrCat(prefix, "cannot read it to see what it holds: ",
                                             std::strerror(err)));
      }
      const std::string head = ReadHead(fd);
      ::close(fd);
      if (!kind.recognise(head, static_cast<uint64_t>(st.st_size))) {
        return refuse(absl::StrCat("it exists and is not ", kind.name, " (", st.st_size,
                                   " bytes of something else); outputs only replace files of "
                                   "their own kind. Give a new file name, or remove it first"));
      }
    }
  } else if (errno != ENOENT) {
    const int err = errno;
    return ErrnoStatus(err, absl::StrCat(prefix, std::strerror(err)));
  }
  const std::string dir = ParentDirectory(path);
  struct stat ds;
  if (::stat(dir.c_str(), &ds) != 0) {
    return absl::NotFoundError(absl::StrCat(prefix, "the directory ", dir, " does not exist"));
  }
  if (!S_ISDIR(ds.st_mode)) {
    return refuse(absl::StrCat(dir, " is ", DescribePath(dir), ", not a directory"));
  }
  return absl::OkStatus();
}

absl::Status WriteOutputFile(const std::string& path, std::string_view contents,
                             const OutputKind& kind) {
  FSDP_RETURN_IF_ERROR(CheckOutputPath(path, kind));
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  const std::string tmp = absl::StrFormat("%s.tmp-%d-%x", path, ::getpid(), now & 0xffffff);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return ErrnoStatus(err, absl::StrCat("cannot write ", path, ": creating ", tmp, " failed: ",
                                         std::strerror(err)));
  }
  const char* p = contents.data();
  size_t left = contents.size();
  int err = 0;
  while (left > 0 && err == 0) {
    const ssize_t w = ::write(fd, p, left);
    if (w < 0) {
      if (errno != EINTR) err = errno;
      continue;
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  absl::Status s;
  if (err != 0) {
    s = ErrnoStatus(err, absl::StrCat("cannot write ", path, ": ", std::strerror(err)));
  } else {
    // Checked again: what is at `path` may have changed while the file was written.
    s = CheckOutputPath(path, kind);
    if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) {
      err = errno;
      s = ErrnoStatus(err, absl::StrCat("cannot write ", path, ": rename failed: ",
                                        std::strerror(err)));
    }
  }
  if (!s.ok()) ::unlink(tmp.c_str());
  return s;
}

absl::StatusOr<int> OpenRegularFileForReading(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    if (err == ELOOP) {
      return absl::FailedPreconditionError(absl::StrCat(path, ": a symbolic link loop"));
    }
    return ErrnoStatus(err, absl::StrCat(path, ": open failed: ", std::strerror(err)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": ", DescribePath(path), ", not a regular file"));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  if (size != nullptr) *size = static_cast<uint64_t>(st.st_size);
  return fd;
}

absl::StatusOr<uint64_t> FreeBytesAt(const std::string& path) {
  std::string p = path.empty() ? "." : path;
  for (int depth = 0; depth < 4096; ++depth) {
    struct statvfs vfs;
    if (::statvfs(p.c_str(), &vfs) == 0) {
      return static_cast<uint64_t>(vfs.f_bavail) * static_cast<uint64_t>(vfs.f_frsize);
    }
    if (errno != ENOENT && errno != ENOTDIR) break;
    const std::string parent = ParentDirectory(p);
    if (parent == p) break;
    p = parent;
  }
  return absl::NotFoundError(absl::StrCat(path, ": no file system to measure"));
}

namespace {

// The device of `path` or of its nearest existing parent; false when there is none.
bool DeviceOf(const std::string& path, dev_t* dev) {
  std::string p = path.empty() ? "." : path;
  for (int depth = 0; depth < 4096; ++depth) {
    struct stat st;
    if (::stat(p.c_str(), &st) == 0) {
      *dev = st.st_dev;
      return true;
    }
    const std::string parent = ParentDirectory(p);
    if (parent == p) return false;
    p = parent;
  }
  return false;
}

}  // namespace

bool SameFileSystem(const std::string& a, const std::string& b) {
  dev_t da = 0, db = 0;
  return DeviceOf(a, &da) && DeviceOf(b, &db) && da == db;
}

std::string FormatBytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (uint64_t{1} << 30)) return absl::StrFormat("%.1f GiB", b / (1 << 30));
  if (bytes >= (uint64_t{1} << 20)) return absl::StrFormat("%.1f MiB", b / (1 << 20));
  if (bytes >= (uint64_t{1} << 10)) return absl::StrFormat("%.1f KiB", b / (1 << 10));
  return absl::StrCat(bytes, " bytes");
}

}  // namespace fsdp
