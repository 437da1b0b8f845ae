// The mpi communicator: the conformance suite with one rank per process, run by CTest under
// `mpirun -np 2` and `-np 3` (main() from tests/mpi_test_main.h).
#include <cstdio>
#include <cstdlib>

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
