// The local communicator: the conformance suite on worlds of 1 to 8 threads, plus what only
// the local communicator has (LocalWorld, the simulated link, overlap of compute and
// communication, draining at destruction).
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_format.h"
#include "fsdp/local_world.h"
#include "fsdp/mesh.h"
#include "gtest/gtest.h"
#include "tests/collectives/conformance.h"

namespace fsdp::testing {

namespace {

class LocalTestWorld final : public TestWorld {
 public:
  LocalTestWorld(int size, const CommOptions& options) : barrier_(size) {
    auto world = LocalWorld::Create(size, options);
    EXPECT_TRUE(world.ok()) << world.status();
    for (int r = 0; r < size; ++r) comms_.push_back(std::move((*world)->TakeRank(r)).value());
  }
  int size() const override { return static_cast<int>(comms_.size()); }
  void Run(const std::function<void(Communicator&)>& body) override {
    std::vector<std::thread> threads;
    for (auto& c : comms_) threads.emplace_back([&body, &c] { body(*c); });
    for (auto& t : threads) t.join();
  }
  void SideBarrier() override { barrier_.arrive_and_wait(); }

 private:
  std::vector<std::unique_ptr<Communicator>> comms_;
  std::barrier<> barrier_;
};

}  // namespace

std::vector<int> TestWorldSizes() { return {1, 2, 3, 4, 5, 6, 7, 8}; }

std::unique_ptr<TestWorld> MakeTestWorld(int size, const CommOptions& options) {
  return std::make_unique<LocalTestWorld>(size, options);
}

namespace {

double Seconds(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

TEST(LocalWorld, CreateAndTakeRankCheckTheirArguments) {
  EXPECT_EQ(LocalWorld::Create(0).status().code(), absl::StatusCode::kInvalidArgument);
  CommOptions bad;
  bad.timeout = absl::ZeroDuration();
  EXPECT_EQ(LocalWorld::Create(2, bad).status().code(), absl::StatusCode::kInvalidArgument);
  auto world = LocalWorld::Create(2);
  ASSERT_TRUE(world.ok());
  EXPECT_EQ((*world)->TakeRank(2).status().code(), absl::StatusCode::kInvalidArgument);
  auto r0 = (*world)->TakeRank(0);
  ASSERT_TRUE(r0.ok());
  EXPECT_EQ((*r0)->backend(), "local");
  EXPECT_EQ((*world)->TakeRank(0).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(LocalWorld, RunReturnsTheFirstErrorInRankOrder) {
  absl::Status s = LocalWorld::Run(3, {}, [](Communicator& comm) -> absl::Status {
    FSDP_RETURN_IF_ERROR(comm.Barrier());
    if (comm.rank() >= 1) return absl::InternalError(absl::StrFormat("rank %d", comm.rank()));
    return absl::OkStatus();
  });
  EXPECT_EQ(s.message(), "rank 1");
}

TEST(CommOptions, TimeoutComesFromTheEnvironment) {
  setenv("FSDP_COMM_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(DefaultCommTimeout(), absl::Milliseconds(2500));
  EXPECT_EQ(CommOptions{}.timeout, absl::Milliseconds(2500));
  setenv("FSDP_COMM_TIMEOUT_S", "soon", 1);
  EXPECT_EQ(DefaultCommTimeout(), absl::Seconds(60));
  unsetenv("FSDP_COMM_TIMEOUT_S");
  EXPECT_EQ(DefaultCommTimeout(), absl::Seconds(60));
}

// Each transfer of S bytes costs latency + S / bandwidth: an all-gather of 2 ranks moves one
// 1 MiB chunk per rank at 50 MB/s, so it takes at least ~21 ms.
TEST(SimulatedLink, ChargesEveryTransfer) {
  CommOptions o;
  o.link_bytes_per_second = 50e6;
  o.link_latency = absl::Milliseconds(1);
  const int64_t count = (1 << 20) / 4;
  ASSERT_TRUE(LocalWorld::Run(2, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> send(count, 1.0f), recv(2 * count);
                const auto t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.AllGather(send.data(), recv.data(), count, DType::kF32));
                const double t = Seconds(t0);
                EXPECT_GE(t, 0.001 + (1 << 20) / 50e6 - 1e-4);
                EXPECT_EQ(recv[count], 1.0f);
                return absl::OkStatus();
              }).ok());
}

// A communication-bound step: the all-gather takes ~200 ms on the simulated link and the
// "compute" 200 ms. Issued asynchronously, the two overlap and the step takes ~200 ms, not
// 400 ms. (Compute is a sleep, so the check holds on a loaded machine and under TSan.)
TEST(SimulatedLink, AsyncWorkOverlapsCompute) {
  CommOptions o;
  o.link_bytes_per_second = 10e6;  // 2 MB per rank -> 200 ms
  const int64_t count = 2'000'000 / 4;
  ASSERT_TRUE(LocalWorld::Run(2, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> send(count, 2.0f), recv(2 * count);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                const auto t0 = std::chrono::steady_clock::now();
                Work w = comm.AllGatherAsync(send.data(), recv.data(), count, DType::kF32);
                EXPECT_FALSE(w.Test());  // in flight
                std::this_thread::sleep_for(std::chrono::milliseconds(200));  // compute
                FSDP_RETURN_IF_ERROR(w.Wait());
                const double step = Seconds(t0);
                EXPECT_GE(step, 0.19);
                EXPECT_LT(step, 0.32) << "communication did not overlap compute";
                EXPECT_TRUE(w.Test());
                EXPECT_EQ(recv[2 * count - 1], 2.0f);
                return absl::OkStatus();
              }).ok());
}

// A Wait that expires once every rank has arrived does not abandon the buffers: it waits for
// the copy (here slowed by the link) to finish, and the call succeeds.
TEST(SimulatedLink, WaitAfterTheRendezvousWaitsForTheCopy) {
  CommOptions o;
  o.link_bytes_per_second = 10e6;
  const int64_t count = 1'000'000 / 4;  // 100 ms per rank
  ASSERT_TRUE(LocalWorld::Run(2, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> send(count, 3.0f), recv(2 * count);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                Work w = comm.AllGatherAsync(send.data(), recv.data(), count, DType::kF32);
                std::this_thread::sleep_for(std::chrono::milliseconds(30));  // both arrived
                EXPECT_TRUE(w.Wait(absl::Milliseconds(10)).ok());
                EXPECT_EQ(recv[0], 3.0f);
                return comm.health();
              }).ok());
}

TEST(LocalCommunicator, DestructionRunsWhatIsQueued) {
  auto world = LocalWorld::Create(2);
  ASSERT_TRUE(world.ok());
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f);
  Work wa, wb;
  std::thread t([&] {
    auto c = std::move((*world)->TakeRank(1)).value();
    wb = c->AllReduceAsync(b.data(), b.data(), 1000, DType::kF32, ReduceOp::kSum);
  });  // the communicator is destroyed here, with its call queued
  {
    auto c = std::move((*world)->TakeRank(0)).value();
    wa = c->AllReduceAsync(a.data(), a.data(), 1000, DType::kF32, ReduceOp::kSum);
  }
  t.join();
  EXPECT_TRUE(wa.Wait().ok());
  EXPECT_TRUE(wb.Wait().ok());
  EXPECT_EQ(a[999], 3.0f);
  EXPECT_EQ(b[0], 3.0f);
}

// The late rank is told about the failure as soon as it calls, with what happened first.
TEST(LocalCommunicator, LateRankGetsTheOriginalFailure) {
  CommOptions o;
  o.timeout = absl::Milliseconds(200);
  auto world = LocalWorld::Create(3, o);
  ASSERT_TRUE(world.ok());
  auto c0 = std::move((*world)->TakeRank(0)).value();
  auto c1 = std::move((*world)->TakeRank(1)).value();
  auto c2 = std::move((*world)->TakeRank(2)).value();
  std::thread t([&] { EXPECT_FALSE(c1->Barrier().ok()); });
  absl::Status s = c0->Barrier();
  t.join();
  EXPECT_TRUE(s.message().find("ranks [2] did not arrive (rank 2 had issued 0 calls and arrived at none)") !=
              std::string::npos) << s;
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status late = c2->Barrier();
  EXPECT_LT(Seconds(t0), 0.1);
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(late.message().find("barrier() at sequence 0 of group 'world' was not run: the group had failed") !=
              std::string::npos) << late;
}


// --- the two-level link: ranks_per_host puts world ranks on hosts; a transfer between two
// hosts costs inter_host_latency + S / inter_host_bytes_per_second, one inside a host the
// link_* figures. Checks are lower bounds (the model) plus a generous upper slack.

constexpr double kSlack = 0.35;  // seconds of scheduling noise allowed above the model

CommOptions TwoHosts(absl::Duration inter_latency) {
  CommOptions o;
  o.ranks_per_host = 2;
  o.link_latency = absl::Microseconds(100);
  o.inter_host_latency = inter_latency;
  return o;
}

// 2 hosts x 2 ranks, all-gather of 1 MB per rank: each rank receives from 1 peer on its host
// (100 us + 1 MB / 1 GB/s = 1.1 ms) and 2 on the other (20 ms + 1 MB / 100 MB/s = 30 ms each).
TEST(TwoLevelLink, AllGatherChargesEachPeerAtItsLevel) {
  CommOptions o = TwoHosts(absl::Milliseconds(20));
  o.link_bytes_per_second = 1e9;
  o.inter_host_bytes_per_second = 100e6;
  const int64_t count = 1'000'000 / 4;
  const double model = (100e-6 + 1e6 / 1e9) + 2 * (0.020 + 1e6 / 100e6);
  ASSERT_TRUE(LocalWorld::Run(4, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> send(count, 1.0f + comm.rank()), recv(4 * count);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                const auto t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.AllGather(send.data(), recv.data(), count, DType::kF32));
                const double t = Seconds(t0);
                EXPECT_GE(t, model - 1e-4) << "rank " << comm.rank();
                EXPECT_LE(t, model + kSlack) << "rank " << comm.rank();
                for (int q = 0; q < 4; ++q) EXPECT_EQ(recv[q * count], 1.0f + q);
                return absl::OkStatus();
              }).ok());
}

// Reduce-scatter is charged like all-gather (one chunk per peer), all-reduce twice (its
// reduce phase and its copy phase), a barrier the latency of its slowest level.
TEST(TwoLevelLink, ReduceScatterAllReduceAndBarrier) {
  const CommOptions o = TwoHosts(absl::Milliseconds(20));
  const double one_pass = 100e-6 + 2 * 0.020;  // latency only: 1 peer inside, 2 outside
  ASSERT_TRUE(LocalWorld::Run(4, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> send(4 * 64, 1.0f), recv(4 * 64);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                auto t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.ReduceScatter(send.data(), recv.data(), 64, DType::kF32,
                                                        ReduceOp::kSum));
                double t = Seconds(t0);
                EXPECT_GE(t, one_pass - 1e-4);
                EXPECT_LE(t, one_pass + kSlack);
                EXPECT_EQ(recv[0], 4.0f);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.AllReduce(send.data(), recv.data(), 4 * 64, DType::kF32,
                                                    ReduceOp::kSum));
                t = Seconds(t0);
                EXPECT_GE(t, 2 * one_pass - 1e-4);
                EXPECT_LE(t, 2 * one_pass + kSlack);
                EXPECT_EQ(recv[4 * 64 - 1], 4.0f);
                t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                t = Seconds(t0);
                EXPECT_GE(t, 0.020 - 1e-4);
                EXPECT_LE(t, 0.020 + kSlack);
                return absl::OkStatus();
              }).ok());
}

// A broadcast from rank 0 charges the ranks of the other host the inter-host latency and its
// host-mate only the link inside the host; the call ends on every rank when the last copy is
// done (the completion barrier keeps the root's buffer alive), so all take the slower figure.
// A broadcast among the ranks of one host is not charged the inter-host latency.
TEST(TwoLevelLink, BroadcastChargesTheRootsLevel) {
  const CommOptions o = TwoHosts(absl::Milliseconds(200));
  ASSERT_TRUE(LocalWorld::Run(4, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> buf(16, comm.rank() == 0 ? 5.0f : 0.0f);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                auto t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.Broadcast(buf.data(), 16, DType::kF32, 0));
                double t = Seconds(t0);
                EXPECT_GE(t, 0.200 - 1e-4) << "rank " << comm.rank();
                EXPECT_LE(t, 0.200 + kSlack) << "rank " << comm.rank();
                EXPECT_EQ(buf[15], 5.0f);
                FSDP_ASSIGN_OR_RETURN(auto host, comm.Split(comm.rank() / 2, 0, "host"));
                std::vector<float> mine(16, host->rank() == 0 ? 6.0f : 0.0f);
                FSDP_RETURN_IF_ERROR(host->Barrier());
                t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(host->Broadcast(mine.data(), 16, DType::kF32, 0));
                t = Seconds(t0);
                EXPECT_LT(t, 0.100) << host->name() << " is inside one host";
                EXPECT_EQ(mine[15], 6.0f);
                return absl::OkStatus();
              }).ok());
}

// Sub-groups know their members' world ranks: in a 2 x 2 mesh on 2 hosts of 2, the shard
// groups ({0, 1}, {2, 3}) live inside a host and are not charged the inter-host latency; the
// replicate groups ({0, 2}, {1, 3}) cross hosts on every transfer.
TEST(TwoLevelLink, SubGroupsAreChargedByTheirMembersHosts) {
  const CommOptions o = TwoHosts(absl::Milliseconds(200));
  ASSERT_TRUE(LocalWorld::Run(4, o, [&](Communicator& world) -> absl::Status {
                FSDP_ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::Create(world, 2, 2));
                std::vector<float> send(8, 1.0f), recv(16);
                Communicator& shard = mesh.shard_group();
                Communicator& replicate = mesh.replicate_group();
                FSDP_RETURN_IF_ERROR(shard.Barrier());
                auto t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(shard.AllGather(send.data(), recv.data(), 8, DType::kF32));
                double t = Seconds(t0);
                EXPECT_LT(t, 0.100) << shard.name() << " is inside one host";
                t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(
                    replicate.AllGather(send.data(), recv.data(), 8, DType::kF32));
                t = Seconds(t0);
                EXPECT_GE(t, 0.200 - 1e-4) << replicate.name() << " crosses hosts";
                EXPECT_LE(t, 0.200 + kSlack) << replicate.name();
                // A split with reversed keys: members are ordered differently from the world,
                // and still placed on their own hosts.
                FSDP_ASSIGN_OR_RETURN(auto same_host,
                                      world.Split(world.rank() / 2, -world.rank(), "host"));
                FSDP_RETURN_IF_ERROR(same_host->Barrier());
                t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(same_host->AllGather(send.data(), recv.data(), 8,
                                                          DType::kF32));
                t = Seconds(t0);
                EXPECT_LT(t, 0.100) << same_host->name() << " is inside one host";
                return absl::OkStatus();
              }).ok());
}

// ranks_per_host equal to the world size: one host, nothing is charged the inter-host figures.
TEST(TwoLevelLink, OneHostIsNeverChargedTheInterHostLink) {
  CommOptions o = TwoHosts(absl::Milliseconds(200));
  o.ranks_per_host = 4;
  ASSERT_TRUE(LocalWorld::Run(4, o, [&](Communicator& comm) -> absl::Status {
                std::vector<float> send(8, 1.0f), recv(32);
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                const auto t0 = std::chrono::steady_clock::now();
                FSDP_RETURN_IF_ERROR(comm.AllGather(send.data(), recv.data(), 8, DType::kF32));
                EXPECT_GE(Seconds(t0), 3 * 100e-6 - 1e-4);
                EXPECT_LT(Seconds(t0), 0.100);
                return absl::OkStatus();
              }).ok());
}

TEST(TwoLevelLink, LocalWorldChecksTheOptions) {
  auto error = [](int size, const CommOptions& o) {
    const absl::Status s = LocalWorld::Create(size, o).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    return std::string(s.message());
  };
  CommOptions o;
  o.ranks_per_host = -1;
  EXPECT_NE(error(4, o).find("ranks_per_host must be >= 0"), std::string::npos);
  o = {};
  o.ranks_per_host = 2;
  o.inter_host_latency = -absl::Milliseconds(1);
  EXPECT_NE(error(4, o).find("inter_host_latency >= 0"), std::string::npos);
  o.inter_host_latency = absl::ZeroDuration();
  o.inter_host_bytes_per_second = -1;
  EXPECT_NE(error(4, o).find("inter_host_bytes_per_second >= 0"), std::string::npos);
  o = {};
  o.inter_host_latency = absl::Milliseconds(5);
  EXPECT_NE(error(4, o).find("ranks_per_host is 0"), std::string::npos);
  o = {};
  o.inter_host_bytes_per_second = 1e9;
  EXPECT_NE(error(4, o).find("set ranks_per_host"), std::string::npos);
  o = {};
  o.ranks_per_host = 3;
  const std::string m = error(4, o);
  EXPECT_NE(m.find("ranks_per_host 3 does not divide the world size 4"), std::string::npos) << m;
  o.ranks_per_host = 2;
  EXPECT_TRUE(LocalWorld::Create(4, o).ok());  // a second level with free links is allowed
  o.ranks_per_host = 8;
  EXPECT_FALSE(LocalWorld::Create(4, o).ok());
}

}  // namespace
}  // namespace fsdp::testing

namespace fsdp::testing {
namespace {

TEST(HostLayoutTest, SimulatedHostsAndOneProcessAreFound) {
  for (int per_host : {0, 1, 2, 4}) {
    CommOptions o;
    o.ranks_per_host = per_host;
    std::vector<HostLayout> got(4);
    ASSERT_TRUE(LocalWorld::Run(4, o, [&](Communicator& comm) {
                  FSDP_ASSIGN_OR_RETURN(got[comm.rank()], DiscoverHostLayout(comm));
                  return absl::OkStatus();
                }).ok());
    const int want = per_host == 0 ? 4 : per_host;
    for (const HostLayout& l : got) {
      EXPECT_EQ(l.num_hosts, 4 / want);
      EXPECT_EQ(l.uniform_ranks_per_host(), want);
      for (int r = 0; r < 4; ++r) EXPECT_EQ(l.host_of[r], r / want);
    }
  }
  HostLayout one;
  one.num_hosts = 1;
  one.host_of = {0, 0};
  EXPECT_EQ(one.Describe(), "1 host x 2 ranks");
}

TEST(HostLayoutTest, HostsThatAreNotBlocksOfConsecutiveRanksAreNotUniform) {
  HostLayout round_robin;
  round_robin.num_hosts = 2;
  round_robin.host_of = {0, 1, 0, 1};
  EXPECT_EQ(round_robin.uniform_ranks_per_host(), 0);
  EXPECT_EQ(round_robin.Describe(), "host 0: ranks [0, 2]; host 1: ranks [1, 3]");
  HostLayout uneven;
  uneven.num_hosts = 2;
  uneven.host_of = {0, 0, 0, 1};
  EXPECT_EQ(uneven.uniform_ranks_per_host(), 0);
  HostLayout blocks;
  blocks.num_hosts = 2;
  blocks.host_of = {0, 0, 1, 1};
  EXPECT_EQ(blocks.uniform_ranks_per_host(), 2);
  EXPECT_EQ(blocks.Describe(), "2 hosts x 2 ranks");
}

}  // namespace
}  // namespace fsdp::testing
