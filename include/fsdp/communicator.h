// Collective communication between the ranks of a group: the Communicator interface that every
// transport implements (local threads, Open MPI, later NCCL), the Work handle of an
// asynchronous collective, and the options every group shares (deadline, simulated link).
//
// Semantics (docs/collectives.md has the long form):
// - Every call is collective: all ranks of the group make the same calls in the same order.
//   Each call gets the next sequence number of the group; ranks that call different
//   collectives (kind, dtype, count, reduction, root) at the same sequence number get an
//   error on every rank, and the group fails: its later calls fail at once.
// - Asynchronous forms return at once with a Work handle; the call's buffers belong to the
//   communicator until the Work has completed. Synchronous forms wait on that handle.
// - Every wait has a deadline (CommOptions::timeout). A rank that does not arrive turns into
//   a DeadlineExceeded error on the ranks that wait, naming the collective, the group, its
//   sequence number and the ranks that did not arrive; the group then fails.
// - Invalid arguments (negative count, null buffer, bad root, buffer sizes that do not fit)
//   are reported on every rank of the group, not just the one that made the mistake, and do
//   not fail the group.
// - In-place as NCCL defines it: all_reduce and broadcast with send == recv; all_gather with
//   send == recv + rank * count_per_rank; reduce_scatter with recv == send + rank *
//   count_per_rank (the other chunks of the buffer are left unspecified). all_to_all is never
//   in place: its send and recv must not overlap.
// - Counts are in elements. Sizes that do not divide by the group size are the caller's to
//   pad (ShardCount / PaddedCount); the buffer-view overloads check the sizes and say what is
//   wrong.
// - bf16 and f16 reductions accumulate in f32 and round once. kAvg is the sum divided by the
//   group size, in f32. Reductions take f32, bf16 and f16; all_gather and broadcast move any
//   dtype (control data: u8 bytes, i64 integers), and so does all_to_all (the quantized
//   gradient reduction exchanges u8 codes with it).
// - Buffers are host memory: the local transport copies between its peers' buffers, the MPI
//   one hands them to Open MPI. A communicator is the control plane of its group, and the data
//   plane of a host backend; device memory moves through the backend's DataPlane
//   (fsdp/data_plane.h).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "absl/time/time.h"
#include "fsdp/collective_types.h"
#include "fsdp/dtype.h"
#include "fsdp/status.h"

namespace fsdp {

// ReduceOp, CollectiveKind and their names: fsdp/collective_types.h.

// The deadline used when none is given: $FSDP_COMM_TIMEOUT_S seconds (a decimal number > 0)
// when set and valid, else 60 s. It never fails: programs should call CommTimeoutFromEnv()
// at start-up to reject an invalid value rather than have it ignored here.
absl::Duration DefaultCommTimeout();
// $FSDP_COMM_TIMEOUT_S: 60 s when unset or empty, else ParseCommTimeoutSeconds of its value.
absl::StatusOr<absl::Duration> CommTimeoutFromEnv();
// A value of FSDP_COMM_TIMEOUT_S: a decimal number of seconds, > 0 and < 1e9, without a unit
// ("30", "2.5"). Anything else ("5s", "0", "-1", "") is InvalidArgument naming the variable
// and the value.
absl::StatusOr<absl::Duration> ParseCommTimeoutSeconds(std::string_view text);
// $FSDP_MPI_SHM for the mpi communicator: true (shared memory inside a host) when unset, empty
// or "1", false for "0"; anything else is InvalidArgument naming the variable and the value.
// Programs check it at start-up, before CreateMpiWorld, to report it once as bad usage.
absl::StatusOr<bool> MpiSharedMemoryFromEnv();

struct CommOptions {
  // How long a rank waits for its peers to arrive at a collective, and the default deadline
  // of Work::Wait().
  absl::Duration timeout = DefaultCommTimeout();
  // Simulated link, honoured by the local communicator only (0 = off): each transfer of S
  // bytes between two ranks takes at least link_latency + S / link_bytes_per_second, so a
  // benchmark or test can make a step communication-bound on purpose.
  double link_bytes_per_second = 0;
  absl::Duration link_latency = absl::ZeroDuration();
  // A second, slower level of the simulated link (hosts): with ranks_per_host > 0, world ranks
  // r and q share a host when r / ranks_per_host == q / ranks_per_host, and a transfer between
  // two hosts takes inter_host_latency + S / inter_host_bytes_per_second instead of the link_*
  // figures (which then describe the link inside a host). ranks_per_host == 0: one level.
  int ranks_per_host = 0;
  double inter_host_bytes_per_second = 0;
  absl::Duration inter_host_latency = absl::ZeroDuration();
  // The mpi communicator: a group whose ranks all run on one host (same hostname and boot id)
  // moves the data of all_gather, reduce_scatter, all_reduce and broadcast through a POSIX
  // shared-memory segment (/dev/shm/fsdp-*) instead of Open MPI's collectives; groups that
  // span hosts use Open MPI. false: Open MPI inside a host too. CreateMpiWorld sets it to false
  // when $FSDP_MPI_SHM is 0. Ignored by the local communicator (it shares memory anyway).
  bool mpi_shared_memory = true;
};

// One collective call, as the group compares it across ranks. Fields a kind does not use are
// zero (kSum, root 0) so that equal calls compare equal.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  const void* send = nullptr;
  void* recv = nullptr;  // also the buffer of broadcast
  int64_t count = 0;     // per rank for all_gather / reduce_scatter / all_to_all, else the whole buffer
  DType dtype = DType::kF32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  // Same kind, dtype, count, op and root (the buffers are each rank's own).
  bool SameSchedule(const CollectiveCall& o) const {
    return kind == o.kind && dtype == o.dtype && count == o.count && op == o.op && root == o.root;
  }
};
// "all_gather(count=10, f32)", "reduce_scatter(count=3, bf16, avg)", "broadcast(count=4, f16, root=1)".
std::string DescribeCall(const CollectiveCall& call);
// The verdict when the ranks of group `group` made different calls at sequence `seq`:
// FailedPrecondition "schedule mismatch at sequence <seq> of group '<group>'<where>: ranks [0, 2]
// called <call>; ranks [1] called <call>; every rank must issue the same collectives in the same
// order; the group failed", `calls[q]` describing rank q's call (DescribeCall and more).
absl::Status ScheduleMismatch(int64_t seq, std::string_view group,
                              const std::vector<std::string>& calls, std::string_view where = "");
// Checks the arguments of `call` as made by `rank` of a group of `size` (counts, pointers,
// root, in-place aliasing). OK or InvalidArgument saying what is wrong.
absl::Status ValidateCall(const CollectiveCall& call, int rank, int size);

// Padding helpers: elements per rank for `count` elements over `ranks` ranks, and the padded
// total that every rank's buffers must hold.
constexpr int64_t ShardCount(int64_t count, int ranks) { return (count + ranks - 1) / ranks; }
constexpr int64_t PaddedCount(int64_t count, int ranks) { return ShardCount(count, ranks) * ranks; }

// A typed view of a caller's buffer, for the overloads that check sizes.
struct ConstBufferView {
  const void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kF32;
};
struct BufferView {
  void* data = nullptr;
  int64_t count = 0;
  DType dtype = DType::kF32;
  operator ConstBufferView() const { return {data, count, dtype}; }  // NOLINT: implicit on purpose
};

namespace internal {
class WorkState;
}

// The handle of an asynchronous collective. Copies share the same state. Waiting from several
// threads at once is allowed.
class Work {
 public:
  Work() = default;  // empty: Test() is true, Wait() fails with FailedPrecondition
  explicit Work(std::shared_ptr<internal::WorkState> state);

  // Waits until the collective completes and returns its status; at most the communicator's
  // timeout. If the deadline passes first, the group is failed (so that no rank keeps using
  // this rank's buffers) and DeadlineExceeded is returned, naming the collective, the group,
  // its sequence number and the ranks that had not arrived.
  absl::Status Wait() const;
  absl::Status Wait(absl::Duration timeout) const;
  // True once the collective has completed (successfully or not); never blocks.
  bool Test() const;
  // When the collective completed, once Test() is true (the timeline of the sharding
  // runtime uses it to show how long each gather and reduction was in flight).
  std::optional<std::chrono::steady_clock::time_point> completed_at() const;
  bool valid() const { return state_ != nullptr; }
  // "all_gather(count=10, f32) at sequence 3 of group 'world'".
  std::string description() const;

  const std::shared_ptr<internal::WorkState>& state() const { return state_; }

 private:
  std::shared_ptr<internal::WorkState> state_;
};

// Waits for every handle (each with its own default deadline) and returns the first error.
absl::Status WaitAll(std::span<const Work> works);

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The group's name: "world", "world/shard0", "world/split1" ...
  virtual const std::string& name() const = 0;
  // The transport: "local" or "mpi".
  virtual std::string_view backend() const = 0;
  virtual const CommOptions& options() const = 0;
  // "local group 'world' rank 1 of 4".
  std::string description() const;

  // --- asynchronous collectives; the buffers must stay valid until the Work completes ---
  // recv[q * count_per_rank ...] = send of rank q, for every rank q.
  Work AllGatherAsync(const void* send, void* recv, int64_t count_per_rank, DType dtype);
  // recv = op over ranks q of send_q[rank * count_per_rank ...][0 .. count_per_rank).
  Work ReduceScatterAsync(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                          ReduceOp op);
  Work AllReduceAsync(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op);
  Work BroadcastAsync(void* buf, int64_t count, DType dtype, int root);
  Work BarrierAsync();
  // recv[q * count_per_rank ...] = send_q[rank * count_per_rank ...][0 .. count_per_rank), for
  // every rank q (MPI_Alltoall, ncclAlltoAll): chunk d of each rank's send goes to rank d.
  // send and recv hold size() * count_per_rank elements each and must not overlap.
  Work AllToAllAsync(const void* send, void* recv, int64_t count_per_rank, DType dtype);

  // Size-checked forms: recv.count must be size() * send.count (all_gather), send.count must
  // be size() * recv.count (reduce_scatter), equal counts for all_reduce, equal dtypes.
  Work AllGatherAsync(ConstBufferView send, BufferView recv);
  Work ReduceScatterAsync(ConstBufferView send, BufferView recv, ReduceOp op);
  Work AllReduceAsync(ConstBufferView send, BufferView recv, ReduceOp op);
  // Equal counts, a multiple of size().
  Work AllToAllAsync(ConstBufferView send, BufferView recv);

  // --- synchronous forms: the asynchronous call, then Wait() ---
  absl::Status AllGather(const void* send, void* recv, int64_t count_per_rank, DType dtype);
  absl::Status ReduceScatter(const void* send, void* recv, int64_t count_per_rank, DType dtype,
                             ReduceOp op);
  absl::Status AllReduce(const void* send, void* recv, int64_t count, DType dtype, ReduceOp op);
  absl::Status Broadcast(void* buf, int64_t count, DType dtype, int root);
  absl::Status Barrier();
  absl::Status AllGather(ConstBufferView send, BufferView recv);
  absl::Status ReduceScatter(ConstBufferView send, BufferView recv, ReduceOp op);
  absl::Status AllReduce(ConstBufferView send, BufferView recv, ReduceOp op);
  absl::Status AllToAll(const void* send, void* recv, int64_t count_per_rank, DType dtype);
  absl::Status AllToAll(ConstBufferView send, BufferView recv);

  // Collective, like MPI_Comm_split: ranks that pass the same color >= 0 form a new group,
  // ranked by (key, rank in this group). A negative color gives no group (nullptr). The new
  // group is named "<this name>/<label><color>" (label "split" when empty) and inherits the
  // options. Ordered with the other collectives of this group.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Split(int color, int key,
                                                              std::string_view label = {}) = 0;

  // Fails the group on every rank: calls in flight and later calls return `reason`.
  virtual void Abort(const absl::Status& reason) = 0;
  // OK, or the error that failed the group.
  virtual absl::Status health() const = 0;

  // How many collectives of `kind` this rank has issued on this group since it was made: every
  // all_gather, reduce_scatter, all_reduce, broadcast, barrier and all_to_all through the entry points
  // above, whatever its outcome (Split is not counted). One relaxed atomic add per call; tests
  // assert from it how many collectives each phase of a training step issues, per group.
  int64_t issued(CollectiveKind kind) const {
    return issued_[static_cast<size_t>(kind)].load(std::memory_order_relaxed);
  }

 protected:
  Communicator() = default;
  // The one path of every collective: `call` has been filled and `invalid` holds the result
  // of checking its arguments on this rank (OK or InvalidArgument). Implementations run the
  // call through the group's rendezvous even when `invalid` is an error, so that every rank
  // reports it.
  virtual Work Submit(const CollectiveCall& call, absl::Status invalid) = 0;

 private:
  Work Enqueue(const CollectiveCall& call, absl::Status extra_check = absl::OkStatus());

  std::array<std::atomic<int64_t>, kNumCollectiveKinds> issued_{};
};

}  // namespace fsdp
