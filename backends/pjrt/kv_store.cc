// CreateCommKeyValueStore (fsdp/pjrt_client.h): a key-value store for PJRT plugins, kept whole
// in every process and synchronised over a communicator of one rank per process.
//
// A thread per process runs rounds: each round all-gathers (the bytes of the puts this process
// made since the last round, whether it is closing), then all-gathers the puts themselves
// (padded to the longest), and adds the other processes' puts. A round follows at once while
// puts flow; idle, the thread waits up to kMaxIdle between rounds. The rounds end when every
// process is closing (its store destroyed), so that no process leaves a peer waiting in a
// round.
#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/pjrt_client.h"

namespace fsdp::pjrt {
namespace {

constexpr auto kMaxIdle = std::chrono::milliseconds(10);

void Append(std::vector<uint8_t>& out, const std::string& s) {
  const auto n = static_cast<uint32_t>(s.size());
  const auto* p = reinterpret_cast<const uint8_t*>(&n);
  out.insert(out.end(), p, p + 4);
  out.insert(out.end(), s.begin(), s.end());
}

class CommKeyValueStore final : public KeyValueStore {
 public:
  explicit CommKeyValueStore(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~CommKeyValueStore() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
    }
    wake_.notify_all();
    thread_.join();
  }

  absl::Status Put(const std::string& key, const std::string& value) override {
    std::lock_guard<std::mutex> lock(mu_);
    FSDP_RETURN_IF_ERROR(failure_);
    auto [it, added] = kv_.emplace(key, value);
    if (!added) {
      if (it->second == value) return absl::OkStatus();
      return absl::AlreadyExistsError(
          absl::StrCat("key-value store: '", key, "' is already set to another value"));
    }
    outbox_.emplace_back(key, value);
    wake_.notify_all();
    got_.notify_all();
    return absl::OkStatus();
  }

  absl::StatusOr<std::string> Get(const std::string& key, absl::Duration timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    const auto deadline = std::chrono::steady_clock::now() + absl::ToChronoNanoseconds(timeout);
    for (;;) {
      if (auto it = kv_.find(key); it != kv_.end()) return it->second;
      FSDP_RETURN_IF_ERROR(failure_);
      if (got_.wait_until(lock, deadline) == std::cv_status::timeout &&
          kv_.find(key) == kv_.end()) {
        return absl::DeadlineExceededError(
            absl::StrCat("key-value store: no process set '", key, "' within ",
                         absl::FormatDuration(timeout)));
      }
    }
  }

  absl::StatusOr<std::string> TryGet(const std::string& key) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = kv_.find(key); it != kv_.end()) return it->second;
    FSDP_RETURN_IF_ERROR(failure_);
    return absl::NotFoundError(absl::StrCat("key-value store: '", key, "' is not set"));
  }

 private:
  // One round; false when every process is closing.
  absl::StatusOr<bool> Round() {
    std::vector<uint8_t> mine;
    int64_t closing = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [k, v] : outbox_) {
        Append(mine, k);
        Append(mine, v);
      }
      outbox_.clear();
      closing = closing_ ? 1 : 0;
    }
    const int n = comm_->size();
    int64_t head[2] = {static_cast<int64_t>(mine.size()), closing};
    std::vector<int64_t> heads(2 * static_cast<size_t>(n));
    FSDP_RETURN_IF_ERROR(comm_->AllGather(head, heads.data(), 2, DType::kI64));
    int64_t longest = 0, closed = 0;
    for (int q = 0; q < n; ++q) {
      longest = std::max(longest, heads[2 * q]);
      closed += heads[2 * q + 1];
    }
    if (longest > 0) {
      mine.resize(static_cast<size_t>(longest));
      std::vector<uint8_t> all(static_cast<size_t>(longest * n));
      FSDP_RETURN_IF_ERROR(comm_->AllGather(mine.data(), all.data(), longest, DType::kU8));
      std::lock_guard<std::mutex> lock(mu_);
      for (int q = 0; q < n; ++q) {
        if (q == comm_->rank()) continue;
        const uint8_t* p = all.data() + q * longest;
        const uint8_t* end = p + heads[2 * q];
        while (p + 8 <= end) {
          std::string kv[2];
          for (std::string& s : kv) {
            uint32_t len;
            std::memcpy(&len, p, 4);
            s.assign(reinterpret_cast<const char*>(p + 4), len);
            p += 4 + len;
          }
          kv_.emplace(std::move(kv[0]), std::move(kv[1]));  // the first value of a key stays
        }
      }
      got_.notify_all();
    }
    last_busy_ = longest > 0;
    return closed < n;
  }

  void Loop() {
    for (;;) {
      absl::StatusOr<bool> more = Round();
      if (!more.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        failure_ = absl::Status(more.status().code(),
                                absl::StrCat("key-value store: ", more.status().message()));
        got_.notify_all();
        return;
      }
      if (!*more) return;
      if (last_busy_) continue;
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait_for(lock, kMaxIdle, [&] { return closing_ || !outbox_.empty(); });
    }
  }

  std::unique_ptr<Communicator> comm_;
  std::mutex mu_;
  std::condition_variable wake_, got_;
  std::map<std::string, std::string> kv_;
  std::vector<std::pair<std::string, std::string>> outbox_;
  bool closing_ = false;
  bool last_busy_ = false;  // the loop's own
  absl::Status failure_;
  std::thread thread_;  // last: started when the rest is ready
};

}  // namespace

absl::StatusOr<std::shared_ptr<KeyValueStore>> CreateCommKeyValueStore(
    std::unique_ptr<Communicator> comm) {
  if (comm == nullptr) return absl::InvalidArgumentError("CreateCommKeyValueStore: no communicator");
  return std::shared_ptr<KeyValueStore>(new CommKeyValueStore(std::move(comm)));
}

}  // namespace fsdp::pjrt
