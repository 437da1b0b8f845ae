// The mpi_threads communicator (CreateMpiThreadsWorld): the conformance suite on worlds of
// processes x threads ranks, run by CTest under `mpirun -np 2` and `-np 3` with 2 ranks per
// process ($FSDP_TEST_THREADS), plus what only it has: which transport each kind of split
// group gets, and a process that never arrives.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/mpi_world.h"
#include "gtest/gtest.h"
#include "tests/collectives/conformance.h"
#include "tests/mpi_test_main.h"

namespace fsdp::testing {
namespace {

int Threads() {
  const char* t = std::getenv("FSDP_TEST_THREADS");
  return t != nullptr && std::atoi(t) > 0 ? std::atoi(t) : 2;
}

// Which thread of the process a body runs on (for SideBarrier).
thread_local int t_thread = -1;

// A world of this transport that the side barriers use, never the one under test.
std::vector<std::unique_ptr<Communicator>>& SideComms() {
  static auto* c = new std::vector<std::unique_ptr<Communicator>>;
  return *c;
}

std::vector<std::unique_ptr<Communicator>> MakeOrDie(const CommOptions& options) {
  auto comms = CreateMpiThreadsWorld(Threads(), options);
  if (!comms.ok()) {
    std::fprintf(stderr, "CreateMpiThreadsWorld: %s\n", comms.status().ToString().c_str());
    std::abort();
  }
  return std::move(comms).value();
}

class ThreadsTestWorld final : public TestWorld {
 public:
  explicit ThreadsTestWorld(std::vector<std::unique_ptr<Communicator>> comms)
      : comms_(std::move(comms)) {}
  int size() const override { return comms_[0]->size(); }
  void Run(const std::function<void(Communicator&)>& body) override {
    std::vector<std::thread> threads;
    for (size_t t = 0; t < comms_.size(); ++t) {
      threads.emplace_back([&body, this, t] {
        t_thread = static_cast<int>(t);
        body(*comms_[t]);
      });
    }
    for (auto& t : threads) t.join();
  }
  void SideBarrier() override {
    ASSERT_GE(t_thread, 0);
    const absl::Status s = SideComms()[t_thread]->Barrier();
    EXPECT_TRUE(s.ok()) << s;
  }

 private:
  std::vector<std::unique_ptr<Communicator>> comms_;
};

// Runs body on every thread of this process with its communicator of `world`.
void OnThreads(std::vector<std::unique_ptr<Communicator>>& world,
               const std::function<void(Communicator&)>& body) {
  ThreadsTestWorld w(std::move(world));
  w.Run(body);
}

TEST(MpiThreadsWorld, RanksAreProcessMajorAndGroupsGetTheirTransport) {
  auto comms = MakeOrDie({});
  const int threads = Threads();
  OnThreads(comms, [&](Communicator& c) {
    const int procs = c.size() / threads;
    EXPECT_EQ(c.size(), procs * threads);
    EXPECT_EQ(c.name(), "world");
    EXPECT_EQ(c.backend(), procs > 1 && threads > 1 ? "mpi_threads" : procs > 1 ? "mpi" : "local");
    // The shard groups of HYBRID_SHARD with a process's ranks as the shard group: local.
    auto shard = c.Split(c.rank() / threads, c.rank(), "shard");
    ASSERT_TRUE(shard.ok()) << shard.status();
    EXPECT_EQ((*shard)->backend(), "local");
    EXPECT_EQ((*shard)->name(), absl::StrCat("world/shard", c.rank() / threads));
    EXPECT_EQ((*shard)->rank(), c.rank() % threads);
    // Its replicate groups: one rank per process, mpi.
    auto rep = c.Split(c.rank() % threads, c.rank(), "replicate");
    ASSERT_TRUE(rep.ok()) << rep.status();
    EXPECT_EQ((*rep)->backend(), procs > 1 ? "mpi" : "local");
    EXPECT_EQ((*rep)->size(), procs);
    EXPECT_EQ((*rep)->rank(), c.rank() / threads);
    // Ranks in reverse: a mixed group again, ranked by key.
    auto rev = c.Split(0, -c.rank(), "rev");
    ASSERT_TRUE(rev.ok()) << rev.status();
    EXPECT_EQ((*rev)->rank(), c.size() - 1 - c.rank());
    float v = static_cast<float>(c.rank()), sum = 0;
    ASSERT_TRUE((*rev)->AllReduce(&v, &sum, 1, DType::kF32, ReduceOp::kSum).ok());
    EXPECT_EQ(sum, static_cast<float>(c.size() * (c.size() - 1) / 2));
    std::vector<float> order(static_cast<size_t>(c.size()));
    ASSERT_TRUE((*rev)->AllGather(&v, order.data(), 1, DType::kF32).ok());
    for (int i = 0; i < c.size(); ++i) EXPECT_EQ(order[i], static_cast<float>(c.size() - 1 - i));
    // Not every rank in a group, and two groups sharing processes: a split of a mixed group.
    auto odd = (*rev)->Split(c.rank() == 0 ? -1 : c.rank() % 2, c.rank(), "odd");
    ASSERT_TRUE(odd.ok()) << odd.status();
    if (c.rank() == 0) {
      EXPECT_EQ(*odd, nullptr);
    } else {
      ASSERT_NE(*odd, nullptr);
      float one = 1, n = 0;
      ASSERT_TRUE((*odd)->AllReduce(&one, &n, 1, DType::kF32, ReduceOp::kSum).ok());
      int expect = 0;
      for (int q = 1; q < c.size(); ++q) expect += q % 2 == c.rank() % 2;
      EXPECT_EQ(n, static_cast<float>(expect));
    }
  });
}

// Two mpi groups of the same processes split from two threads in opposite orders: process 0
// splits the group of its thread 0 first, the others that of their thread 1 first. The MPI
// engine makes each split's communicators on a thread of its own, so neither waits for the
// other (made on the engine thread, the two blocking creations waited for each other forever).
TEST(MpiThreadsWorld, GroupsSplitFromTwoThreadsInOppositeOrders) {
  auto comms = MakeOrDie({});
  const int threads = Threads();
  OnThreads(comms, [&](Communicator& c) {
    const int t = c.rank() % threads, p = c.rank() / threads;
    auto mine = c.Split(t, c.rank(), "column");  // one rank per process: an mpi communicator
    ASSERT_TRUE(mine.ok()) << mine.status();
    if (c.size() == threads) return;  // one process: nothing crosses
    ASSERT_EQ((*mine)->backend(), "mpi");
    const bool first = (p == 0) == (t == 0);
    if (!first) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    auto sub = (*mine)->Split(0, (*mine)->rank(), "again");
    ASSERT_TRUE(sub.ok()) << sub.status();
    float one = 1, n = 0;
    ASSERT_TRUE((*sub)->AllReduce(&one, &n, 1, DType::kF32, ReduceOp::kSum).ok());
    EXPECT_EQ(n, static_cast<float>(c.size() / threads));
  });
}

TEST(MpiThreadsWorld, DifferentThreadCountsAreRefused) {
  // Process 0 asks for one more rank than the others.
  int rank = 0;
  ASSERT_TRUE(RunOnMpiThread([&] {}).ok());
  const char* r = std::getenv("OMPI_COMM_WORLD_RANK");
  rank = r != nullptr ? std::atoi(r) : 0;
  auto comms = CreateMpiThreadsWorld(Threads() + (rank == 0 ? 1 : 0));
  ASSERT_FALSE(comms.ok());
  EXPECT_EQ(comms.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(comms.status().message().find("same number of ranks"), std::string_view::npos)
      << comms.status();
  EXPECT_EQ(CreateMpiThreadsWorld(0).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace

std::vector<int> TestWorldSizes() { return {0}; }

// A barrier of every rank over the side world (none before it exists).
static void SideBarrierAll() {
  std::vector<std::thread> ts;
  for (auto& c : SideComms()) {
    ts.emplace_back([&c] {
      const absl::Status s = c->Barrier();
      if (!s.ok()) std::fprintf(stderr, "side barrier: %s\n", s.ToString().c_str());
    });
  }
  for (auto& t : ts) t.join();
}

std::unique_ptr<TestWorld> MakeTestWorld(int size, const CommOptions& options) {
  (void)size;
  // The processes start the world's creation together (see mpi_test.cc) ...
  SideBarrierAll();
  auto world = std::make_unique<ThreadsTestWorld>(MakeOrDie(options));
  // ... and end it together: a test that aborts its world at once (FaultTest) must not fail a
  // process that has not yet seen the join's last call complete.
  SideBarrierAll();
  return world;
}

}  // namespace fsdp::testing

int main(int argc, char** argv) {
  using fsdp::testing::SideComms;
  return fsdp::testing::MpiTestMain(
      argc, argv, "collectives_mpi_threads_test",
      [](fsdp::Communicator&) -> absl::Status {
        FSDP_ASSIGN_OR_RETURN(SideComms(),
                              fsdp::CreateMpiThreadsWorld(fsdp::testing::Threads()));
        return absl::OkStatus();
      },
      [](fsdp::Communicator&) {
        fsdp::testing::SideBarrierAll();
        fsdp::testing::ResetSharedTestWorlds();
        SideComms().clear();
      });
}
