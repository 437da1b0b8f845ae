// The conformance suite shared by every communicator: tests are SPMD bodies that run on each
// rank of a TestWorld. Each test binary (local: ranks as threads; mpi: one rank per process
// under mpirun) provides the world factory below and links conformance_test.cc.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp::testing {

class TestWorld {
 public:
  virtual ~TestWorld() = default;
  virtual int size() const = 0;
  // Runs body on every rank that lives in this process (concurrently) and returns when all
  // are done.
  virtual void Run(const std::function<void(Communicator&)>& body) = 0;
  // A barrier among the bodies of one Run that does not use the communicators under test
  // (fault tests use it to order events). Every rank's body must call it the same number of
  // times.
  virtual void SideBarrier() = 0;
};

// --- provided by each test binary ---
// The world sizes the suite is instantiated for; 0 means "the world this process is part of"
// (mpi), whose size is known only at run time.
std::vector<int> TestWorldSizes();
// A fresh world of `size` ranks with `options` (collective across processes for mpi).
std::unique_ptr<TestWorld> MakeTestWorld(int size, const CommOptions& options);

// --- shared helpers (conformance_test.cc) ---
// A world per size with default options and a 20 s deadline, reused by the data tests.
TestWorld& SharedTestWorld(int size);
void ResetSharedTestWorlds();
// The largest buffer a conformance case may use: $FSDP_COLL_TEST_MAX_BYTES, else 64 MiB,
// else 4 MiB under ThreadSanitizer.
int64_t MaxTestBytes();
bool UnderThreadSanitizer();
bool UnderSanitizer();  // ASan or TSan

}  // namespace fsdp::testing
