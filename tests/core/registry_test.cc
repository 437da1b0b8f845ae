// The backend registry (fsdp/registry.h): backends by name with key/value options, the errors
// for unknown names, keys and values, a framework's own backend registered beside the built-in
// ones, and the reasons a known backend cannot run here (not built, plugin missing, no device).
#include "fsdp/registry.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "fsdp/cpu_backend.h"
#include "gtest/gtest.h"
#include "tests/test_backend.h"

namespace fsdp {
namespace {

const BackendInfo* Find(const std::vector<BackendInfo>& list, const std::string& name) {
  for (const BackendInfo& i : list) {
    if (i.name == name) return &i;
  }
  return nullptr;
}

TEST(RegistryTest, ListsTheCoreBackendsAndTheKnownOthers) {
  const std::vector<BackendInfo> list = ListBackends();
  for (const char* name : {"cpu", "sim", "pjrt", "cuda"}) {
    const BackendInfo* i = Find(list, name);
    ASSERT_NE(i, nullptr) << name;
  }
  EXPECT_EQ(Find(list, "cpu")->unavailable, "");
  EXPECT_EQ(Find(list, "sim")->unavailable, "");
  EXPECT_FALSE(Find(list, "cpu")->threads_only);
  EXPECT_TRUE(Find(list, "sim")->threads_only);
  EXPECT_EQ(Find(list, "cpu")->keys.count("threads"), 1u);
  EXPECT_NE(BackendNames().find("cpu, sim"), std::string::npos) << BackendNames();
}

TEST(RegistryTest, CreatesTheCoreBackendsWithTheirOptions) {
  absl::StatusOr<std::unique_ptr<Backend>> cpu =
      CreateBackend("cpu", {{"threads", "1"}, {"memory_limit_bytes", "4096"}});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  EXPECT_EQ((*cpu)->name(), "cpu");
  EXPECT_EQ((*cpu)->description(), "cpu backend, 1 thread");
  absl::StatusOr<Buffer> all = Buffer::Create(cpu->get(), 4096);
  EXPECT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(Buffer::Create(cpu->get(), 1).status().code(), absl::StatusCode::kResourceExhausted);

  absl::StatusOr<std::unique_ptr<Backend>> sim =
      CreateBackend("sim", {{"threads", "2"}, {"link_latency_us", "10"}});
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_EQ((*sim)->name(), "sim");
  EXPECT_EQ((*sim)->description(), "sim backend, 2 threads");
  EXPECT_FALSE((*sim)->is_host());
}

TEST(RegistryTest, BadNamesKeysAndValuesAreErrorsThatSayWhatIsAllowed) {
  absl::Status s = CreateBackend("tpu").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no backend named 'tpu'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("cpu, sim"), std::string::npos) << s;

  s = CreateBackend("cpu", {{"thread", "2"}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("unknown option 'thread'"), std::string::npos) << s;
  EXPECT_NE(s.message().find("memory_limit_bytes, ranks_sharing_cores, threads"),
            std::string::npos)
      << s;

  for (const auto& [key, value, what] :
       std::vector<std::tuple<std::string, std::string, std::string>>{
           {"threads", "-1", "is below 0"},
           {"threads", "two", "is not an integer"},
           {"threads", "", "is not an integer"},
           {"memory_limit_bytes", "1e3", "is not an integer"},
           {"ranks_sharing_cores", "0", "is below 1"}}) {
    s = CreateBackend("cpu", {{key, value}}).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << key << "=" << value;
    EXPECT_NE(s.message().find(what), std::string::npos) << s;
    EXPECT_NE(s.message().find(key), std::string::npos) << s;
  }
  s = CreateBackend("sim", {{"link_latency_us", "nan"}}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("not a finite number"), std::string::npos) << s;
}

TEST(RegistryTest, AFrameworksOwnBackendRegistersBesideTheBuiltInOnes) {
  static std::atomic<int> made{0};
  BackendRegistration r;
  r.name = "registry_test_host";
  r.summary = "the CPU backend under another name";
  r.keys = {{"threads", "kernel threads"}};
  r.create = [](const BackendOptions& o, int rank) -> absl::StatusOr<std::unique_ptr<Backend>> {
    FSDP_ASSIGN_OR_RETURN(const int64_t t, BackendOptionInt("registry_test_host", o, "threads", 1, 1));
    EXPECT_EQ(rank, 3);
    made.fetch_add(1);
    FSDP_ASSIGN_OR_RETURN(auto b, CpuBackend::Create({.num_threads = static_cast<int>(t)}));
    return std::unique_ptr<Backend>(std::move(b));
  };
  ASSERT_TRUE(RegisterBackend(r).ok());
  EXPECT_EQ(RegisterBackend(r).code(), absl::StatusCode::kAlreadyExists);
  const std::vector<BackendInfo> list = ListBackends();
  const BackendInfo* i = Find(list, "registry_test_host");
  ASSERT_NE(i, nullptr);
  EXPECT_EQ(i->summary, r.summary);
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend("registry_test_host", {}, 3);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(made.load(), 1);
  EXPECT_TRUE(CheckBackend("registry_test_host", {{"threads", "1"}}, 4, false).ok());
  EXPECT_EQ(CheckBackend("registry_test_host", {{"device", "1"}}, 4, false).code(),
            absl::StatusCode::kInvalidArgument);

  BackendRegistration empty;
  EXPECT_EQ(RegisterBackend(empty).code(), absl::StatusCode::kInvalidArgument);
  empty.name = "registry_test_no_factory";
  EXPECT_EQ(RegisterBackend(empty).code(), absl::StatusCode::kInvalidArgument);
}

TEST(RegistryTest, CheckSaysWhetherTheRanksOfThisProcessCanHaveTheBackend) {
  EXPECT_TRUE(CheckBackend("cpu", {}, 4, /*threads=*/false).ok());
  EXPECT_TRUE(CheckBackend("sim", {}, 4, /*threads=*/true).ok());
  const absl::Status s = CheckBackend("sim", {}, 2, /*threads=*/false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("threads of one process"), std::string::npos) << s;
}

TEST(RegistryTest, PjrtIsThereWhenBuiltAndSaysWhyNotOtherwise) {
  const std::string why = testing::PjrtUnavailable();
#ifndef FSDP_TEST_PJRT
  const absl::Status s = CreateBackend("pjrt").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("does not have the PJRT backend"), std::string::npos) << s;
  GTEST_SKIP() << why;
#else
  const absl::Status missing = CreateBackend("pjrt", {{"plugin", "/nonexistent/p.so"}}).status();
  EXPECT_EQ(missing.code(), absl::StatusCode::kFailedPrecondition) << missing;
  EXPECT_NE(missing.message().find("no PJRT plugin at '/nonexistent/p.so'"), std::string::npos)
      << missing;
  if (!why.empty()) GTEST_SKIP() << why;
  const BackendOptions o = {{"plugin", testing::PjrtTestPlugin()}, {"devices", "2"}};
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend("pjrt", o, 1);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ((*b)->name(), "pjrt");
  EXPECT_NE((*b)->description().find("device 1 of 2"), std::string::npos) << (*b)->description();
  EXPECT_TRUE(CheckBackend("pjrt", o, 2, true).ok());
  const absl::Status few = CheckBackend("pjrt", o, 3, true);
  EXPECT_EQ(few.code(), absl::StatusCode::kInvalidArgument) << few;
  EXPECT_NE(few.message().find("2 device(s), fewer than the 3 ranks"), std::string::npos) << few;
  // Processes (mpirun) may each hold a client: groups across them take the host-staged bridge.
  EXPECT_TRUE(CheckBackend("pjrt", o, 2, false).ok());
  // By default a rank takes device rank % devices: its thread under CreateMpiThreadsWorld.
  absl::StatusOr<std::unique_ptr<Backend>> third = CreateBackend("pjrt", o, 3);
  ASSERT_TRUE(third.ok()) << third.status();
  EXPECT_NE((*third)->description().find("device 1 of 2"), std::string::npos)
      << (*third)->description();
  BackendOptions bad = o;
  bad["cross_process"] = "sometimes";
  const absl::Status cross = CreateBackend("pjrt", bad, 0).status();
  EXPECT_EQ(cross.code(), absl::StatusCode::kInvalidArgument) << cross;
  EXPECT_NE(cross.message().find("cross_process=sometimes"), std::string::npos) << cross;
  // The ops of a stream run as programs of at most max_fused_ops ops (1: a program per op).
  BackendOptions one = o;
  one["max_fused_ops"] = "1";
  EXPECT_TRUE(CreateBackend("pjrt", one, 0).ok());
  BackendOptions zero = o;
  zero["max_fused_ops"] = "0";
  const absl::Status fused = CreateBackend("pjrt", zero, 0).status();
  EXPECT_EQ(fused.code(), absl::StatusCode::kInvalidArgument) << fused;
  EXPECT_NE(fused.message().find("max_fused_ops"), std::string::npos) << fused;
#endif
}

TEST(RegistryTest, CudaIsThereWhenBuiltAndSaysWhyNotOtherwise) {
  const absl::StatusOr<std::unique_ptr<Backend>> b = CreateBackend("cuda");
  const std::string why = testing::CudaUnavailable();
  if (why.empty()) {
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ((*b)->name(), "cuda");
    return;
  }
  EXPECT_EQ(b.status().code(), absl::StatusCode::kFailedPrecondition) << b.status();
#ifdef FSDP_TEST_CUDA
  EXPECT_NE(b.status().message().find("no CUDA device"), std::string::npos) << b.status();
#else
  EXPECT_NE(b.status().message().find("does not have the CUDA backend"), std::string::npos)
      << b.status();
#endif
  GTEST_SKIP() << why;
}

}  // namespace
}  // namespace fsdp
