// The shared-memory rounds of the mpi communicator's intra-host data path (see shm_channel.h).
#include "collectives/shm_channel.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <new>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collectives/reduce.h"

namespace fsdp::internal {
namespace {

constexpr uint64_t kMagic = 0x3170'6d68'7370'6466ULL;  // "fdpshm1" + version
constexpr size_t kLine = 64;
constexpr size_t kPage = 4096;

size_t RoundUp(size_t v, size_t to) { return (v + to - 1) / to * to; }

int64_t Total(const CollectiveCall& c) { return c.count; }

}  // namespace

struct ShmChannel::Header {
  std::atomic<uint64_t> magic;
  int64_t size;
  int64_t half_bytes;
  std::atomic<int32_t> attached;
};

struct alignas(kLine) ShmChannel::Counters {
  std::atomic<int64_t> ready;    // rounds whose part this rank has copied in
  std::atomic<int64_t> reduced;  // all_reduce: rounds whose slice this rank has reduced
  std::atomic<int64_t> done;     // rounds this rank has finished reading
};

static_assert(std::atomic<int64_t>::is_always_lock_free, "shared-memory counters need lock-free atomics");

ShmChannel::ShmChannel(std::string name, int rank, int size, size_t half_bytes)
    : name_(std::move(name)), rank_(rank), size_(size), half_bytes_(half_bytes) {
  bytes_ = kPage + RoundUp(static_cast<size_t>(size_) * sizeof(Counters), kPage) +
           static_cast<size_t>(size_) * 2 * half_bytes_;
}

ShmChannel::~ShmChannel() {
  if (base_ != nullptr) munmap(base_, bytes_);
  if (fd_ >= 0) close(fd_);
  if (created_) Unlink();  // a peer that never came must not leave the name behind
}

void ShmChannel::Unlink() {
  if (unlinked_) return;
  unlinked_ = true;
  shm_unlink(name_.c_str());  // ENOENT when a peer was first: fine
}

ShmChannel::Counters& ShmChannel::counters(int q) const {
  return reinterpret_cast<Counters*>(base_ + kPage)[q];
}

char* ShmChannel::half(int q, int64_t round) const {
  const size_t slots = kPage + RoundUp(static_cast<size_t>(size_) * sizeof(Counters), kPage);
  return base_ + slots + (static_cast<size_t>(q) * 2 + static_cast<size_t>(round & 1)) * half_bytes_;
}

absl::StatusOr<bool> ShmChannel::Attach() {
  if (base_ != nullptr) return true;
  auto sys_error = [&](const char* what, int err) {
    return absl::Status(
        err == ENOSPC || err == ENOMEM ? absl::StatusCode::kResourceExhausted
                                       : absl::StatusCode::kInternal,
        absl::StrFormat("shared memory segment %s (%d bytes for %d ranks on this host): %s: %s%s",
                        name_, bytes_, size_, what, std::strerror(err),
                        err == ENOSPC || err == ENOMEM
                            ? "; /dev/shm is too small: enlarge it (docker --shm-size, a "
                              "Kubernetes emptyDir with medium Memory on /dev/shm) or set "
                              "FSDP_MPI_SHM=0 to use Open MPI's collectives inside a host"
                            : ""));
  };
  if (rank_ == 0) {
    fd_ = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd_ < 0) return sys_error("shm_open (create)", errno);
    created_ = true;
    if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) return sys_error("ftruncate", errno);
    // Reserve the pages now: tmpfs gives SIGBUS on the first touch of a page it has no room for.
    if (const int rc = posix_fallocate(fd_, 0, static_cast<off_t>(bytes_)); rc != 0) {
      return sys_error("posix_fallocate", rc);
    }
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) return sys_error("mmap", errno);
    base_ = static_cast<char*>(p);
    auto* h = new (base_) Header{};
    h->size = size_;
    h->half_bytes = static_cast<int64_t>(half_bytes_);
    for (int q = 0; q < size_; ++q) new (&counters(q)) Counters{};
    h->attached.store(1, std::memory_order_relaxed);
    h->magic.store(kMagic, std::memory_order_release);
  } else {
    const int fd = shm_open(name_.c_str(), O_RDWR, 0600);
    if (fd < 0) {
      if (errno == ENOENT) return false;  // rank 0 has not made it yet
      return sys_error("shm_open", errno);
    }
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < kPage) {
      close(fd);  // not sized yet
      return false;
    }
    // The header first: a segment of another shape is an error, not a wait.
    void* hp = mmap(nullptr, kPage, PROT_READ, MAP_SHARED, fd, 0);
    if (hp == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return sys_error("mmap", err);
    }
    const auto* hh = static_cast<const Header*>(hp);
    if (hh->magic.load(std::memory_order_acquire) != kMagic) {  // not initialized yet
      munmap(hp, kPage);
      close(fd);
      return false;
    }
    if (hh->size != size_ || hh->half_bytes != static_cast<int64_t>(half_bytes_)) {
      const std::string what = absl::StrFormat(
          "shared memory segment %s was made for %d ranks with %d-byte halves, this rank "
          "expects %d ranks and %d-byte halves (ranks built from different versions?)",
          name_, hh->size, hh->half_bytes, size_, half_bytes_);
      munmap(hp, kPage);
      close(fd);
      return absl::FailedPreconditionError(what);
    }
    munmap(hp, kPage);
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      close(fd);
      return sys_error("mmap", err);
    }
    auto* h = reinterpret_cast<Header*>(p);
    fd_ = fd;
    base_ = static_cast<char*>(p);
    h->attached.fetch_add(1, std::memory_order_acq_rel);
  }
  return true;
}

bool ShmChannel::AllAtLeast(std::atomic<int64_t> Counters::*field, int64_t target) const {
  for (int q = 0; q < size_; ++q) {
    if ((counters(q).*field).load(std::memory_order_acquire) < target) return false;
  }
  return true;
}

void ShmChannel::Publish(std::atomic<int64_t> Counters::*field, int64_t value) {
  (counters(rank_).*field).store(value, std::memory_order_release);
}

int64_t ShmChannel::PieceLimit(const CollectiveCall& c) const {
  const auto e = static_cast<int64_t>(DTypeSize(c.dtype));
  const auto h = static_cast<int64_t>(half_bytes_);
  if (c.kind == CollectiveKind::kReduceScatter || c.kind == CollectiveKind::kAllToAll) {
    return std::max<int64_t>(1, h / (e * size_));
  }
  return std::max<int64_t>(1, h / e);
}

bool ShmChannel::Begin(ShmTransfer& t) {
  const int64_t r = next_round_;
  // This half was last used by round r - 2: every rank must have finished reading it.
  if (r >= 2 && !AllAtLeast(&Counters::done, r - 1)) return false;
  t.round = r;
  t.piece = std::min(PieceLimit(t.call), Total(t.call) - t.pos);
  ++next_round_;
  return true;
}

void ShmChannel::CopyIn(const ShmTransfer& t) {
  const CollectiveCall& c = t.call;
  const size_t e = DTypeSize(c.dtype);
  char* mine = half(rank_, t.round);
  const char* send = static_cast<const char*>(c.send);
  // Plain stores (not coll::CopyBytes' streaming ones): the peers read the half right away,
  // from the shared cache when it is still there. What only this rank reads (its own piece of
  // a reduce_scatter, its own slice of an all_reduce) stays in its send buffer.
  switch (c.kind) {
    case CollectiveKind::kAllGather:
      std::memcpy(mine, send + t.pos * e, t.piece * e);
      break;
    case CollectiveKind::kAllReduce: {
      int64_t lo, hi;
      Slice(t, rank_, &lo, &hi);
      std::memcpy(mine, send + t.pos * e, lo * e);
      std::memcpy(mine + hi * e, send + (t.pos + hi) * e, (t.piece - hi) * e);
      break;
    }
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
      for (int d = 0; d < size_; ++d) {
        if (d == rank_) continue;
        std::memcpy(mine + d * t.piece * e, send + (d * c.count + t.pos) * e, t.piece * e);
      }
      break;
    case CollectiveKind::kBroadcast:
      if (rank_ == c.root) std::memcpy(mine, static_cast<const char*>(c.recv) + t.pos * e, t.piece * e);
      break;
    default:
      break;
  }
}

void ShmChannel::Slice(const ShmTransfer& t, int q, int64_t* lo, int64_t* hi) const {
  const auto align = static_cast<int64_t>(kLine / DTypeSize(t.call.dtype));
  const int64_t per = ((t.piece + size_ - 1) / size_ + align - 1) / align * align;
  *lo = std::min(t.piece, q * per);
  *hi = std::min(t.piece, *lo + per);
}

bool ShmChannel::Advance(ShmTransfer& t) {
  if (base_ == nullptr) return false;
  auto* h = reinterpret_cast<Header*>(base_);
  if (!unlinked_ && h->attached.load(std::memory_order_acquire) == size_) Unlink();
  const CollectiveCall& c = t.call;
  const size_t e = DTypeSize(c.dtype);
  const int n = size_;
  char* recv = static_cast<char*>(c.recv);
  const char* send = static_cast<const char*>(c.send);
  for (;;) {
    switch (t.phase) {
      case 0:
        if (t.pos >= Total(c)) return true;
        if (!Begin(t)) return false;
        CopyIn(t);
        Publish(&Counters::ready, t.round + 1);
        t.phase = 1;
        [[fallthrough]];
      case 1: {
        if (!AllAtLeast(&Counters::ready, t.round + 1)) return false;
        switch (c.kind) {
          case CollectiveKind::kAllGather:
            // Its own piece straight from its send buffer; then each peer's, starting with the
            // next rank, so that the ranks read different slots at a time.
            coll::CopyBytes(recv + (rank_ * c.count + t.pos) * e,
                            static_cast<const char*>(c.send) + t.pos * e, t.piece * e);
            for (int k = 1; k < n; ++k) {
              const int q = (rank_ + k) % n;
              coll::CopyBytes(recv + (q * c.count + t.pos) * e, half(q, t.round), t.piece * e);
            }
            break;
          case CollectiveKind::kReduceScatter: {
            std::vector<const void*> srcs(n);
            for (int q = 0; q < n; ++q) srcs[q] = half(q, t.round) + rank_ * t.piece * e;
            srcs[rank_] = send + (rank_ * c.count + t.pos) * e;  // not copied in
            coll::ReduceBuffers(c.dtype, c.op, srcs.data(), n, recv + t.pos * e, t.piece, n);
            break;
          }
          case CollectiveKind::kAllToAll:
            // Its own chunk straight from its send buffer, then each peer's piece for it.
            coll::CopyBytes(recv + (rank_ * c.count + t.pos) * e,
                            send + (rank_ * c.count + t.pos) * e, t.piece * e);
            for (int k = 1; k < n; ++k) {
              const int q = (rank_ + k) % n;
              coll::CopyBytes(recv + (q * c.count + t.pos) * e,
                              half(q, t.round) + rank_ * t.piece * e, t.piece * e);
            }
            break;
          case CollectiveKind::kAllReduce: {
            int64_t lo, hi;
            Slice(t, rank_, &lo, &hi);
            std::vector<const void*> srcs(n);
            for (int q = 0; q < n; ++q) srcs[q] = half(q, t.round) + lo * e;
            srcs[rank_] = send + (t.pos + lo) * e;  // not copied in
            // Into this rank's own slot: only this rank reads that slice of it in this phase.
            coll::ReduceBuffers(c.dtype, c.op, srcs.data(), n, half(rank_, t.round) + lo * e,
                                hi - lo, n);
            Publish(&Counters::reduced, t.round + 1);
            t.phase = 2;
            continue;
          }
          case CollectiveKind::kBroadcast:
            if (rank_ != c.root) coll::CopyBytes(recv + t.pos * e, half(c.root, t.round), t.piece * e);
            break;
          default:
            break;
        }
        Publish(&Counters::done, t.round + 1);
        t.pos += t.piece;
        t.phase = 0;
        continue;
      }
      case 2: {
        if (!AllAtLeast(&Counters::reduced, t.round + 1)) return false;
        for (int k = 0; k < n; ++k) {
          const int q = (rank_ + k) % n;
          int64_t lo, hi;
          Slice(t, q, &lo, &hi);
          coll::CopyBytes(recv + (t.pos + lo) * e, half(q, t.round) + lo * e, (hi - lo) * e);
        }
        Publish(&Counters::done, t.round + 1);
        t.pos += t.piece;
        t.phase = 0;
        continue;
      }
      default:
        return true;
    }
  }
}

std::string ShmChannel::DescribeWait(const ShmTransfer& t) const {
  if (base_ == nullptr) {
    return absl::StrFormat("rank %d could not open the shared memory segment %s: rank 0 of the "
                           "group has not made it",
                           rank_, name_);
  }
  std::atomic<int64_t> Counters::*field = &Counters::done;
  int64_t target = t.round - 1;
  const char* what = "finished reading the round before last";
  if (t.phase == 0) {
    target = next_round_ - 1;
  } else if (t.phase == 1) {
    field = &Counters::ready;
    target = t.round + 1;
    what = "copied in their part of the round";
  } else {
    field = &Counters::reduced;
    target = t.round + 1;
    what = "reduced their slice of the round";
  }
  std::vector<int> behind;
  for (int q = 0; q < size_; ++q) {
    if ((counters(q).*field).load(std::memory_order_acquire) < target) behind.push_back(q);
  }
  return absl::StrFormat("waiting in shared memory round %d for ranks [%s], which have not %s",
                         t.phase == 0 ? next_round_ : t.round, absl::StrJoin(behind, ", "), what);
}

uint64_t ThisHostId() {
  static const uint64_t id = [] {
    char host[256] = {};
    gethostname(host, sizeof(host) - 1);
    std::string boot;
    std::ifstream f("/proc/sys/kernel/random/boot_id");
    std::getline(f, boot);
    const std::string key = std::string(host) + "|" + boot;
    uint64_t h = 1469598103934665603ULL;  // FNV-1a
    for (unsigned char ch : key) {
      h ^= ch;
      h *= 1099511628211ULL;
    }
    return h;
  }();
  return id;
}

}  // namespace fsdp::internal
