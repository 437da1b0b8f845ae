// ShmChannel, the shared-memory data path of the mpi communicator inside a host: every kind,
// dtype and reduction, in place and not, over many rounds (tiny halves), bitwise against the
// local transport; attach, unlink, bad segments and the wait diagnosis; and real processes.
#include "collectives/shm_channel.h"

#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "fsdp/local_world.h"
#include "gtest/gtest.h"

namespace fsdp::internal {
namespace {

std::string UniqueName(const char* what) {
  static int counter = 0;
  return absl::StrFormat("/fsdp-test-%s-%d-%d", what, getpid(), counter++);
}

// Runs body(rank, channel) on `n` threads, each with its own mapping of one segment.
void RunChannels(int n, size_t half_bytes, const std::string& name,
                 const std::function<void(int, ShmChannel&)>& body) {
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ShmChannel ch(name, r, n, half_bytes);
      for (;;) {
        absl::StatusOr<bool> ok = ch.Attach();
        ASSERT_TRUE(ok.ok()) << ok.status();
        if (*ok) break;
        std::this_thread::yield();
      }
      body(r, ch);
    });
  }
  for (auto& t : threads) t.join();
}

void RunCall(ShmChannel& ch, const CollectiveCall& call) {
  ShmTransfer t{.call = call};
  while (!ch.Advance(t)) std::this_thread::yield();
}

struct Case {
  CollectiveKind kind;
  DType dtype;
  ReduceOp op;
  int64_t count;
  bool in_place;
  int root;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (CollectiveKind k : {CollectiveKind::kAllGather, CollectiveKind::kReduceScatter,
                           CollectiveKind::kAllReduce, CollectiveKind::kBroadcast,
                           CollectiveKind::kAllToAll}) {
    for (DType d : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        const bool reduces = k == CollectiveKind::kReduceScatter || k == CollectiveKind::kAllReduce;
        if (!reduces && op != ReduceOp::kSum) continue;
        for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{100}, int64_t{1001}}) {
          for (bool in_place : {false, true}) {
            if (in_place && k == CollectiveKind::kAllToAll) continue;  // never in place
            cases.push_back({k, d, op, count, in_place, static_cast<int>(count % 3)});
          }
        }
      }
    }
  }
  return cases;
}

// Per rank: the send and receive buffers of one case, with the same inputs for both transports.
struct Buffers {
  std::vector<char> send, recv;
  CollectiveCall call;
};

Buffers MakeBuffers(const Case& c, int rank, int n) {
  const size_t e = DTypeSize(c.dtype);
  int64_t in = c.count, out = c.count;
  if (c.kind == CollectiveKind::kAllGather) out = c.count * n;
  if (c.kind == CollectiveKind::kReduceScatter) in = c.count * n;
  if (c.kind == CollectiveKind::kAllToAll) in = out = c.count * n;
  Buffers b;
  b.send.resize(std::max<int64_t>(in, 1) * e);
  b.recv.assign(std::max<int64_t>(out, 1) * e, 0x55);
  std::mt19937 rng(static_cast<uint32_t>(rank * 7919 + c.count * 31 + static_cast<int>(c.kind)));
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (int64_t i = 0; i < in; ++i) {
    const float v = u(rng);
    if (c.dtype == DType::kF32) {
      std::memcpy(b.send.data() + i * 4, &v, 4);
    } else {  // any 16-bit pattern of a modest finite value: the top half of an f32
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      const uint16_t h = c.dtype == DType::kBF16 ? static_cast<uint16_t>(bits >> 16)
                                                 : static_cast<uint16_t>(0x3c00 + (bits >> 22) % 0x800);
      std::memcpy(b.send.data() + i * 2, &h, 2);
    }
  }
  b.call = {.kind = c.kind, .send = b.send.data(), .recv = b.recv.data(), .count = c.count,
            .dtype = c.dtype, .op = c.op, .root = c.kind == CollectiveKind::kBroadcast ? c.root % n : 0};
  if (c.in_place) {
    switch (c.kind) {
      case CollectiveKind::kAllGather:
        std::memcpy(b.recv.data() + rank * c.count * e, b.send.data(), c.count * e);
        b.call.send = b.recv.data() + rank * c.count * e;
        break;
      case CollectiveKind::kReduceScatter:
        b.recv = b.send;
        b.call.send = b.recv.data();
        b.call.recv = b.recv.data() + rank * c.count * e;
        break;
      default:
        b.recv = b.send;
        b.call.send = b.call.recv = b.recv.data();
        break;
    }
  } else if (c.kind == CollectiveKind::kBroadcast) {
    std::memcpy(b.recv.data(), b.send.data(), c.count * e);  // the buffer of broadcast is recv
  }
  return b;
}

// What this rank's output is, as bytes (for reduce_scatter in place, its chunk).
std::vector<char> Output(const Buffers& b, const Case& c, int rank, int n) {
  const size_t e = DTypeSize(c.dtype);
  size_t bytes = c.count * e;
  const char* p = static_cast<const char*>(b.call.recv);
  if (c.kind == CollectiveKind::kAllGather || c.kind == CollectiveKind::kAllToAll) {
    bytes *= n;
    p = b.recv.data();
  }
  (void)rank;
  return std::vector<char>(p, p + bytes);
}

class ShmChannelTest : public ::testing::TestWithParam<int> {};

TEST_P(ShmChannelTest, EveryCallMatchesTheLocalTransportBitwiseOverManyRounds) {
  const int n = GetParam();
  const std::vector<Case> cases = Cases();
  // The local transport's results, as the oracle.
  std::vector<std::vector<std::vector<char>>> want(cases.size(), std::vector<std::vector<char>>(n));
  ASSERT_TRUE(LocalWorld::Run(n, {}, [&](Communicator& comm) {
                const int r = comm.rank();
                for (size_t i = 0; i < cases.size(); ++i) {
                  Buffers b = MakeBuffers(cases[i], r, n);
                  const CollectiveCall& c = b.call;
                  absl::Status s;
                  switch (c.kind) {
                    case CollectiveKind::kAllGather: s = comm.AllGather(c.send, c.recv, c.count, c.dtype); break;
                    case CollectiveKind::kReduceScatter:
                      s = comm.ReduceScatter(c.send, c.recv, c.count, c.dtype, c.op);
                      break;
                    case CollectiveKind::kAllReduce: s = comm.AllReduce(c.send, c.recv, c.count, c.dtype, c.op); break;
                    case CollectiveKind::kAllToAll: s = comm.AllToAll(c.send, c.recv, c.count, c.dtype); break;
                    default: s = comm.Broadcast(c.recv, c.count, c.dtype, c.root); break;
                  }
                  if (!s.ok()) return s;
                  want[i][r] = Output(b, cases[i], r, n);
                }
                return absl::OkStatus();
              }).ok());
  // Halves of 96 bytes: a call of 1001 elements takes dozens of rounds, and consecutive calls
  // reuse both halves in turn.
  std::vector<std::vector<std::vector<char>>> got(cases.size(), std::vector<std::vector<char>>(n));
  RunChannels(n, 96, UniqueName("all"), [&](int r, ShmChannel& ch) {
    for (size_t i = 0; i < cases.size(); ++i) {
      Buffers b = MakeBuffers(cases[i], r, n);
      RunCall(ch, b.call);
      got[i][r] = Output(b, cases[i], r, n);
    }
  });
  for (size_t i = 0; i < cases.size(); ++i) {
    for (int r = 0; r < n; ++r) {
      const Case& c = cases[i];
      ASSERT_EQ(got[i][r], want[i][r])
          << DescribeCall({.kind = c.kind, .count = c.count, .dtype = c.dtype, .op = c.op, .root = c.root})
          << (c.in_place ? " in place" : "") << " on rank " << r << " of " << n;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ShmChannelTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return absl::StrFormat("n%d", info.param); });

TEST(ShmChannel, TheNameIsUnlinkedOnceEveryRankHasTheSegment) {
  const std::string name = UniqueName("unlink");
  RunChannels(2, 4096, name, [&](int, ShmChannel& ch) {
    float x = 1, y[2];
    RunCall(ch, {.kind = CollectiveKind::kAllGather, .send = &x, .recv = y, .count = 1});
  });
  EXPECT_EQ(access(("/dev/shm" + name).c_str(), F_OK), -1) << name << " was left in /dev/shm";
}

TEST(ShmChannel, AWaitingRankIsDescribedAndAnAbsentRank0IsNamed) {
  const std::string name = UniqueName("wait");
  ShmChannel r1(name, 1, 2, 4096);
  absl::StatusOr<bool> ok = r1.Attach();
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_FALSE(*ok);  // rank 0 has not made it
  ShmTransfer t1{.call = {.kind = CollectiveKind::kAllGather}};
  EXPECT_NE(r1.DescribeWait(t1).find("rank 0 of the group has not made it"), std::string::npos)
      << r1.DescribeWait(t1);
  ShmChannel r0(name, 0, 2, 4096);
  ASSERT_TRUE(*r0.Attach());
  float x = 3, y[2] = {0, 0};
  ShmTransfer t0{.call = {.kind = CollectiveKind::kAllGather, .send = &x, .recv = y, .count = 1}};
  EXPECT_FALSE(r0.Advance(t0));  // rank 1 has copied nothing in
  EXPECT_FALSE(r0.Advance(t0));
  const std::string why = r0.DescribeWait(t0);
  EXPECT_NE(why.find("ranks [1]"), std::string::npos) << why;
  EXPECT_NE(why.find("copied in"), std::string::npos) << why;
  // Rank 1 arrives: both complete.
  ASSERT_TRUE(*r1.Attach());
  float z = 4, w[2] = {0, 0};
  t1.call = {.kind = CollectiveKind::kAllGather, .send = &z, .recv = w, .count = 1};
  EXPECT_TRUE(r1.Advance(t1));
  EXPECT_TRUE(r0.Advance(t0));
  EXPECT_EQ(y[0], 3);
  EXPECT_EQ(y[1], 4);
  EXPECT_EQ(w[0], 3);
  EXPECT_EQ(w[1], 4);
}

TEST(ShmChannel, ASegmentMadeForAnotherShapeIsRefused) {
  const std::string name = UniqueName("shape");
  ShmChannel r0(name, 0, 2, 4096);
  ASSERT_TRUE(*r0.Attach());
  ShmChannel r1(name, 1, 3, 4096);
  absl::StatusOr<bool> ok = r1.Attach();
  ASSERT_FALSE(ok.ok());
  EXPECT_EQ(ok.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(ok.status().message().find("made for 2 ranks"), std::string::npos) << ok.status();
}

TEST(ShmChannel, AnExistingNameIsNotTakenOver) {
  const std::string name = UniqueName("exists");
  ShmChannel first(name, 0, 2, 4096);
  ASSERT_TRUE(*first.Attach());
  ShmChannel second(name, 0, 2, 4096);
  absl::StatusOr<bool> ok = second.Attach();
  ASSERT_FALSE(ok.ok());
  EXPECT_NE(ok.status().message().find("File exists"), std::string::npos) << ok.status();
}

// Two real processes: a reduce_scatter of 3 MiB per rank in bf16 (many 1 MiB rounds).
TEST(ShmChannel, TwoProcessesReduceScatterAcrossManyRounds) {
  const std::string name = UniqueName("fork");
  constexpr int64_t kCount = int64_t{3} << 19;  // per rank: 1.5 Mi bf16 elements
  auto input = [](int rank, int64_t i) {  // small integers: exact in bf16, sums exact in f32
    return static_cast<float>((i * 7 + rank * 3) % 17);
  };
  auto run = [&](int rank) -> bool {
    ShmChannel ch(name, rank, 2);
    for (;;) {
      absl::StatusOr<bool> ok = ch.Attach();
      if (!ok.ok()) return false;
      if (*ok) break;
      usleep(100);
    }
    std::vector<uint16_t> send(2 * kCount), recv(kCount);
    for (int64_t i = 0; i < 2 * kCount; ++i) {
      const float v = input(rank, i);
      uint32_t bits;
      std::memcpy(&bits, &v, 4);
      send[i] = static_cast<uint16_t>(bits >> 16);
    }
    RunCall(ch, {.kind = CollectiveKind::kReduceScatter, .send = send.data(), .recv = recv.data(),
             .count = kCount, .dtype = DType::kBF16});
    for (int64_t i = 0; i < kCount; ++i) {
      const int64_t g = rank * kCount + i;
      const uint32_t bits = static_cast<uint32_t>(recv[i]) << 16;
      float got;
      std::memcpy(&got, &bits, 4);
      if (got != input(0, g) + input(1, g)) return false;
    }
    return true;
  };
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) _exit(run(1) ? 0 : 1);
  const bool mine = run(0);
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  EXPECT_TRUE(mine) << "rank 0's result is wrong";
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "rank 1's result is wrong";
}

}  // namespace
}  // namespace fsdp::internal
