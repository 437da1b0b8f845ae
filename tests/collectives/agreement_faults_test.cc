// The pre-flight agreements of a group, field by field, on every transport that links the
// conformance suite (local threads; mpi with shared memory inside the host, and with Open MPI's
// collectives under FSDP_MPI_SHM=0):
// - the schedule fingerprint: ranks whose calls differ only in kind, count, dtype, reduction or
//   root get the schedule-mismatch error on every rank, at once, and no buffer is touched;
// - the device mesh: ranks that ask for different shapes, or for a shape that does not fit,
//   fail together at once, every rank naming the shapes, never at the deadline.
// Each case differs at the first, a middle and the last rank in turn.
#include <chrono>
#include <functional>
#include <set>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_format.h"
#include "fsdp/mesh.h"
#include "gtest/gtest.h"
#include "tests/collectives/conformance.h"

namespace fsdp::testing {
namespace {

bool Has(const absl::Status& s, std::string_view needle) {
  return std::string_view(s.message().data(), s.message().size()).find(needle) !=
         std::string_view::npos;
}

// Short, so that a regression into a hang fails in a second: every failure here must come long
// before it. (Longer under a sanitizer, where a fresh mpi world alone can take 500 ms.)
absl::Duration ShortDeadline() {
  return UnderSanitizer() ? absl::Seconds(5) : absl::Milliseconds(500);
}

double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The first, a middle and the last rank of a world of n.
std::set<int> OddRanks(int n) { return {0, n / 2, n - 1}; }

// 2 and 4 ranks as threads; the process world under mpirun (2 and 3 processes).
std::vector<int> AgreementWorldSizes() {
  std::vector<int> sizes;
  for (int n : TestWorldSizes()) {
    if (n == 0 || n == 2 || n == 4) sizes.push_back(n);
  }
  return sizes;
}

std::string SizeName(const ::testing::TestParamInfo<int>& info) {
  return info.param > 0 ? absl::StrFormat("n%d", info.param) : "process_world";
}

class AgreementFaultTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    fresh_ = Fresh();
    if (fresh_->size() < 2) {
      GTEST_SKIP() << "needs a world of at least 2 ranks; this one has " << fresh_->size()
                   << " (run under mpirun -np 2 or more)";
    }
  }
  // A world with the short deadline (every mismatch fails its group, so one per case).
  std::unique_ptr<TestWorld> Fresh() {
    CommOptions o;
    o.timeout = ShortDeadline();
    return MakeTestWorld(GetParam(), o);
  }
  std::unique_ptr<TestWorld> fresh_;
};

// ------------------------------------------------------------- the schedule fingerprint

enum class Field { kKind, kCount, kDType, kOp, kRoot };

struct FieldCase {
  Field field;
  const char* name;
};
constexpr FieldCase kFields[] = {{Field::kKind, "kind"},
                                 {Field::kCount, "count"},
                                 {Field::kDType, "dtype"},
                                 {Field::kOp, "reduction"},
                                 {Field::kRoot, "root"}};

constexpr int64_t kCount = 8;

// The call of every rank but one, and the call of that one, which differs in `field` only.
// Buffers are sized for either call on a world of n ranks.
absl::Status Call(Communicator& comm, Field field, bool differ, const float* send, float* recv) {
  switch (field) {
    case Field::kKind:  // same count, dtype and reduction
      return differ ? comm.ReduceScatter(send, recv, kCount, DType::kF32, ReduceOp::kSum)
                    : comm.AllReduce(send, recv, kCount, DType::kF32, ReduceOp::kSum);
    case Field::kCount:
      return comm.AllGather(send, recv, differ ? kCount + 1 : kCount, DType::kF32);
    case Field::kDType:
      return comm.AllReduce(send, recv, kCount, differ ? DType::kBF16 : DType::kF32,
                            ReduceOp::kSum);
    case Field::kOp:
      return comm.AllReduce(send, recv, kCount, DType::kF32,
                            differ ? ReduceOp::kMax : ReduceOp::kSum);
    case Field::kRoot:  // in place: each rank's own values stay in `recv`
      return comm.Broadcast(recv, kCount, DType::kF32, differ ? 1 : 0);
  }
  return absl::InternalError("unknown field");
}

// How the group describes the two calls (DescribeCall).
std::pair<std::string, std::string> Described(Field field) {
  switch (field) {
    case Field::kKind: return {"all_reduce(count=8, f32, sum)", "reduce_scatter(count=8, f32, sum)"};
    case Field::kCount: return {"all_gather(count=8, f32)", "all_gather(count=9, f32)"};
    case Field::kDType: return {"all_reduce(count=8, f32, sum)", "all_reduce(count=8, bf16, sum)"};
    case Field::kOp: return {"all_reduce(count=8, f32, sum)", "all_reduce(count=8, f32, max)"};
    case Field::kRoot: return {"broadcast(count=8, f32, root=0)", "broadcast(count=8, f32, root=1)"};
  }
  return {};
}

TEST_P(AgreementFaultTest, CallsThatDifferInOneFieldAreAMismatchOnEveryRank) {
  const int n = fresh_->size();
  bool first = true;
  for (const FieldCase& f : kFields) {
    for (int odd : OddRanks(n)) {
      SCOPED_TRACE(absl::StrFormat("%s differs on rank %d", f.name, odd));
      std::unique_ptr<TestWorld> world = first ? std::move(fresh_) : Fresh();
      first = false;
      const auto [usual, other] = Described(f.field);
      world->Run([&, field = f.field, odd = odd, usual = usual, other = other](Communicator& comm) {
        const int r = comm.rank();
        // A call that agrees first, so that the group has chosen its data path (mpi: shared
        // memory inside the host, or Open MPI's collectives under FSDP_MPI_SHM=0).
        float one = 1.0f;
        ASSERT_TRUE(comm.AllReduce(&one, &one, 1, DType::kF32, ReduceOp::kSum).ok());
        // Each rank's own values: any data moved would change some of them.
        const size_t elems = static_cast<size_t>(2 * kCount * n);
        std::vector<float> send(elems, 100.0f + r), recv(elems, -1.0f - r);
        const std::vector<float> send0 = send, recv0 = recv;
        const auto t0 = std::chrono::steady_clock::now();
        const absl::Status s = Call(comm, field, r == odd, send.data(), recv.data());
        const double took = SecondsSince(t0);
        EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
        EXPECT_TRUE(Has(s, absl::StrFormat("schedule mismatch at sequence 1 of group '%s'",
                                           comm.name()))) << s;
        EXPECT_TRUE(Has(s, absl::StrFormat("ranks [%d] called %s", odd, other))) << s;
        EXPECT_TRUE(Has(s, absl::StrFormat("called %s", usual))) << s;
        EXPECT_LT(took, absl::ToDoubleSeconds(ShortDeadline())) << "a deadline, not the check: " << s;
        EXPECT_EQ(send, send0) << "the send buffer was written";
        EXPECT_EQ(recv, recv0) << "data moved although the calls differ";
        // The group has failed: the next call fails at once too.
        EXPECT_FALSE(comm.Barrier().ok());
      });
    }
  }
}

// ---------------------------------------------------------------------------- the mesh

// Every rank's result of DeviceMesh::Create with the shape `shape_of(rank)`.
void ExpectMeshFailsAtOnce(TestWorld& world, const std::function<std::pair<int, int>(int, int)>& shape_of,
                           const std::vector<std::string>& wanted) {
  world.Run([&](Communicator& comm) {
    const auto [rep, shard] = shape_of(comm.rank(), comm.size());
    const auto t0 = std::chrono::steady_clock::now();
    auto mesh = DeviceMesh::Create(comm, rep, shard);
    const double took = SecondsSince(t0);
    ASSERT_FALSE(mesh.ok());
    EXPECT_EQ(mesh.status().code(), absl::StatusCode::kInvalidArgument) << mesh.status();
    for (const std::string& w : wanted) EXPECT_TRUE(Has(mesh.status(), w)) << mesh.status();
    EXPECT_LT(took, absl::ToDoubleSeconds(ShortDeadline()))
        << "a deadline, not the check: " << mesh.status();
    EXPECT_TRUE(comm.Barrier().ok()) << "the world is unharmed";
  });
}

TEST_P(AgreementFaultTest, MeshShapesThatDifferFailEveryRankAtOnceNamingThem) {
  const int n = fresh_->size();
  for (int odd : OddRanks(n)) {
    SCOPED_TRACE(absl::StrFormat("rank %d asks for another shape", odd));
    // A valid shape of another layout...
    const std::string others = absl::StrFormat("1 x %d on ranks [", n);
    ExpectMeshFailsAtOnce(*fresh_, [odd](int r, int size) {
      return r == odd ? std::pair{size, 1} : std::pair{1, size};
    }, {"asked for different shapes", others, absl::StrFormat("%d x 1 on ranks [%d]", n, odd)});
    // ... and one that fits no world.
    ExpectMeshFailsAtOnce(*fresh_, [odd](int r, int size) {
      return r == odd ? std::pair{0, size} : std::pair{1, size};
    }, {"asked for different shapes", others, absl::StrFormat("0 x %d on ranks [%d]", n, odd)});
  }
  // Every rank asks for the same shape that does not fit: the same error everywhere, at once.
  ExpectMeshFailsAtOnce(*fresh_, [](int, int size) { return std::pair{2, size}; },
                        {absl::StrFormat("replicate 2 x shard %d = %d ranks", n, 2 * n)});
  ExpectMeshFailsAtOnce(*fresh_, [](int, int size) { return std::pair{1, size + 1}; },
                        {absl::StrFormat("shard size %d does not divide the size %d", n + 1, n)});
  ExpectMeshFailsAtOnce(*fresh_, [](int, int size) { return std::pair{-1, size}; },
                        {"dimensions must be >= 1"});
}

INSTANTIATE_TEST_SUITE_P(All, AgreementFaultTest, ::testing::ValuesIn(AgreementWorldSizes()),
                         SizeName);
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(AgreementFaultTest);

}  // namespace
}  // namespace fsdp::testing
