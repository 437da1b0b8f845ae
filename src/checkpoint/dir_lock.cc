// CheckpointDirLock: flock(2) on PARENT/.fsdp-lock. The kernel releases it when the process
// ends, however it ends, so a lock is never left behind. Inside one process the lock is
// counted (keyed by the directory's device and inode): the trainer holds it for the run and
// SaveCheckpoint takes it again for each save without conflict.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/checkpoint.h"
#include "fsdp/files.h"
#include "src/checkpoint/file_io.h"

namespace fsdp {
namespace {

struct Held {
  int fd = -1;
  int count = 0;
  bool locked = true;  // false on a file system without locks
  std::string path;    // the lock file, removed on release
};

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
std::map<std::pair<dev_t, ino_t>, Held>& Registry() {
  static auto* r = new std::map<std::pair<dev_t, ino_t>, Held>;
  return *r;
}

// "pid 1234 on host h since 2026-12-03 10:00:00 UTC: train_gpt --checkpoint_dir ck".
std::string Holder() {
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char when[64];
  std::strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S UTC", &tm);
  std::string cmd;  // /proc files report size 0: read to the end
  if (const int fd = ::open("/proc/self/cmdline", O_RDONLY | O_CLOEXEC); fd >= 0) {
    char buf[512];
    ssize_t n;
    while (cmd.size() < 4096 && (n = ::read(fd, buf, sizeof(buf))) > 0) cmd.append(buf, n);
    ::close(fd);
    for (char& ch : cmd) ch = ch == '\0' ? ' ' : ch;
    while (!cmd.empty() && cmd.back() == ' ') cmd.pop_back();
    if (cmd.size() > 300) cmd = cmd.substr(0, 300) + " ...";
  }
  return absl::StrFormat("pid %d on host %s since %s%s", ::getpid(), host, when,
                         cmd.empty() ? "" : absl::StrCat(": ", cmd));
}

}  // namespace

absl::StatusOr<CheckpointDirLock> CheckpointDirLock::Acquire(const std::string& parent) {
  if (parent.empty()) return absl::InvalidArgumentError("the checkpoint directory name is empty");
  FSDP_RETURN_IF_ERROR(checkpoint::MakeDirectory(parent));
  struct stat dir;
  if (::stat(parent.c_str(), &dir) != 0 || !S_ISDIR(dir.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(parent, " is ", DescribePath(parent), ", not a directory"));
  }
  const std::pair<dev_t, ino_t> key{dir.st_dev, dir.st_ino};
  const std::string path = absl::StrCat(parent, "/", kCheckpointLockFile);
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find(key);
  if (it != Registry().end()) {  // this process holds it already
    ++it->second.count;
    CheckpointDirLock again(key.first, key.second);
    again.locked_ = it->second.locked;
    return again;
  }
  // The lock file is removed when the lock is released, so a file opened just before that
  // may be locked after it: the lock counts only while the path still names the locked file.
  int fd = -1;
  bool locked = true;
  for (int attempt = 0;; ++attempt) {
    fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0) {
      const int err = errno;
      if (err == ELOOP || err == EISDIR) {
        return absl::FailedPreconditionError(absl::StrCat(
            path, " is ", DescribePath(path), ", not the lock file of a checkpoint directory; "
            "remove it"));
      }
      return absl::Status(err == EACCES || err == EPERM ? absl::StatusCode::kPermissionDenied
                                                        : absl::StatusCode::kFailedPrecondition,
                          absl::StrCat("cannot lock ", parent, ": creating ", path, " failed: ",
                                       std::strerror(err)));
    }
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          path, " is ", DescribePath(path), ", not the lock file of a checkpoint directory; "
          "remove it"));
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) {
        std::string who(4096, '\0');
        const ssize_t n = ::pread(fd, who.data(), who.size(), 0);
        who.resize(n > 0 ? static_cast<size_t>(n) : 0);
        ::close(fd);
        while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
        return absl::FailedPreconditionError(absl::StrCat(
            parent, " is in use by another job (", who.empty() ? "a process" : who,
            "; it holds the lock on ", path,
            "). Two jobs saving into one directory would remove each other's saves: wait for "
            "that job to end, or give this one another checkpoint directory"));
      }
      // A file system without locks (ENOLCK, EOPNOTSUPP): go on unlocked, as before.
      locked = false;
      break;
    }
    struct stat now;
    if (::stat(path.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      break;
    }
    ::close(fd);  // released and removed by its holder meanwhile: take the new one
    if (attempt == 100) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot lock ", parent, ": ", path, " keeps being replaced"));
    }
  }
  if (locked) {
    const std::string who = Holder() + "\n";
    if (::ftruncate(fd, 0) == 0) {
      [[maybe_unused]] const ssize_t w = ::pwrite(fd, who.data(), who.size(), 0);
    }
  }
  Registry()[key] = Held{fd, 1, locked, path};
  CheckpointDirLock out(key.first, key.second);
  out.locked_ = locked;
  return out;
}

CheckpointDirLock::CheckpointDirLock(CheckpointDirLock&& o) noexcept
    : dev_(o.dev_), ino_(o.ino_), active_(o.active_), locked_(o.locked_) {
  o.active_ = false;
}

CheckpointDirLock::~CheckpointDirLock() {
  if (!active_) return;
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto it = Registry().find({static_cast<dev_t>(dev_), static_cast<ino_t>(ino_)});
  if (it == Registry().end() || --it->second.count > 0) return;
  // Removed while still locked (a process waiting on this file then sees it is stale), then
  // released by the close.
  if (it->second.locked) ::unlink(it->second.path.c_str());
  ::close(it->second.fd);
  Registry().erase(it);
}

}  // namespace fsdp
