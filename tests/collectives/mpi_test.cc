// The mpi communicator: the conformance suite with one rank per process, run by CTest under
// `mpirun -np 2` and `-np 3` (main() from tests/mpi_test_main.h).
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

// A barrier on a communicator of its own, never the one under test.
std::unique_ptr<Communicator>& SideComm() {
  static auto* c = new std::unique_ptr<Communicator>;
  return *c;
}

class MpiTestWorld final : public TestWorld {
 public:
  explicit MpiTestWorld(std::unique_ptr<Communicator> comm) : comm_(std::move(comm)) {}
  int size() const override { return comm_->size(); }
  void Run(const std::function<void(Communicator&)>& body) override { body(*comm_); }
  void SideBarrier() override {
    const absl::Status s = SideComm()->Barrier();
    EXPECT_TRUE(s.ok()) << s;
  }

 private:
  std::unique_ptr<Communicator> comm_;
};

// Many joins of a world of its own in a row, under a short deadline, with rank 0 holding
// groups the other ranks lack (so the ranks' MPI context ids in use differ, and MPI needs more
// than one round to agree on the next one). Every join must succeed between live processes.
absl::Duration ShortJoinDeadline() {
  return UnderSanitizer() ? absl::Seconds(5) : absl::Milliseconds(500);
}

TEST(MpiWorldJoin, JoinsAfterGroupsOfOneRankUnderAShortDeadline) {
  constexpr int kJoins = 60;
  std::vector<std::unique_ptr<Communicator>> kept;  // rank 0's groups of one, alive to the end
  int failed = 0;
  for (int i = 0; i < kJoins; ++i) {  // no early exit: every process runs every join
    const absl::Status side = SideComm()->Barrier();
    ASSERT_TRUE(side.ok()) << side;
    auto world = CreateMpiWorld(CommOptions{.timeout = ShortJoinDeadline()});
    if (!world.ok()) {
      ADD_FAILURE() << "join " << i << ": " << world.status();
      ++failed;
      continue;
    }
    Communicator& w = **world;
    auto one = w.Split(w.rank() == 0 ? 0 : -1, 0, "one");
    EXPECT_TRUE(one.ok()) << "join " << i << ": " << one.status();
    if (one.ok() && *one != nullptr) kept.push_back(std::move(one).value());
    float x = 1.0f;
    const absl::Status s = w.AllReduce(&x, &x, 1, DType::kF32, ReduceOp::kSum);
    EXPECT_TRUE(s.ok()) << "join " << i << ": " << s;
    EXPECT_EQ(x, static_cast<float>(w.size()));
  }
  EXPECT_EQ(failed, 0);
}

// Every rank of these tests runs on this host: the groups move their data through shared
// memory, unless FSDP_MPI_SHM=0 (the _openmpi CTest entry) or the options say otherwise.
TEST(MpiDataPath, GroupsOnOneHostUseSharedMemoryUnlessTurnedOff) {
  const char* env = std::getenv("FSDP_MPI_SHM");
  const bool off = env != nullptr && std::string(env) == "0";
  for (bool allowed : {true, false}) {
    auto world = CreateMpiWorld(CommOptions{.mpi_shared_memory = allowed});
    ASSERT_TRUE(world.ok()) << world.status();
    Communicator& w = **world;
    EXPECT_EQ(MpiDataPath(w), "undecided");
    float x[2] = {1.0f, 2.0f};
    ASSERT_TRUE(w.AllReduce(x, x, 2, DType::kF32, ReduceOp::kSum).ok());
    EXPECT_EQ(x[1], 2.0f * w.size());
    const std::string want = allowed && !off ? "shm" : "mpi";
    EXPECT_EQ(MpiDataPath(w), want) << "allowed " << allowed << ", FSDP_MPI_SHM " << (env ? env : "unset");
    // A split group decides for itself, from its own first call.
    auto half = w.Split(w.rank() % 2, w.rank(), "half");
    ASSERT_TRUE(half.ok()) << half.status();
    std::vector<float> all((*half)->size(), 0.0f);
    float mine = static_cast<float>(w.rank());
    ASSERT_TRUE((*half)->AllGather(&mine, all.data(), 1, DType::kF32).ok());
    for (int q = 0; q < (*half)->size(); ++q) EXPECT_EQ(all[q], static_cast<float>(2 * q + w.rank() % 2));
    EXPECT_EQ(MpiDataPath(**half), (*half)->size() > 1 ? want : "mpi");
  }
  ASSERT_TRUE(SideComm()->Barrier().ok());  // its first call, if the filter ran no other test
  EXPECT_EQ(MpiDataPath(*SideComm()), off ? "mpi" : "shm");
}

TEST(MpiWorldJoin, JoinsFromTwoThreadsAtOnceBothSucceed) {
  // The engine runs one join at a time; the second waits behind the first, within its
  // deadline. (Which thread's world pairs with which on another process is up to the order
  // in which the joins reach each engine: each thread uses whatever world it gets.)
  constexpr int kRounds = 20;
  for (int i = 0; i < kRounds; ++i) {
    const absl::Status side = SideComm()->Barrier();
    ASSERT_TRUE(side.ok()) << side;
    absl::Status status[2];
    float sums[2] = {1.0f, 1.0f};
    int sizes[2] = {0, 0};
    {
      std::vector<std::jthread> threads;
      for (int t = 0; t < 2; ++t) {
        threads.emplace_back([&, t] {
          auto world = CreateMpiWorld(CommOptions{.timeout = absl::Seconds(20)});
          if (!world.ok()) {
            status[t] = world.status();
            return;
          }
          sizes[t] = (*world)->size();
          status[t] = (*world)->AllReduce(&sums[t], &sums[t], 1, DType::kF32, ReduceOp::kSum);
        });
      }
    }
    for (int t = 0; t < 2; ++t) {
      EXPECT_TRUE(status[t].ok()) << "round " << i << ", thread " << t << ": " << status[t];
      if (status[t].ok()) {
        EXPECT_EQ(sums[t], static_cast<float>(sizes[t]));
      }
    }
  }
}

// An abort can arrive after the peer it was sent to has closed its group; Open MPI then hands
// it to the next communicator made on the same context id. That group must not fail for it:
// the groups' diagnostic messages carry an epoch the group's ranks agreed on.
TEST(MpiWorldJoin, AnAbortThatArrivesAfterItsGroupClosedLeavesTheNextGroupAlone) {
  constexpr int kRounds = 5;
  for (int i = 0; i < kRounds; ++i) {
    ASSERT_TRUE(SideComm()->Barrier().ok());
    auto first = CreateMpiWorld(CommOptions{.timeout = absl::Seconds(20)});
    ASSERT_TRUE(first.ok()) << first.status();
    const int rank = (*first)->rank();
    float x = 1.0f;
    ASSERT_TRUE((*first)->AllReduce(&x, &x, 1, DType::kF32, ReduceOp::kSum).ok());
    if (rank != 0) first->reset();  // closed before rank 0's abort is sent
    ASSERT_TRUE(SideComm()->Barrier().ok());
    if (rank == 0) {
      (*first)->Abort(absl::CancelledError("an abort of the closed group"));
      first->reset();
    }
    ASSERT_TRUE(SideComm()->Barrier().ok());
    auto next = CreateMpiWorld(CommOptions{.timeout = absl::Seconds(10)});
    ASSERT_TRUE(next.ok()) << "round " << i << ": " << next.status();
    ASSERT_TRUE(SideComm()->Barrier().ok());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // time for the late message
    for (int k = 0; k < 3; ++k) {
      float y = 1.0f;
      const absl::Status s = (*next)->AllReduce(&y, &y, 1, DType::kF32, ReduceOp::kSum);
      ASSERT_TRUE(s.ok()) << "round " << i << ", call " << k << ": " << s;
      EXPECT_EQ(y, static_cast<float>((*next)->size()));
    }
    EXPECT_TRUE((*next)->health().ok()) << (*next)->health();
  }
}

}  // namespace

std::vector<int> TestWorldSizes() { return {0}; }

std::unique_ptr<TestWorld> MakeTestWorld(int size, const CommOptions& options) {
  // The processes start the world's creation together: its join has the test's deadline (as
  // short as 500 ms in the fault tests), and a process may still be tearing down the failed
  // world of the previous test for up to that deadline.
  if (SideComm() != nullptr) {
    const absl::Status s = SideComm()->Barrier();
    if (!s.ok()) {
      std::fprintf(stderr, "side barrier before CreateMpiWorld: %s\n", s.ToString().c_str());
    }
  }
  auto comm = CreateMpiWorld(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "CreateMpiWorld: %s\n", comm.status().ToString().c_str());
    std::abort();
  }
  return std::make_unique<MpiTestWorld>(std::move(comm).value());
}

}  // namespace fsdp::testing

int main(int argc, char** argv) {
  using fsdp::testing::SideComm;
  return fsdp::testing::MpiTestMain(
      argc, argv, "collectives_mpi_test",
      [](fsdp::Communicator&) -> absl::Status {
        FSDP_ASSIGN_OR_RETURN(SideComm(), fsdp::CreateMpiWorld());
        return absl::OkStatus();
      },
      [](fsdp::Communicator&) {
        // Every process must finish the suite before the communicators go.
        const absl::Status s = SideComm()->Barrier();
        if (!s.ok()) std::fprintf(stderr, "final barrier: %s\n", s.ToString().c_str());
        fsdp::testing::ResetSharedTestWorlds();
        SideComm().reset();
      });
}
