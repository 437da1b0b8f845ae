// The bottom of the sharding runtime: a unit's record (its flat layout, shards, buffers in
// flight and state), and the memory book that counts every buffer the runtime holds, from the
// moment it is allocated until the device is done with it. Everything above (gather.cc,
// reduce.cc, sharding_runtime.cc) uses these; nothing here reaches back up.
#pragma once

#include <algorithm>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"
#include "fsdp/backend.h"
#include "fsdp/optim.h"
#include "fsdp/sharding.h"
#include "src/fsdp/flat_layout.h"

namespace fsdp::internal {

enum class UnitState { kIdle, kForward, kForwardDone, kBackward, kBackwardDone };
absl::string_view StateName(UnitState s);

// Bytes of one category, now and at peak.
struct Gauge {
  int64_t now = 0, peak = 0;
  void Add(int64_t b) {
    now += b;
    peak = std::max(peak, now);
  }
  void Sub(int64_t b) { now -= b; }
};

// The runtime's allocations by category, and all of them together (with the model's
// activations) for the combined peak.
struct MemoryBook {
  Gauge params, grads, optimizer, gathered, grad_buffers, secondary, total;
  int64_t activations = 0;
  void Add(Gauge& g, int64_t b) {
    g.Add(b);
    total.Add(b);
  }
  void Sub(Gauge& g, int64_t b) {
    g.Sub(b);
    total.Sub(b);
  }
};

// A backend allocation counted in one category of the book for as long as it lives, so the
// report cannot drift from what is allocated.
class Accounted {
 public:
  Accounted() = default;
  Accounted(Buffer buffer, MemoryBook* book, Gauge* gauge)
      : buffer_(std::move(buffer)), book_(book), gauge_(gauge) {
    book_->Add(*gauge_, static_cast<int64_t>(buffer_.bytes()));
  }
  Accounted(Accounted&& o) noexcept { *this = std::move(o); }
  Accounted& operator=(Accounted&& o) noexcept {
    if (this != &o) {
      Reset();
      buffer_ = std::move(o.buffer_);
      book_ = o.book_;
      gauge_ = o.gauge_;
    }
    return *this;
  }
  ~Accounted() { Reset(); }
  void Reset() {
    if (buffer_.bytes() != 0) book_->Sub(*gauge_, static_cast<int64_t>(buffer_.bytes()));
    buffer_.Reset();
  }
  bool allocated() const { return buffer_.bytes() != 0; }
  View view(DType dtype = DType::kF32) const { return buffer_.view(dtype); }
  size_t bytes() const { return buffer_.bytes(); }
  const Gauge* gauge() const { return gauge_; }

 private:
  Buffer buffer_;
  MemoryBook* book_ = nullptr;
  Gauge* gauge_ = nullptr;
};

// Buffers the host is done with but the device may still use: each is freed (and leaves the
// book) once its events have completed. On a host backend the events are complete at once.
class PendingFrees {
 public:
  void Add(Accounted buffer, std::vector<Event> events);
  // Frees every buffer whose events have completed.
  void Collect();
  // How many buffers of `gauge`'s category wait to be freed.
  int Count(const Gauge* gauge) const;
  // Waits (on the host) for the oldest buffers of `gauge`'s category until at most `keep` are
  // left; returns how many it waited for. Bounds the memory a host running ahead of an
  // asynchronous device holds.
  int WaitUntilAtMost(const Gauge* gauge, int keep);
  // Waits for every event and frees everything.
  void Drain();

 private:
  struct Entry {
    Accounted buffer;
    std::vector<Event> events;
    bool Done() const;
  };
  std::deque<Entry> entries_;
};

// Where a unit's gradient reduction stands after PostBackward.
enum class Reduction {
  kNone,          // nothing in flight (or no_sync accumulation kept locally)
  kShardGroup,    // reduce-scatter in the shard group (NO_SHARD: the all-reduce) in flight
  kReplicaGroup,  // HYBRID: the reduced shard's all-reduce across replicas in flight
  // A quantized reduction across replicas (CommunicationOptions::reduction): after the
  // replicas' all_to_all, the all_gather of each replica's reduced chunk in flight.
  kReplicaGather,
};

struct Unit {
  std::string name;
  std::vector<ParamInfo> params;
  FlatLayout layout;
  std::vector<TensorSlot> slots;
  std::vector<std::pair<int64_t, int64_t>> frozen;  // flat ranges without gradient
  Accounted param_shard, grad_shard;
  Accounted gathered;    // padded unit parameters in param_dtype while gathered
  // A quantized all-gather (CommunicationOptions): this rank's shard as codes and scales (from
  // Finalize on), and the shard group's, gathered, until they are decoded into `gathered`.
  Accounted quantized_shard, quantized_gathered;
  // ShardingOptions::secondary_shard_size N: this rank's 1/N of `gathered` (param_dtype), kept
  // from PostForward until the backward's gather over the secondary group.
  Accounted secondary;
  Accounted full_grad;   // padded unit gradient (f32), from PreBackward until reduced
  Accounted lowp_grad;   // full_grad cast to a low reduce_dtype, while it is reduced
  Accounted reduced;     // reduce-scatter output in reduce_dtype (shard size > 1 only)
  // Whether grad_shard holds nothing since the last step (zeroed), and whether the reduction
  // in flight writes grad_shard itself (IssueReduction: then nothing is added).
  bool grad_shard_zero = true;
  bool reduces_into_shard = false;
  // A quantized reduction (CommunicationOptions::reduction): this rank's gradient codes, one
  // chunk per rank of the shard group (the all_to_all's send), and the codes of its shard
  // from `code_ranks` ranks (the shard group's, or the replicas' all-gathered), until decoded.
  Accounted quantized_grad, quantized_reduced;
  int code_ranks = 0;
  bool code_chunks = false;  // quantized_reduced holds the replicas' chunks, not one chunk each
  std::unique_ptr<Optimizer> optimizer;
  // (Its state in the hooks, prefetch and reduction stage are the schedule's: schedule.h.)
  Event gather_event;       // all-gather in flight into `gathered`
  // An f32 all-gather that reads param_shard itself (out of place): until the compute stream
  // has waited for it, nothing may write the shard (SettleShardRead).
  Event shard_read;
  int64_t gather_issued_ns = 0;
  Event reduce_event;
  int64_t reduce_issued_ns = 0;
  Event grad_down;  // OffloadKind::kAll: the reduced shard's copy to the host in flight
};

// Records a span on the in-flight lane: from when the runtime issued `done`'s work to when it
// completed (the collective's own spans on the comm lane show when the transport ran it).
void RecordInflight(const Event& done, absl::string_view name, int64_t issued_ns,
                    const std::string& unit, bool prefetched);
// The tracer's clock now, or 0 when the tracer is off.
int64_t NowIfTracing();

}  // namespace fsdp::internal
