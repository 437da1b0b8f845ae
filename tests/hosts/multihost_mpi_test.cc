// Sharding across hosts: run by hosts_test.sh as `scripts/hosts/hosts.sh run 2 2 -- <this>`,
// i.e. 2 "hosts" (network namespaces, TCP between them) of 2 ranks each (shared memory inside
// one). The ranks learn the layout from Open MPI (OMPI_COMM_WORLD_LOCAL_SIZE: ranks on this
// host); every test checks that the layout is what it claims before relying on it.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fsdp/mesh.h"
#include "fsdp/mpi_world.h"
#include "fsdp/sharding.h"
#include "tests/fsdp/parity_util.h"
#include "tests/test_backend.h"
#include "tests/mpi_test_main.h"

namespace fsdp::testing {
namespace {

Communicator* g_world = nullptr;

// Ranks on this rank's host, as mpirun counted them (0 when not under mpirun).
int RanksPerHost() {
  const char* s = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  return s != nullptr ? std::atoi(s) : 0;
}

// What tells hosts apart: the network namespace (every namespace host has its own).
int64_t HostId() {
  std::error_code ec;
  const std::string link = std::filesystem::read_symlink("/proc/self/ns/net", ec).string();
  // "net:[4026532177]"
  const size_t open = link.find('[');
  return ec || open == std::string::npos ? -1 : std::atoll(link.c_str() + open + 1);
}

// HostId() of every rank of `comm`, by rank.
std::vector<int64_t> HostIds(Communicator& comm) {
  const int64_t mine = HostId();
  std::vector<int64_t> all(comm.size(), -1);
  const absl::Status s = comm.AllGather(&mine, all.data(), 1, DType::kI64);
  EXPECT_TRUE(s.ok()) << s;
  return all;
}

// Parity with the single-rank reference (tests/fsdp/parity_util.h), with and without clipping.
void ExpectParity(ShardingOptions sharding) {
  TrainSpec spec;
  spec.steps = 6;
  ExpectParityOnWorld(*g_world, sharding, spec, {Clip::kOff, Clip::kSome});
}

// mpirun placed ranks 0..R-1 on the first host, R..2R-1 on the second, and so on.
TEST(MultiHostTest, RanksOfAHostAreConsecutive) {
  const int per_host = RanksPerHost();
  ASSERT_GT(per_host, 0) << "OMPI_COMM_WORLD_LOCAL_SIZE is not set: not under mpirun";
  const int n = g_world->size();
  ASSERT_EQ(n % per_host, 0) << n << " ranks, " << per_host << " on this host";
  ASSERT_GT(n / per_host, 1) << "all " << n << " ranks on one host: run under hosts.sh";
  const std::vector<int64_t> ids = HostIds(*g_world);
  for (int r = 0; r < n; ++r) {
    for (int q = 0; q < n; ++q) {
      EXPECT_EQ(ids[r] == ids[q], r / per_host == q / per_host)
          << "ranks " << r << " and " << q << " (network namespaces " << ids[r] << ", " << ids[q]
          << "), " << per_host << " ranks per host";
    }
  }
  EXPECT_EQ(std::atoi(std::getenv("OMPI_COMM_WORLD_LOCAL_RANK")), g_world->rank() % per_host);
  // The library's own view of the layout agrees.
  auto layout = DiscoverHostLayout(*g_world);
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->num_hosts, n / per_host) << layout->Describe();
  EXPECT_EQ(layout->uniform_ranks_per_host(), per_host) << layout->Describe();
}

// HYBRID_SHARD with the shard group = the ranks of one host: the shard group's ranks share
// a host, the replicate group's ranks are on different hosts.
TEST(MultiHostTest, HybridShardGroupIsAHost) {
  const int per_host = RanksPerHost();
  ASSERT_GT(per_host, 0);
  const int n = g_world->size();
  auto mesh = DeviceMesh::Create(*g_world, n / per_host, per_host);
  ASSERT_TRUE(mesh.ok()) << mesh.status();
  const std::vector<int64_t> shard = HostIds(mesh->shard_group());
  const std::vector<int64_t> replicate = HostIds(mesh->replicate_group());
  for (int64_t id : shard) EXPECT_EQ(id, HostId()) << "a shard group spans hosts";
  for (size_t i = 0; i < replicate.size(); ++i) {
    for (size_t j = i + 1; j < replicate.size(); ++j) {
      EXPECT_NE(replicate[i], replicate[j]) << "two ranks of a replicate group share a host";
    }
  }
  // Inside a host the data moves through shared memory; across hosts through Open MPI.
  EXPECT_EQ(MpiDataPath(mesh->shard_group()), per_host > 1 ? "shm" : "mpi");
  EXPECT_EQ(MpiDataPath(mesh->replicate_group()), "mpi");
  EXPECT_EQ(MpiDataPath(*g_world), "mpi");
  ShardingOptions o;
  o.strategy = ShardingStrategy::kHybridShard;
  o.hybrid_shard_size = per_host;
  ExpectParity(o);
}

TEST(MultiHostTest, HybridShardGradOpGroupIsAHost) {
  ShardingOptions o;
  o.strategy = ShardingStrategy::kHybridShardGradOp;
  o.hybrid_shard_size = RanksPerHost();
  ASSERT_GT(o.hybrid_shard_size, 0);
  ExpectParity(o);
}

// hybrid_shard_size 0: the library finds the hosts and makes each one a shard group.
TEST(MultiHostTest, HybridShardSizeZeroMakesEachHostAShardGroup) {
  const int per_host = RanksPerHost();
  ASSERT_GT(per_host, 0);
  auto backend = MakeTestBackend(1);
  ASSERT_TRUE(backend.ok()) << backend.status();
  ShardingOptions o;
  o.strategy = ShardingStrategy::kHybridShard;
  o.hybrid_shard_size = 0;
  auto rt = ShardingRuntime::Create(backend->get(), *g_world, o);
  ASSERT_TRUE(rt.ok()) << rt.status();
  EXPECT_EQ((*rt)->shard_group().size(), per_host);
  EXPECT_EQ((*rt)->replicate_group().size(), g_world->size() / per_host);
  for (int64_t id : HostIds((*rt)->shard_group())) EXPECT_EQ(id, HostId()) << "a shard group spans hosts";
  rt->reset();
  ExpectParity(o);
}

TEST(MultiHostTest, FullShardAcrossHosts) {
  ShardingOptions o;
  o.strategy = ShardingStrategy::kFullShard;
  ExpectParity(o);
}

}  // namespace
}  // namespace fsdp::testing

int main(int argc, char** argv) {
  return fsdp::testing::MpiTestMain(argc, argv, "multihost_mpi_test",
                                    [](fsdp::Communicator& world) {
                                      fsdp::testing::g_world = &world;
                                      return absl::OkStatus();
                                    });
}
