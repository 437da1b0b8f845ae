// The PJRT backend across processes, under `mpirun -np 2` with 2 devices of the XLA CPU plugin
// per process (CreateMpiThreadsWorld(2): 4 ranks): groups inside a process use the plugin's
// collectives, groups across processes the host-staged bridge, and the choice is the same on
// every rank and reported; results are checked against sums computed here, in f32 and bf16;
// cross_process = plugin is refused with the reason, since the CPU plugin's client spans one
// process. Skips (exit 77 from every process) when the plugin is absent.
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/data_plane.h"
#include "fsdp/dtype.h"
#include "fsdp/mpi_world.h"
#include "fsdp/pjrt_backend.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

constexpr int kThreads = 2;

std::vector<std::unique_ptr<Communicator>>* g_world = nullptr;
std::shared_ptr<pjrt::Client> g_client;

void OnRanks(const std::function<void(Communicator&, int thread)>& body) {
  std::vector<std::thread> ts;
  for (int t = 0; t < kThreads; ++t) ts.emplace_back([&body, t] { body(*(*g_world)[t], t); });
  for (auto& t : ts) t.join();
}

std::vector<float> Round(DType dt, std::vector<float> v) {
  if (dt == DType::kBF16) {
    for (float& x : v) x = Bf16ToFloat(FloatToBf16(x));
  }
  return v;
}

// Host values of dtype `dt` <-> floats.
std::vector<uint8_t> Encode(DType dt, const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * DTypeSize(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::kF32) {
      std::memcpy(out.data() + 4 * i, &v[i], 4);
    } else {
      const uint16_t h = FloatToBf16(v[i]);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}
std::vector<float> Decode(DType dt, const std::vector<uint8_t>& b) {
  std::vector<float> out(b.size() / DTypeSize(dt));
  for (size_t i = 0; i < out.size(); ++i) {
    if (dt == DType::kF32) {
      std::memcpy(&out[i], b.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, b.data() + 2 * i, 2);
      out[i] = Bf16ToFloat(h);
    }
  }
  return out;
}

// Rank q's value i: small integers and halves, exact in bf16 and in any order of summation.
float Value(int q, int64_t i) { return static_cast<float>((q + 1) * ((i % 7) - 3)) * 0.5f; }

TEST(PjrtAcrossProcesses, GroupsPickTheirPathAndComputeTheRightValues) {
  OnRanks([](Communicator& world, int thread) {
    auto backend = PjrtBackend::Create(g_client, thread);
    ASSERT_TRUE(backend.ok()) << backend.status();
    Backend& b = **backend;
    const int n = world.size(), r = world.rank();
    ASSERT_EQ(n, 2 * kThreads);
    // The world (across processes), a process's ranks (inside), a rank per process (across).
    auto inside = world.Split(r / kThreads, r, "shard");
    auto across = world.Split(r % kThreads, r, "replicate");
    ASSERT_TRUE(inside.ok() && across.ok());
    struct Case {
      Communicator* group;
      const char* path;
    };
    for (const Case& c : {Case{&world, "bridge"}, Case{inside->get(), "plugin"},
                          Case{across->get(), "bridge"}}) {
      auto plane = b.CreateDataPlane(*c.group);
      ASSERT_TRUE(plane.ok()) << plane.status();
      const int gn = c.group->size(), gr = c.group->rank();
      for (DType dt : {DType::kF32, DType::kBF16}) {
        const int64_t k = 37;  // per rank
        std::vector<float> mine(static_cast<size_t>(k * gn));
        for (int64_t i = 0; i < k * gn; ++i) mine[i] = Value(gr, i);
        const size_t es = DTypeSize(dt);
        auto send = b.Allocate(mine.size() * es);
        auto recv = b.Allocate(mine.size() * es);
        ASSERT_TRUE(send.ok() && recv.ok());
        const View vs{&b, *send, 0, k * gn, dt}, vr{&b, *recv, 0, k * gn, dt};
        const std::vector<uint8_t> bytes = Encode(dt, mine);
        ASSERT_TRUE(b.CopyFromHost(vs, bytes.data()).ok());
        // all_reduce (sum) of the whole buffer.
        auto e = (*plane)->AllReduce(vs, vr, ReduceOp::kSum);
        ASSERT_TRUE(e.ok()) << e.status();
        ASSERT_TRUE(e->Wait().ok());
        std::vector<uint8_t> out(bytes.size());
        ASSERT_TRUE(b.CopyToHost(out.data(), vr).ok());
        std::vector<float> got = Decode(dt, out), want(mine.size(), 0.0f);
        for (int q = 0; q < gn; ++q) {
          for (int64_t i = 0; i < k * gn; ++i) want[i] += Value(q, i);
        }
        EXPECT_EQ(got, Round(dt, want)) << c.group->name() << " all_reduce " << DTypeName(dt);
        // reduce_scatter (avg): this rank's chunk of the sum, over gn.
        const View chunk{&b, *recv, 0, k, dt};
        e = (*plane)->ReduceScatter(vs, chunk, ReduceOp::kAvg);
        ASSERT_TRUE(e.ok() && e->Wait().ok());
        std::vector<uint8_t> part(k * es);
        ASSERT_TRUE(b.CopyToHost(part.data(), chunk).ok());
        got = Decode(dt, part);
        for (int64_t i = 0; i < k; ++i) {
          EXPECT_EQ(got[i], Round(dt, {want[gr * k + i] / static_cast<float>(gn)})[0])
              << c.group->name() << " reduce_scatter " << DTypeName(dt) << " at " << i;
        }
        // all_gather of each rank's first k values.
        const View first{&b, *send, 0, k, dt};
        e = (*plane)->AllGather(first, vr);
        ASSERT_TRUE(e.ok() && e->Wait().ok());
        ASSERT_TRUE(b.CopyToHost(out.data(), vr).ok());
        got = Decode(dt, out);
        for (int q = 0; q < gn; ++q) {
          for (int64_t i = 0; i < k; ++i) {
            ASSERT_EQ(got[q * k + i], Round(dt, {Value(q, i)})[0]) << c.group->name();
          }
        }
        b.Free(*send);
        b.Free(*recv);
      }
    }
    auto* pjrt = static_cast<PjrtBackend*>(&b);
    const auto paths = pjrt->data_paths();
    ASSERT_EQ(paths.size(), 3u);
    EXPECT_EQ(paths[0], std::make_pair(std::string("world"), std::string("bridge")));
    EXPECT_EQ(paths[1].second, "plugin");
    EXPECT_EQ(paths[2].second, "bridge");
    EXPECT_NE(b.description().find("data planes: world bridge"), std::string::npos)
        << b.description();
  });
}

TEST(PjrtAcrossProcesses, PluginOnlyIsRefusedWhenTheClientSpansOneProcess) {
  OnRanks([](Communicator& world, int thread) {
    PjrtBackendOptions o;
    o.cross_process = CrossProcess::kPlugin;
    auto backend = PjrtBackend::Create(g_client, thread, o);
    ASSERT_TRUE(backend.ok());
    auto plane = (*backend)->CreateDataPlane(world);
    ASSERT_FALSE(plane.ok());
    EXPECT_EQ(plane.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(plane.status().message().find("spans this process only"), std::string::npos)
        << plane.status();
    EXPECT_NE(plane.status().message().find("bridge"), std::string::npos) << plane.status();
    // A group inside the process still uses the plugin.
    auto inside = world.Split(world.rank() / kThreads, world.rank(), "shard");
    ASSERT_TRUE(inside.ok());
    EXPECT_TRUE((*backend)->CreateDataPlane(**inside).ok());
  });
}

// The key-value store over the processes' communicator: what one process puts, the other gets;
// Get waits, and times out naming the key; TryGet of an absent key is NotFound; a key keeps its
// first value.
TEST(PjrtKeyValueStore, ProcessesSeeEachOthersPuts) {
  auto comm = CreateMpiWorld();
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int me = (*comm)->rank(), n = (*comm)->size();
  auto store = pjrt::CreateCommKeyValueStore(std::move(comm).value());
  ASSERT_TRUE(store.ok()) << store.status();
  pjrt::KeyValueStore& kv = **store;
  ASSERT_TRUE(kv.Put("rank/" + std::to_string(me), std::string(3 + me, 'a' + me)).ok());
  for (int q = 0; q < n; ++q) {
    auto v = kv.Get("rank/" + std::to_string(q), absl::Seconds(20));
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(*v, std::string(3 + q, 'a' + q));
  }
  EXPECT_TRUE(kv.Put("rank/" + std::to_string(me), std::string(3 + me, 'a' + me)).ok());
  EXPECT_EQ(kv.Put("rank/" + std::to_string(me), "other").code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(kv.TryGet("never").status().code(), absl::StatusCode::kNotFound);
  const auto t0 = std::chrono::steady_clock::now();
  auto late = kv.Get("never", absl::Milliseconds(200));
  EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_NE(late.status().message().find("'never'"), std::string::npos) << late.status();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  // A value with every byte value, and a large one.
  std::string bytes(300000, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + me);
  ASSERT_TRUE(kv.Put("bytes/" + std::to_string(me), bytes).ok());
  auto other = kv.Get("bytes/" + std::to_string(1 - me), absl::Seconds(20));
  ASSERT_TRUE(other.ok()) << other.status();
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i * 7 + (1 - me));
  EXPECT_EQ(*other, bytes);
}

// The multi-process client's plumbing, on the stub plugin (stub_plugin.cc): node_id and
// num_nodes reach the plugin as create options and its key-value traffic goes through the
// store, so each process sees the other's devices.
TEST(PjrtMultiProcessClient, StubPluginGetsTheOptionsAndTheStore) {
  const char* stub = std::getenv("FSDP_PJRT_STUB_PLUGIN");
  if (stub == nullptr || !std::filesystem::exists(stub)) {
    GTEST_SKIP() << "no stub plugin at $FSDP_PJRT_STUB_PLUGIN";
  }
  auto comm = CreateMpiWorld();
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int me = (*comm)->rank();
  auto store = pjrt::CreateCommKeyValueStore(std::move(comm).value());
  ASSERT_TRUE(store.ok());
  pjrt::PjrtClientOptions o;
  o.plugin_path = stub;
  o.node_id = me;
  o.num_nodes = 2;
  o.kv_store = *store;
  auto client = pjrt::Client::Create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->platform_name(),
            "stub node " + std::to_string(me) + " of 2, peers 0:2 1:2");
  EXPECT_EQ((*client)->num_devices(), 2);
  EXPECT_EQ((*client)->global_device_count(), 4);
  EXPECT_EQ((*client)->device_id(0), 2 * me);
  // Misuse is refused before the plugin is called.
  o.kv_store = nullptr;
  auto no_store = pjrt::Client::Create(o);
  EXPECT_EQ(no_store.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(no_store.status().message().find("key-value store"), std::string::npos)
      << no_store.status();
  o.kv_store = *store;
  o.node_id = 2;
  EXPECT_EQ(pjrt::Client::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.node_id = me;
  o.create_options["num_nodes"] = int64_t{2};
  EXPECT_EQ(pjrt::Client::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// The XLA CPU plugin takes the options and the store and ignores them (API 0.81): its client
// spans this process only, which the data plane then reports for cross_process = plugin (the
// case above, PluginOnlyIsRefusedWhenTheClientSpansOneProcess).
TEST(PjrtMultiProcessClient, CpuPluginClientSpansOneProcess) {
  auto comm = CreateMpiWorld();
  ASSERT_TRUE(comm.ok());
  const int me = (*comm)->rank();
  auto store = pjrt::CreateCommKeyValueStore(std::move(comm).value());
  ASSERT_TRUE(store.ok());
  pjrt::PjrtClientOptions o;
  o.node_id = me;
  o.num_nodes = 2;
  o.kv_store = *store;
  o.create_options["cpu_device_count"] = int64_t{kThreads};
  auto client = pjrt::Client::Create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  EXPECT_EQ((*client)->num_devices(), kThreads);
  EXPECT_EQ((*client)->global_device_count(), kThreads);
}

}  // namespace
}  // namespace fsdp

int main(int argc, char** argv) {
  const char* plugin = std::getenv(fsdp::pjrt::kPluginEnv);
  if (plugin == nullptr || !std::filesystem::exists(plugin)) {
    std::printf("skipped: no PJRT plugin at $%s='%s' (scripts/fetch_pjrt_plugin.sh <build>/pjrt)\n",
                fsdp::pjrt::kPluginEnv, plugin != nullptr ? plugin : "");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  auto world = fsdp::CreateMpiThreadsWorld(fsdp::kThreads);
  if (!world.ok()) {
    std::fprintf(stderr, "CreateMpiThreadsWorld: %s\n", world.status().ToString().c_str());
    return 1;
  }
  fsdp::pjrt::PjrtClientOptions o;
  o.create_options["cpu_device_count"] = int64_t{fsdp::kThreads};
  auto client = fsdp::pjrt::Client::Create(o);
  if (!client.ok()) {
    std::fprintf(stderr, "pjrt client: %s\n", client.status().ToString().c_str());
    return 1;
  }
  fsdp::g_client = *client;
  fsdp::g_world = &*world;
  const int rank = (*world)[0]->rank();
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_xml_generator());
  }
  int rc = RUN_ALL_TESTS();
  // Agree on the outcome over the world.
  std::vector<float> failed(fsdp::kThreads, rc != 0 ? 1.0f : 0.0f), any(fsdp::kThreads, 0.0f);
  std::vector<std::thread> ts;
  for (int t = 0; t < fsdp::kThreads; ++t) {
    ts.emplace_back([&, t] {
      (*world)[t]->AllReduce(&failed[t], &any[t], 1, fsdp::DType::kF32, fsdp::ReduceOp::kMax)
          .IgnoreError();
    });
  }
  for (auto& t : ts) t.join();
  if (any[0] != 0.0f) rc = 1;
  world->clear();
  fsdp::ShutdownMpi();
  return rc;
}
