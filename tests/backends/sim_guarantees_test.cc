// The device guarantees that hold memory safe on an asynchronous device, on `sim` with latency
// injected on both streams:
// - a buffer freed while queued work on either stream (or both) still uses it is not handed
//   out again, neither its address nor its bytes, until that work has run; then it is;
// - a prefetch that no hook claimed (a pass abandoned after PreForward) stays booked in the
//   runtime's memory report while its gather is in flight, and the runtime gives its memory
//   back only after the gather has completed.
// (The runtime's deferred frees with several events each are tested on their own in
// tests/fsdp/pending_frees_test.cc.)
#include <chrono>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/backend.h"
#include "fsdp/local_world.h"
#include "fsdp/sharding.h"
#include "fsdp/sim_backend.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

using Clock = std::chrono::steady_clock;

double MsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Ops queued on each stream that use the buffer when it is freed.
struct Busy {
  int compute_ops;
  int comm_ops;
};

// Every op takes at least 25 ms on either stream, and every byte copied some more.
constexpr absl::Duration kOpLatency = absl::Milliseconds(25);

TEST(SimGuaranteesTest, AFreedBufferIsNotReusedUntilTheQueuedWorkOnBothStreamsHasRun) {
  const Busy kCases[] = {{3, 0}, {0, 3}, {1, 4}, {4, 1}};
  int index = 0;
  for (const Busy& busy : kCases) {
    SCOPED_TRACE(absl::StrCat(busy.compute_ops, " ops on the compute stream, ", busy.comm_ops,
                              " on the communication stream"));
    auto sim = std::move(SimBackend::Create({.op_latency = kOpLatency,
                                             .copy_bytes_per_second = 4e9}))
                   .value();
    // A size no other case or test allocates, so that the address space's free ranges of this
    // size hold only the buffer freed here.
    const size_t bytes = 256 * (4099 + index++);
    const int64_t floats = static_cast<int64_t>(bytes / sizeof(float));
    Buffer a = std::move(Buffer::Create(sim.get(), bytes)).value();
    // Queued uses of `a`: writes when one stream uses it, reads from each stream into a
    // buffer of its own when both do (two unordered streams must not both write it).
    Buffer read_c = std::move(Buffer::Create(sim.get(), bytes)).value();
    Buffer read_m = std::move(Buffer::Create(sim.get(), bytes)).value();
    const bool both = busy.compute_ops > 0 && busy.comm_ops > 0;
    ASSERT_TRUE(sim->Synchronize().ok());
    for (int i = 0; i < busy.compute_ops; ++i) {
      ASSERT_TRUE((both ? sim->Copy(read_c.view(), a.view(), Stream::kCompute)
                        : sim->Memset(a.view(), 0x11, Stream::kCompute)).ok());
    }
    for (int i = 0; i < busy.comm_ops; ++i) {
      ASSERT_TRUE((both ? sim->Copy(read_m.view(), a.view(), Stream::kComm)
                        : sim->Memset(a.view(), 0x22, Stream::kComm)).ok());
    }
    const Event compute_done = sim->Record(Stream::kCompute);
    const Event comm_done = sim->Record(Stream::kComm);
    const void* address = a.address();
    const void* storage = a.allocation().storage;
    a.Reset();  // freed while both streams may still use it
    EXPECT_EQ(sim->memory_stats().bytes_in_use, 2 * static_cast<int64_t>(bytes))
        << "a free is counted at once";
    // With work on both streams, the stream that finishes first is waited for: the other one
    // alone must still hold the buffer.
    if (both) {
      const Event& first = busy.compute_ops < busy.comm_ops ? compute_done : comm_done;
      const Event& last = busy.compute_ops < busy.comm_ops ? comm_done : compute_done;
      ASSERT_TRUE(first.Wait().ok());
      ASSERT_FALSE(last.Done()) << "the test needs the other stream still busy here";
    }
    ASSERT_FALSE(compute_done.Done() && comm_done.Done())
        << "the test needs the work still queued here";
    Buffer b = std::move(Buffer::Create(sim.get(), bytes)).value();
    EXPECT_NE(b.address(), address) << "the address was handed out again under queued work";
    EXPECT_NE(b.allocation().storage, storage) << "the bytes were handed out again under queued work";
    // The new buffer's bytes are its own: work queued on the freed one does not reach them.
    std::vector<float> mine(floats), back(floats);
    for (int64_t i = 0; i < floats; ++i) mine[i] = static_cast<float>(i);
    ASSERT_TRUE(sim->CopyFromHost(b.view(), mine.data(), Stream::kCompute).ok());
    ASSERT_TRUE(sim->Synchronize().ok());
    ASSERT_TRUE(sim->CopyToHost(back.data(), b.view()).ok());
    EXPECT_EQ(std::memcmp(back.data(), mine.data(), bytes), 0);
    // The work has run: the freed range goes back into use (among the free ranges of this
    // size, which a repeated run of the test may have left).
    std::vector<Buffer> more;
    bool reused = false;
    for (int i = 0; i < 4 && !reused; ++i) {
      more.push_back(std::move(Buffer::Create(sim.get(), bytes)).value());
      reused = more.back().address() == address;
    }
    EXPECT_TRUE(reused) << "a range freed and no longer used is not reused";
  }
}

// A sim device whose link adds `link` to every collective, and a FULL_SHARD runtime of `units`
// units of 64 f32 with forward prefetch of one unit, after a forward pass that recorded the
// order (its gathers are on demand) and whose work is done.
struct PrefetchingRuntime {
  std::unique_ptr<SimBackend> sim;
  std::unique_ptr<ShardingRuntime> rt;
};
absl::StatusOr<PrefetchingRuntime> MakePrefetchingRuntime(Communicator& world, int units,
                                                          absl::Duration link) {
  SimBackendOptions so;
  so.op_latency = absl::Milliseconds(1);
  so.data_plane.link_latency = link;
  PrefetchingRuntime p;
  FSDP_ASSIGN_OR_RETURN(p.sim, SimBackend::Create(so));
  ShardingOptions o;
  o.forward_prefetch = true;
  o.backward_prefetch = false;
  o.max_prefetch_units = 1;
  FSDP_ASSIGN_OR_RETURN(p.rt, ShardingRuntime::Create(p.sim.get(), world, o));
  for (int u = 0; u < units; ++u) {
    FSDP_RETURN_IF_ERROR(
        p.rt->RegisterUnit(absl::StrCat("unit", u), {ParamInfo(absl::StrCat("w", u), {64})})
            .status());
  }
  FSDP_RETURN_IF_ERROR(p.rt->Finalize(nullptr));
  for (int u = 0; u < units; ++u) {
    FSDP_RETURN_IF_ERROR(p.rt->PreForward(u).status());
    FSDP_RETURN_IF_ERROR(p.rt->PostForward(u));
  }
  FSDP_RETURN_IF_ERROR(p.rt->FinishForwardOnly());
  FSDP_RETURN_IF_ERROR(p.sim->Synchronize());
  return p;
}

// In f32 an all-gather reads the unit's master shard itself (out of place). A caller that
// takes the shard to write it (a checkpoint load) while a prefetch nobody claimed is still on
// the link gets it only once that gather is done: else the gather could send half-written
// values. Two units of 64 f32 on 2 ranks, the link 150 ms per collective.
TEST(SimGuaranteesTest, AShardIsHandedOutOnlyOnceNoGatherReadsIt) {
  constexpr int kRanks = 2, kUnits = 2;
  constexpr absl::Duration kLink = absl::Milliseconds(150);
  struct Seen {
    bool in_flight_before = false;
    double issued_to_returned_ms = 0;
  };
  std::vector<Seen> seen(kRanks);
  CommOptions co;
  co.timeout = absl::Seconds(30);
  const absl::Status run = LocalWorld::Run(kRanks, co, [&](Communicator& world) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(PrefetchingRuntime p, MakePrefetchingRuntime(world, kUnits, kLink));
    auto& [sim, rt] = p;
    // Claims unit 0 and prefetches unit 1, whose gather reads unit 1's shard on the link.
    const Event comm_idle_before = sim->Record(Stream::kComm);
    FSDP_RETURN_IF_ERROR(comm_idle_before.Wait());
    const auto issued = Clock::now();
    FSDP_RETURN_IF_ERROR(rt->PreForward(0).status());
    const Event gathers = sim->Record(Stream::kComm);
    Seen& mine = seen[world.rank()];
    mine.in_flight_before = !gathers.Done();
    const View shard = rt->param_shard(1);
    mine.issued_to_returned_ms = MsBetween(issued, Clock::now());
    FSDP_RETURN_IF_ERROR(world.Barrier());
    (void)shard;
    rt.reset();
    return gathers.Wait();
  });
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_TRUE(seen[r].in_flight_before) << "the test needs the gathers still in flight";
    // The two gathers run one after the other on the communication stream, each behind the
    // link's latency: the shard came back once the second had completed.
    EXPECT_GE(seen[r].issued_to_returned_ms, 2 * absl::ToDoubleMilliseconds(kLink) - 1)
        << "param_shard(1) returned while unit 1's all-gather could still read it";
  }
}

// Three units of 64 f32 on 2 ranks, FULL_SHARD with forward prefetch of one unit, on sim
// devices whose link adds 150 ms to every collective.
TEST(SimGuaranteesTest, AnUnclaimedPrefetchStaysBookedUntilItsGatherCompletes) {
  constexpr int kRanks = 2, kUnits = 3;
  constexpr absl::Duration kLink = absl::Milliseconds(150);
  constexpr int64_t kUnitBytes = 64 * sizeof(float);
  struct Seen {
    int64_t booked_after_prefetch = -1;
    int64_t device_after_prefetch = -1;
    bool gather_in_flight = false;
    double issued_to_freed_ms = 0;
    int64_t device_after_destroy = -1;
  };
  std::vector<Seen> seen(kRanks);
  CommOptions co;
  co.timeout = absl::Seconds(30);
  const absl::Status run = LocalWorld::Run(kRanks, co, [&](Communicator& world) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(PrefetchingRuntime p, MakePrefetchingRuntime(world, kUnits, kLink));
    auto& [sim, rt] = p;
    // The next pass claims unit 0 and prefetches unit 1; then it is abandoned (the model
    // failed, say) and the runtime destroyed, with unit 1's gather still on the link.
    const Event comm_idle_before = sim->Record(Stream::kComm);
    FSDP_RETURN_IF_ERROR(comm_idle_before.Wait());
    const auto issued = Clock::now();
    FSDP_RETURN_IF_ERROR(rt->PreForward(0).status());
    const Event gathers_done = sim->Record(Stream::kComm);  // after both gathers
    Seen& mine = seen[world.rank()];
    mine.booked_after_prefetch = rt->memory().gathered_param_bytes;
    mine.device_after_prefetch = sim->memory_stats().bytes_in_use;
    mine.gather_in_flight = !gathers_done.Done();
    FSDP_RETURN_IF_ERROR(world.Barrier());  // both ranks have issued both gathers
    rt.reset();
    mine.issued_to_freed_ms = MsBetween(issued, Clock::now());
    mine.device_after_destroy = sim->memory_stats().bytes_in_use;
    return gathers_done.Wait();
  });
  ASSERT_TRUE(run.ok()) << run;
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    ASSERT_TRUE(seen[r].gather_in_flight) << "the test needs the gathers still in flight";
    EXPECT_EQ(seen[r].booked_after_prefetch, 2 * kUnitBytes)
        << "unit 0 in use and unit 1 prefetched are both booked";
    EXPECT_GE(seen[r].device_after_prefetch, 2 * kUnitBytes);
    // The two gathers run one after the other on the communication stream, each behind the
    // link's latency: the runtime held unit 1's memory until the second had completed.
    EXPECT_GE(seen[r].issued_to_freed_ms, 2 * absl::ToDoubleMilliseconds(kLink) - 1);
    EXPECT_EQ(seen[r].device_after_destroy, 0) << "the runtime gave every buffer back";
  }
}

}  // namespace
}  // namespace fsdp
