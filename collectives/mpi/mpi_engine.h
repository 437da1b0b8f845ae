// The machinery of the mpi communicator. One engine thread per process makes every MPI call:
// it initializes MPI, starts each group's non-blocking collectives in sequence order and polls
// them (MPI_Test) so they progress while the callers compute.
//
// Each collective first exchanges a small fingerprint (kind, dtype, count, op, root, argument
// check) with MPI_Iallgather on a duplicate communicator; only when every rank's fingerprint
// agrees does the data collective start. So a mismatched schedule or bad arguments on one rank
// become an error on every rank, never corrupted data or a hang. A third duplicate carries
// point-to-point diagnostics: when a deadline passes, the rank asks its peers how many calls
// they have issued, names those that did not arrive, and tells every peer to fail the group.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "collectives/shm_channel.h"
#include "collectives/work_state.h"
#include "fsdp/communicator.h"

namespace fsdp::internal {

using Clock = std::chrono::steady_clock;

// What every rank contributes to the fingerprint exchange of one call (plain bytes on the wire).
struct FpRecord {
  int64_t seq, kind, dtype, count, op, root, color, key;
  uint64_t label_hash;
  uint64_t host_id;  // ThisHostId()
  uint64_t token;    // names the group's shared-memory segment (rank 0's is used)
  int32_t shm_ok;    // this rank may use shared memory inside the host
  int32_t invalid;
  char reason[176];  // this rank's argument error, truncated
};

class MpiGroup;

struct MpiOp {
  enum class Stage { kFingerprint, kReady, kData, kDone };
  CollectiveCall call;
  absl::Status invalid;
  int color = 0, key = 0;
  std::string label;
  int64_t seq = 0;
  std::shared_ptr<WorkState> work;

  // engine thread only
  Stage stage = Stage::kFingerprint;
  FpRecord mine{};
  std::vector<FpRecord> all;
  MPI_Request fp_req = MPI_REQUEST_NULL, data_req = MPI_REQUEST_NULL;
  std::vector<float> wide;   // f32 copy of a 16-bit reduction's data
  std::vector<char> scratch;  // output of an in-place f32 reduce_scatter
  bool use_shm = false;       // the data moves through the group's ShmChannel
  // A split whose communicators are being made on a thread of their own.
  std::shared_ptr<struct PendingSplit> split;
  ShmTransfer xfer;
  Clock::time_point deadline, data_start, issued;
};

// The communicators of a split made on a helper thread: `done` is set last.
struct PendingSplit {
  int rc = 0;
  MPI_Comm comm = MPI_COMM_NULL, ctrl = MPI_COMM_NULL, diag = MPI_COMM_NULL;
  uint64_t epoch = 0;  // agreed by the new group's ranks (MpiGroup::epoch_)
  std::atomic<bool> done{false};
};

// The split of a group: the new group, or null for a negative color.
struct MpiSplitPayload {
  std::shared_ptr<MpiGroup> group;
};

class MpiEngine;

class MpiGroup {
 public:
  // How the engine polls: kIdle every 2 ms (diagnostic queries only), kStalled every 1 ms
  // (calls waiting for peers for a while), kWaiting every 50 us, kBusy without sleeping.
  enum class Activity { kIdle, kStalled, kWaiting, kBusy };

  // `epoch`: the same on every rank of the group and, with high probability, different from
  // every earlier group's (see epoch_).
  MpiGroup(std::string name, CommOptions options, MPI_Comm data, MPI_Comm ctrl, MPI_Comm diag,
           uint64_t epoch);

  // Any thread.
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const CommOptions& options() const { return options_; }
  absl::Status health() const;
  void NoteIssued(int64_t seq) { issued_.store(seq + 1, std::memory_order_relaxed); }

  // Engine thread: "shm", "mpi" or "undecided" (before the first agreed call).
  const char* transport_name() const {
    return transport_ == Transport::kShm ? "shm" : transport_ == Transport::kMpi ? "mpi" : "undecided";
  }

  // Engine thread.
  void Open();  // posts the diagnostics receive
  void Add(std::shared_ptr<MpiOp> op);
  Activity Poll(MpiEngine& engine);
  void Expire(int64_t seq, absl::Duration waited);
  void Fail(absl::Status reason, int64_t seq, bool tell_peers);
  void BeginClose(std::function<void()> done) {
    closing_ = true;
    on_closed_ = std::move(done);
  }
  bool closed() const { return closed_; }
  void CloseNow();  // at shutdown: fail what is pending, free the communicators

 private:
  struct DiagMsg {
    int64_t type, seq, issued, code;
    uint64_t epoch;
    char text[472];
  };
  struct Diagnosis {
    int64_t seq;
    std::string what, why;
    Clock::time_point until;
    std::vector<int64_t> issued;  // per rank, -1 until it answers
  };

  void Verify(MpiOp& op);
  // Once per group, from the first agreed fingerprints: shared memory when every rank is on
  // this host and allows it.
  void DecideTransport(const MpiOp& op);
  // Advances the shared-memory calls in sequence order, one at a time.
  void PollShm();
  void StartData(MpiOp& op, MpiEngine& engine);
  void FinishData(MpiOp& op);
  // Completes a split once its communicators are made (op.split); before that, nothing.
  void FinishSplit(MpiOp& op, MpiEngine& engine);
  void StartDiagnosis(const MpiOp& op, std::string why);
  void ContinueDiagnosis();
  void PollDiag();
  void SendDiag(int to, const DiagMsg& msg);
  absl::Status NotRun(const MpiOp& op) const;
  std::string Header(const CollectiveCall& call, int64_t seq) const;

  const std::string name_;
  const CommOptions options_;
  MPI_Comm data_, ctrl_, diag_;
  int rank_ = 0, size_ = 1;
  std::atomic<int64_t> issued_{0};
  const uint64_t token_;
  // Tags this group's diagnostic messages. An abort sent as a peer closes its group can arrive
  // after that: Open MPI then hands it to the next communicator made on the same context id,
  // another group, which would fail for no reason of its own; it drops messages of another
  // epoch.
  const uint64_t epoch_;

  mutable std::mutex mu_;  // guards failure_ (read by any thread)
  absl::Status failure_;
  int64_t failure_seq_ = -1;

  // engine thread only
  std::deque<std::shared_ptr<MpiOp>> ops_;  // in sequence order, not yet done
  // Calls failed while MPI still held their requests. MPI may yet write into their buffers
  // (a late peer completes the exchange), so they outlive the group: the engine keeps them.
  std::vector<std::shared_ptr<MpiOp>> orphans_;
  std::optional<Diagnosis> diagnosis_;
  enum class Transport { kUndecided, kMpi, kShm } transport_ = Transport::kUndecided;
  std::unique_ptr<ShmChannel> shm_;
  DiagMsg diag_in_{};
  MPI_Request diag_recv_ = MPI_REQUEST_NULL;
  std::deque<std::pair<MPI_Request, std::unique_ptr<DiagMsg>>> diag_sends_;
  bool closing_ = false, closed_ = false;
  std::function<void()> on_closed_;
  friend class MpiEngine;
};

class MpiEngine {
 public:
  static MpiEngine& Get();
  ~MpiEngine() { Shutdown(); }

  // Starts the engine thread and initializes MPI (once); returns the result of that.
  absl::Status Start();
  // Runs cmd on the engine thread, in the order posted; false (and cmd is dropped) once the
  // engine has been shut down.
  bool Post(std::function<void()> cmd);
  // Runs fn on the engine thread and waits for it.
  absl::Status RunSync(const std::function<void()>& fn);
  void Shutdown();
  // OK, or the error of the first mpi group that failed (then MPI_Finalize could wait forever
  // for a peer that is gone or stuck).
  absl::Status Health();
  // MPI_Abort(MPI_COMM_WORLD, code) on the engine thread (or, if it does not answer within a
  // few seconds, on this one); mpirun then ends every rank. Never returns.
  [[noreturn]] void Abort(int code);
  // This process's rank in MPI_COMM_WORLD, once started (-1 before).
  // MPI allows calls from several threads at once (MPI_THREAD_MULTIPLE): splits then run their
  // blocking communicator creation on a thread of their own (MpiGroup::StartData).
  bool thread_multiple() const { return thread_multiple_; }
  int world_rank() const { return world_rank_.load(); }

  // Engine thread only.
  void AddGroup(std::shared_ptr<MpiGroup> group);
  // Duplicates `parent` three times without blocking; calls done with the three
  // communicators, or with an error if not every rank joined within `timeout`. The
  // duplications run one at a time, also across calls: Open MPI 4 can leave one rank's
  // MPI_Comm_idup unfinished for good when several are in flight on the same communicator
  // (open-mpi/ompi#2025), which made a join time out now and then. Then the processes agree on
  // the new group's epoch (an all-reduce of random draws), passed to done.
  void DupAsync(MPI_Comm parent, absl::Duration timeout,
                std::function<void(absl::Status, MPI_Comm[3], uint64_t)> done);

 private:
  bool thread_multiple_ = false;  // set before the loop starts
  MpiEngine() = default;
  void Loop();
  MpiGroup::Activity PollAll();

  std::once_flag once_;
  absl::Status start_status_;
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> cmds_;
  bool stop_ = false, shut_ = false;
  std::atomic<int> world_rank_{-1};

  // engine thread only
  bool we_initialized_ = false;
  std::vector<std::shared_ptr<MpiGroup>> groups_;
  struct PendingDup {
    MPI_Comm parent = MPI_COMM_NULL;
    // The step to start next: 0..2 the duplications, 3 the epoch's all-reduce;
    // reqs[next - 1] is the one in flight.
    int next = 0;
    MPI_Request reqs[4] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    MPI_Comm comms[3] = {MPI_COMM_NULL, MPI_COMM_NULL, MPI_COMM_NULL};
    uint64_t epoch_mine = 0, epoch = 0;  // this process's draw; their XOR over the processes
    Clock::time_point until;
    absl::Duration timeout;
    std::function<void(absl::Status, MPI_Comm[3], uint64_t)> done;
  };
  std::deque<std::unique_ptr<PendingDup>> dups_, dup_orphans_;
  // Starts d's next duplication, or finishes d with the error of a failed start; false then.
  bool StartNextDup(PendingDup& d);
  // Orphaned calls of closed groups; tested until MPI is done with them, freed at exit.
  std::vector<std::shared_ptr<MpiOp>> orphans_;
};

// The message of an MPI error code.
std::string MpiErrorString(int code);

// A random 64-bit draw (random_device, clock, pid, a counter).
uint64_t NewToken();

// Tests the requests MPI still holds for a failed call; true once none is left.
bool TestOrphan(MpiOp& op);

}  // namespace fsdp::internal
