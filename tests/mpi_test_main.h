// The main() of GoogleTest binaries that run one rank per process under mpirun.
//
// Every rank runs every test. Rank 0 prints GoogleTest's usual output and writes the results
// file (--gtest_output); the other ranks print only their failures, tagged with their rank,
// and write nothing (they would all write to the same file). After the suite the ranks agree
// on the outcome, so a test that failed on any rank makes every process exit non-zero.
#pragma once

#include <cstdio>
#include <functional>
#include <memory>
#include <string>

#include "fsdp/mpi_world.h"
#include "gtest/gtest.h"

namespace fsdp::testing {

// Prints a rank's failures, tagged with the rank. (The test's name is taken when it starts:
// asking GoogleTest for the current test inside OnTestPartResult would wait on a lock that
// GoogleTest holds while it reports the result.)
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] FAILED %s at %s:%d\n%s\n", rank_, test_.c_str(),
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
  }

 private:
  int rank_;
  std::string test_ = "?";
};

// Runs the suite on a world communicator of its own. `setup` runs before the tests (an error
// ends the process with 1), `teardown` after them, both on every rank.
inline int MpiTestMain(int argc, char** argv, const char* name,
                       const std::function<absl::Status(Communicator& world)>& setup,
                       const std::function<void(Communicator& world)>& teardown = {}) {
  ::testing::InitGoogleTest(&argc, argv);
  auto world = CreateMpiWorld();
  if (!world.ok()) {
    std::fprintf(stderr, "%s: CreateMpiWorld: %s\n", name, world.status().ToString().c_str());
    return 1;
  }
  Communicator& w = **world;
  const int rank = w.rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    delete listeners.Release(listeners.default_xml_generator());
    listeners.Append(new RankFailurePrinter(rank));
  }
  if (setup) {
    const absl::Status s = setup(w);
    if (!s.ok()) {
      std::fprintf(stderr, "%s: [rank %d] set-up: %s\n", name, rank, s.ToString().c_str());
      return 1;
    }
  }
  const int rc = RUN_ALL_TESTS();
  if (teardown) teardown(w);
  // Agree on the outcome: the most failures on any rank decides every rank's exit code.
  float failed = rc != 0 ? 1.0f : 0.0f, any_failed = 1.0f;
  const absl::Status s = w.AllReduce(&failed, &any_failed, 1, DType::kF32, ReduceOp::kMax);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: [rank %d] final agreement: %s\n", name, rank, s.ToString().c_str());
  } else if (any_failed != 0.0f && rc == 0) {
    std::fprintf(stderr, "%s: [rank %d] passed here, but a test failed on another rank\n", name,
                 rank);
  }
  world->reset();
  ShutdownMpi();
  return rc != 0 || !s.ok() || any_failed != 0.0f ? 1 : 0;
}

}  // namespace fsdp::testing
