// The mpi communicator: the conformance suite with one rank per process, run by CTest under
// `mpirun -np 2` and `-np 3`. Rank 0 prints the usual GoogleTest output; the other ranks print
// only their failures, prefixed with their rank.
#include <cstdio>
#include <cstdlib>

#include "fsdp/mpi_world.h"
#include "gtest/gtest.h"
#include "tests/collectives/conformance.h"

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

class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::fprintf(stderr, "[rank %d] FAILED %s.%s at %s:%d\n%s\n", rank_,
                 info ? info->test_suite_name() : "?", info ? info->name() : "?",
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
};

}  // namespace

std::vector<int> TestWorldSizes() { return {0}; }

std::unique_ptr<TestWorld> MakeTestWorld(int size, const CommOptions& options) {
  auto comm = CreateMpiWorld(options);
  if (!comm.ok()) {
    std::fprintf(stderr, "CreateMpiWorld: %s\n", comm.status().ToString().c_str());
    std::abort();
  }
  return std::make_unique<MpiTestWorld>(std::move(comm).value());
}

}  // namespace fsdp::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  auto side = fsdp::CreateMpiWorld();
  if (!side.ok()) {
    std::fprintf(stderr, "CreateMpiWorld: %s\n", side.status().ToString().c_str());
    return 1;
  }
  fsdp::testing::SideComm() = std::move(side).value();
  const int rank = fsdp::testing::SideComm()->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new fsdp::testing::FailurePrinter(rank));
  }
  const int result = RUN_ALL_TESTS();
  // Every process must finish the suite before MPI shuts down.
  const absl::Status s = fsdp::testing::SideComm()->Barrier();
  fsdp::testing::ResetSharedTestWorlds();
  fsdp::testing::SideComm().reset();
  fsdp::ShutdownMpi();
  if (!s.ok()) std::fprintf(stderr, "[rank %d] final barrier: %s\n", rank, s.ToString().c_str());
  return result != 0 || !s.ok() ? 1 : 0;
}
