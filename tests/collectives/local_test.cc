// The local communicator: the conformance suite on worlds of 1 to 8 threads, plus what only
// the local communicator has (LocalWorld, the simulated link, overlap of compute and
// communication, draining at destruction).
#include <barrier>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_format.h"
#include "fsdp/local_world.h"
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

}  // namespace
}  // namespace fsdp::testing
