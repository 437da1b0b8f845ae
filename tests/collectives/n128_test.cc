// The collectives at PyTorch FSDP2's test scale: 128 ranks, parameters of [17, 257], [17],
// [64, 312] and [64, 297] elements sharded as FSDP shards them (each rank holds ceil(numel /
// 128) elements, the last ranks padding), in f32, bf16 and f16. All-gather of the shards,
// reduce-scatter (sum and average) of the padded gradient, all-reduce (sum and average) of
// the whole one, in place and out of place, on two data planes: the local communicator
// (ranks as threads, host buffers) and the strict simulated accelerator's (one `sim` device
// per rank thread, device buffers). Then the device mesh of HYBRID_SHARD at 128 in every
// shape from 1 x 128 to 128 x 1. Each rank's result is compared bit for bit with a reference
// computed here on the host.
#include <algorithm>
#include <bit>
#include <cstring>
#include <functional>
#include <memory>
#include <ostream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/data_plane.h"
#include "fsdp/local_world.h"
#include "fsdp/mesh.h"
#include "fsdp/sim_backend.h"
#include "gtest/gtest.h"

namespace fsdp::testing {
namespace {

constexpr int kWorld = 128;

struct ParamSize {
  const char* name;
  int64_t numel;
};
constexpr ParamSize kSizes[] = {
    {"17x257", 17 * 257}, {"17", 17}, {"64x312", 64 * 312}, {"64x297", 64 * 297}};

// Small integers in [-2, 2], different across ranks and elements. A sum over 128 ranks is an
// integer of magnitude at most 256, and its mean a multiple of 1/128 of magnitude at most 2:
// both have at most 8 significant bits, so they are exact in f32, bf16 and f16 whatever order
// the ranks are added in, and the reference below is the one right answer, bit for bit.
int Value(int rank, int64_t i) {
  return static_cast<int>((i * 7 + rank * 3 + i / 128 + int64_t{rank} * rank) % 5) - 2;
}

uint32_t Bits(DType t, float v) {
  switch (t) {
    case DType::kF32: return std::bit_cast<uint32_t>(v);
    case DType::kBF16: return FloatToBf16(v);
    case DType::kF16: return FloatToF16(v);
    default: return 0;
  }
}

// A typed host buffer of `count` elements followed by guard elements that must stay as set.
constexpr int64_t kGuard = 8;
constexpr unsigned char kGuardByte = 0x7e;

class HostBuffer {
 public:
  HostBuffer(DType t, int64_t count)
      : t_(t), count_(count), bytes_((count + kGuard) * DTypeSize(t), kGuardByte) {}
  char* at(int64_t i) { return bytes_.data() + i * DTypeSize(t_); }
  const char* at(int64_t i) const { return bytes_.data() + i * DTypeSize(t_); }
  char* data() { return bytes_.data(); }
  int64_t count() const { return count_; }
  size_t total_bytes() const { return bytes_.size(); }
  void Set(int64_t i, float v) {
    const uint32_t b = Bits(t_, v);
    std::memcpy(at(i), &b, DTypeSize(t_));
  }
  uint32_t Get(int64_t i) const {
    uint32_t b = 0;
    std::memcpy(&b, at(i), DTypeSize(t_));
    return b;
  }
  bool GuardIntact() const {
    for (size_t b = count_ * DTypeSize(t_); b < bytes_.size(); ++b) {
      if (static_cast<unsigned char>(bytes_[b]) != kGuardByte) return false;
    }
    return true;
  }

 private:
  DType t_;
  int64_t count_;
  std::vector<char> bytes_;
};

struct Case {
  CollectiveKind kind;
  DType dtype;
  ReduceOp op;
  bool in_place;
  ParamSize size;

  int64_t Shard() const { return ShardCount(size.numel, kWorld); }
  // Elements each rank sends and receives: the shard and the gathered padded parameter; the
  // padded gradient and its shard; the whole gradient twice.
  int64_t SendCount() const {
    return kind == CollectiveKind::kAllGather       ? Shard()
           : kind == CollectiveKind::kReduceScatter ? Shard() * kWorld
                                                    : size.numel;
  }
  int64_t RecvCount() const {
    return kind == CollectiveKind::kAllGather       ? Shard() * kWorld
           : kind == CollectiveKind::kReduceScatter ? Shard()
                                                    : size.numel;
  }
  // Where the rank's input starts in the buffer of an in-place call (NCCL's definition).
  int64_t InPlaceSendOffset(int rank) const {
    return kind == CollectiveKind::kAllGather ? rank * Shard() : 0;
  }
  // Where the rank's result starts in the buffer of an in-place call.
  int64_t InPlaceRecvOffset(int rank) const {
    return kind == CollectiveKind::kReduceScatter ? rank * Shard() : 0;
  }
  int64_t InPlaceCount() const { return std::max(SendCount(), RecvCount()); }
};

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  std::string s = absl::StrFormat("n%d_%s_%s", kWorld, CollectiveName(c.kind), DTypeName(c.dtype));
  if (c.kind != CollectiveKind::kAllGather) s += absl::StrFormat("_%s", ReduceOpName(c.op));
  return absl::StrCat(s, c.in_place ? "_inplace_" : "_outofplace_", c.size.name);
}

void PrintTo(const Case& c, std::ostream* os) {
  *os << CaseName(::testing::TestParamInfo<Case>(c, 0));
}

std::vector<Case> AllCases() {
  std::vector<Case> out;
  for (const ParamSize& size : kSizes) {
    for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
      for (bool in_place : {false, true}) {
        out.push_back({CollectiveKind::kAllGather, t, ReduceOp::kSum, in_place, size});
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
          out.push_back({CollectiveKind::kReduceScatter, t, op, in_place, size});
          out.push_back({CollectiveKind::kAllReduce, t, op, in_place, size});
        }
      }
    }
  }
  return out;
}

// What rank `r` sends: its shard of the parameter (global elements r * shard ...), or its
// whole (padded) gradient.
HostBuffer Input(const Case& c, int r) {
  HostBuffer b(c.dtype, c.SendCount());
  const int64_t base = c.kind == CollectiveKind::kAllGather ? r * c.Shard() : 0;
  for (int64_t j = 0; j < c.SendCount(); ++j) {
    b.Set(j, static_cast<float>(Value(r, base + j)));
  }
  return b;
}

// The sum over ranks of every element of the inputs (integers, exact), computed once per case
// on the host: what reduce-scatter and all-reduce must produce.
std::vector<int> SumsOverRanks(const Case& c) {
  if (c.kind == CollectiveKind::kAllGather) return {};
  std::vector<int> sums(c.SendCount(), 0);
  for (int q = 0; q < kWorld; ++q) {
    for (int64_t i = 0; i < c.SendCount(); ++i) sums[i] += Value(q, i);
  }
  return sums;
}

// What rank `r` must hold after the call: the shards in rank order, or its piece of the sums,
// divided by 128 for the mean.
HostBuffer Expected(const Case& c, int r, const std::vector<int>& sums) {
  HostBuffer b(c.dtype, c.RecvCount());
  if (c.kind == CollectiveKind::kAllGather) {
    for (int64_t k = 0; k < c.RecvCount(); ++k) {
      b.Set(k, static_cast<float>(Value(static_cast<int>(k / c.Shard()), k)));
    }
    return b;
  }
  const int64_t base = c.kind == CollectiveKind::kReduceScatter ? r * c.Shard() : 0;
  for (int64_t j = 0; j < c.RecvCount(); ++j) {
    const float sum = static_cast<float>(sums[base + j]);
    b.Set(j, c.op == ReduceOp::kAvg ? sum / kWorld : sum);
  }
  return b;
}

// Compares `got` (from element `offset`, RecvCount elements) with rank r's reference.
void ExpectResult(const Case& c, int r, const HostBuffer& got, int64_t offset,
                  const HostBuffer& want) {
  const size_t e = DTypeSize(c.dtype);
  if (std::memcmp(got.at(offset), want.at(0), want.count() * e) == 0) return;
  int64_t wrong = 0, first = -1;
  for (int64_t j = 0; j < want.count(); ++j) {
    if (got.Get(offset + j) != want.Get(j) && wrong++ == 0) first = j;
  }
  ADD_FAILURE() << "rank " << r << " of " << kWorld << ": " << wrong << " of " << want.count()
                << " elements wrong; first: element " << first << ", got bits 0x" << std::hex
                << got.Get(offset + first) << ", want 0x" << want.Get(first);
}

// Runs body(rank) on one thread per rank and joins them.
void OnEveryRank(int n, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
  for (std::thread& t : threads) t.join();
}

CommOptions ScaleOptions() {
  CommOptions o;
  o.timeout = absl::Seconds(120);  // 128 threads on two cores: a rank may wait its turn
  return o;
}

// ---------------------------------------------------------------- the local communicator

std::vector<std::unique_ptr<Communicator>>& LocalRanks() {
  static auto* ranks = [] {
    auto* v = new std::vector<std::unique_ptr<Communicator>>();
    auto world = LocalWorld::Create(kWorld, ScaleOptions());
    EXPECT_TRUE(world.ok()) << world.status();
    for (int r = 0; world.ok() && r < kWorld; ++r) {
      v->push_back(std::move((*world)->TakeRank(r)).value());
    }
    return v;
  }();
  return *ranks;
}

// The call with the rank's input at `send` and its result at `recv` (host memory).
absl::Status RunOnHost(Communicator& comm, const Case& c, const void* send, void* recv) {
  switch (c.kind) {
    case CollectiveKind::kAllGather:
      return comm.AllGather(send, recv, c.Shard(), c.dtype);
    case CollectiveKind::kReduceScatter:
      return comm.ReduceScatter(send, recv, c.Shard(), c.dtype, c.op);
    default:
      return comm.AllReduce(send, recv, c.size.numel, c.dtype, c.op);
  }
}

class LocalN128Test : public ::testing::TestWithParam<Case> {};

TEST_P(LocalN128Test, MatchesTheHostReference) {
  const Case c = GetParam();
  auto& ranks = LocalRanks();
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kWorld));
  const std::vector<int> sums = SumsOverRanks(c);
  OnEveryRank(kWorld, [&](int r) {
    Communicator& comm = *ranks[r];
    const HostBuffer input = Input(c, r);
    const HostBuffer want = Expected(c, r, sums);
    const size_t e = DTypeSize(c.dtype);
    if (c.in_place) {
      HostBuffer buf(c.dtype, c.InPlaceCount());
      std::memcpy(buf.at(c.InPlaceSendOffset(r)), input.at(0), c.SendCount() * e);
      const absl::Status s =
          RunOnHost(comm, c, buf.at(c.InPlaceSendOffset(r)), buf.at(c.InPlaceRecvOffset(r)));
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      ExpectResult(c, r, buf, c.InPlaceRecvOffset(r), want);
      EXPECT_TRUE(buf.GuardIntact()) << "rank " << r;
    } else {
      HostBuffer send = input;
      HostBuffer recv(c.dtype, c.RecvCount());
      const absl::Status s = RunOnHost(comm, c, send.data(), recv.data());
      ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
      ExpectResult(c, r, recv, 0, want);
      EXPECT_TRUE(recv.GuardIntact()) << "rank " << r;
      EXPECT_EQ(std::memcmp(send.data(), input.at(0), send.total_bytes()), 0)
          << "rank " << r << ": the send buffer changed";
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Fsdp2Sizes, LocalN128Test, ::testing::ValuesIn(AllCases()), CaseName);

// ------------------------------------------------------------------- the sim data plane

// One sim device and its data plane per rank, made once (the ranks meet in CreateDataPlane).
struct SimRank {
  std::unique_ptr<SimBackend> device;
  std::unique_ptr<DataPlane> plane;
};

std::vector<SimRank>& SimRanks() {
  static auto* ranks = [] {
    auto* v = new std::vector<SimRank>(kWorld);
    auto world = LocalWorld::Create(kWorld, ScaleOptions(), "sim128");
    EXPECT_TRUE(world.ok()) << world.status();
    if (!world.ok()) return v;
    std::vector<std::unique_ptr<Communicator>> comms;
    for (int r = 0; r < kWorld; ++r) comms.push_back(std::move((*world)->TakeRank(r)).value());
    OnEveryRank(kWorld, [&](int r) {
      SimBackendOptions o;
      o.data_plane = ScaleOptions();
      auto device = SimBackend::Create(o);
      ASSERT_TRUE(device.ok()) << device.status();
      auto plane = (*device)->CreateDataPlane(*comms[r]);
      ASSERT_TRUE(plane.ok()) << plane.status();
      (*v)[r] = {std::move(device).value(), std::move(plane).value()};
    });
    return v;
  }();
  return *ranks;
}

// Copies `host` (guard included) to a new device buffer of the rank's device.
absl::StatusOr<Buffer> ToDevice(SimBackend* device, HostBuffer& host) {
  FSDP_ASSIGN_OR_RETURN(Buffer b, Buffer::Create(device, host.total_bytes()));
  FSDP_RETURN_IF_ERROR(device->CopyFromHost(b.view(DType::kU8), host.data()));
  return b;
}

absl::Status FromDevice(SimBackend* device, const Buffer& b, HostBuffer& host) {
  return device->CopyToHost(host.data(), b.view(DType::kU8));
}

// The call on the device: views of `count` elements of the buffers (the guards stay outside),
// ordered after the compute stream; the compute stream then waits for its event.
absl::Status RunOnDevice(SimRank& rank, const Case& c, int r, const Buffer& send_buf,
                         const Buffer& recv_buf) {
  const View send_all = send_buf.view(c.dtype);
  const View recv_all = recv_buf.view(c.dtype);
  // In place, both are windows of the one buffer, as NCCL defines it.
  const View send = send_all.Slice(c.in_place ? c.InPlaceSendOffset(r) : 0, c.SendCount());
  const View recv = c.in_place ? send_all.Slice(c.InPlaceRecvOffset(r), c.RecvCount())
                               : recv_all.Slice(0, c.RecvCount());
  absl::StatusOr<Event> done;
  switch (c.kind) {
    case CollectiveKind::kAllGather: done = rank.plane->AllGather(send, recv); break;
    case CollectiveKind::kReduceScatter: done = rank.plane->ReduceScatter(send, recv, c.op); break;
    default: done = rank.plane->AllReduce(send, recv, c.op);
  }
  FSDP_RETURN_IF_ERROR(done.status());
  return rank.device->Wait(Stream::kCompute, *done);
}

class SimN128Test : public ::testing::TestWithParam<Case> {};

TEST_P(SimN128Test, MatchesTheHostReference) {
  const Case c = GetParam();
  auto& ranks = SimRanks();
  const std::vector<int> sums = SumsOverRanks(c);
  OnEveryRank(kWorld, [&](int r) {
    SimRank& rank = ranks[r];
    ASSERT_NE(rank.plane, nullptr);
    SimBackend* device = rank.device.get();
    const HostBuffer input = Input(c, r);
    const HostBuffer want = Expected(c, r, sums);
    const size_t e = DTypeSize(c.dtype);
    HostBuffer send(c.dtype, c.in_place ? c.InPlaceCount() : c.SendCount());
    std::memcpy(send.at(c.in_place ? c.InPlaceSendOffset(r) : 0), input.at(0),
                c.SendCount() * e);
    HostBuffer recv(c.dtype, c.in_place ? 0 : c.RecvCount());
    auto send_buf = ToDevice(device, send);
    auto recv_buf = ToDevice(device, recv);
    ASSERT_TRUE(send_buf.ok() && recv_buf.ok());
    const absl::Status s = RunOnDevice(rank, c, r, *send_buf, *recv_buf);
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s;
    if (c.in_place) {
      ASSERT_TRUE(FromDevice(device, *send_buf, send).ok());
      ExpectResult(c, r, send, c.InPlaceRecvOffset(r), want);
      EXPECT_TRUE(send.GuardIntact()) << "rank " << r;
    } else {
      ASSERT_TRUE(FromDevice(device, *recv_buf, recv).ok());
      ExpectResult(c, r, recv, 0, want);
      EXPECT_TRUE(recv.GuardIntact()) << "rank " << r;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Fsdp2Sizes, SimN128Test, ::testing::ValuesIn(AllCases()), CaseName);

// -------------------------------------------------------------------------- the mesh

struct MeshShape {
  int replicate, shard;
};
void PrintTo(const MeshShape& m, std::ostream* os) { *os << m.replicate << " x " << m.shard; }

std::string MeshName(const ::testing::TestParamInfo<MeshShape>& info) {
  return absl::StrFormat("n%d_%dx%d", kWorld, info.param.replicate, info.param.shard);
}

class MeshN128Test : public ::testing::TestWithParam<MeshShape> {};

// World rank r sits at (r / S, r % S): its shard group is the S consecutive ranks of its
// replicate index, its replicate group the R ranks with its shard index, S apart. Each group's
// members, gathered in group-rank order, are those world ranks; and HYBRID's gradient path
// (reduce-scatter in the shard group, all-reduce of the shard across the replicate group)
// gives the world all-reduce's piece.
TEST_P(MeshN128Test, GroupsHoldTheExpectedRanks) {
  const int R = GetParam().replicate, S = GetParam().shard;
  auto& ranks = LocalRanks();
  ASSERT_EQ(ranks.size(), static_cast<size_t>(kWorld));
  OnEveryRank(kWorld, [&](int r) {
    Communicator& world = *ranks[r];
    auto mesh = DeviceMesh::Create(world, R, S);
    ASSERT_TRUE(mesh.ok()) << "rank " << r << ": " << mesh.status();
    EXPECT_EQ(mesh->replicate_size(), R);
    EXPECT_EQ(mesh->shard_size(), S);
    EXPECT_EQ(mesh->replicate_index(), r / S);
    EXPECT_EQ(mesh->shard_index(), r % S);
    Communicator& sg = mesh->shard_group();
    Communicator& rg = mesh->replicate_group();
    EXPECT_EQ(sg.size(), S);
    EXPECT_EQ(rg.size(), R);
    EXPECT_EQ(sg.rank(), r % S);
    EXPECT_EQ(rg.rank(), r / S);
    EXPECT_EQ(sg.name(), absl::StrFormat("world/shard%d", r / S));
    EXPECT_EQ(rg.name(), absl::StrFormat("world/replicate%d", r % S));
    const float mine = static_cast<float>(r);
    std::vector<float> shard_members(S), replica_members(R);
    ASSERT_TRUE(sg.AllGather(&mine, shard_members.data(), 1, DType::kF32).ok());
    ASSERT_TRUE(rg.AllGather(&mine, replica_members.data(), 1, DType::kF32).ok());
    for (int j = 0; j < S; ++j) {
      EXPECT_EQ(shard_members[j], (r / S) * S + j) << "rank " << r << " shard member " << j;
    }
    for (int i = 0; i < R; ++i) {
      EXPECT_EQ(replica_members[i], i * S + r % S) << "rank " << r << " replica member " << i;
    }
    const int64_t per = 3;  // elements of each shard
    std::vector<float> grad(per * S), part(per), full(per * S);
    for (int64_t i = 0; i < per * S; ++i) grad[i] = full[i] = static_cast<float>(Value(r, i));
    ASSERT_TRUE(sg.ReduceScatter(grad.data(), part.data(), per, DType::kF32, ReduceOp::kSum).ok());
    ASSERT_TRUE(rg.AllReduce(part.data(), part.data(), per, DType::kF32, ReduceOp::kSum).ok());
    ASSERT_TRUE(
        world.AllReduce(full.data(), full.data(), per * S, DType::kF32, ReduceOp::kSum).ok());
    for (int64_t i = 0; i < per; ++i) {
      EXPECT_EQ(part[i], full[sg.rank() * per + i]) << "rank " << r << " element " << i;
    }
  });
}

INSTANTIATE_TEST_SUITE_P(Shapes, MeshN128Test,
                         ::testing::Values(MeshShape{1, 128}, MeshShape{2, 64}, MeshShape{4, 32},
                                           MeshShape{8, 16}, MeshShape{16, 8}, MeshShape{32, 4},
                                           MeshShape{64, 2}, MeshShape{128, 1}),
                         MeshName);

}  // namespace
}  // namespace fsdp::testing
