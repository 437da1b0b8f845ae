// The training results of the CPU backend, bit for bit, against those the binary before a
// change to the runtime's schedule produced: the losses (f32 bits), the gradient norms before
// clipping (f64 bits) and the final parameters (a hash of their f32 bits), for nano and mini on FULL_SHARD with 2 ranks and HYBRID_SHARD 2 x 2, with and
// without prefetch, and with accumulation. tests/fsdp/golden/bitwise.txt holds them. (Not the
// memory peaks: how many reductions a rank holds depends on when they complete; the planner's
// tests bound them.)
//
// Bits depend on the kernels the CPU runs (the ISA oneDNN and libfsdp dispatch to) and on the
// build (type, compiler, -march=native, a sanitizer: the optimiser may contract or reorder
// floating-point work differently), so the file records both, and a run on another platform or
// build is skipped, saying so.
// To write the file (from the binary before a change): FSDP_WRITE_GOLDEN=PATH.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "fsdp/local_world.h"
#include "gtest/gtest.h"
#include "tests/fsdp/parity_util.h"

#if !defined(FSDP_SOURCE_DIR) || !defined(FSDP_GOLDEN_BUILD)
#error "FSDP_SOURCE_DIR and FSDP_GOLDEN_BUILD must be defined"
#endif

namespace fsdp::testing {
namespace {

struct GoldenCase {
  std::string name, config;
  ShardingStrategy strategy;
  int world, hybrid, prefetch, micro_batches;
};

std::vector<GoldenCase> Cases() {
  std::vector<GoldenCase> out;
  for (const char* config : {"nano", "mini"}) {
    out.push_back({absl::StrCat(config, "_FULL_SHARD_N2"), config, ShardingStrategy::kFullShard,
                   2, 0, 1, 1});
    out.push_back({absl::StrCat(config, "_HYBRID_SHARD_N4_S2"), config,
                   ShardingStrategy::kHybridShard, 4, 2, 1, 1});
  }
  out.push_back({"nano_FULL_SHARD_N2_noprefetch", "nano", ShardingStrategy::kFullShard, 2, 0, 0,
                 1});
  out.push_back({"nano_FULL_SHARD_N2_prefetch2_accum2", "nano", ShardingStrategy::kFullShard, 2,
                 0, 2, 2});
  out.push_back({"nano_HYBRID_SHARD_N4_S2_accum2", "nano", ShardingStrategy::kHybridShard, 4, 2,
                 1, 2});
  return out;
}

uint64_t Fnv(uint64_t h, const void* data, size_t n) {
  const unsigned char* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// One case's results as text lines "key value".
std::string RunCase(const GoldenCase& c) {
  TrainSpec spec;
  spec.config = c.config;
  spec.steps = 4;
  spec.batch_size = 2;
  spec.seq_len = 32;
  spec.micro_batches = c.micro_batches;
  ShardingOptions so;
  so.strategy = c.strategy;
  so.hybrid_shard_size = c.hybrid;
  so.forward_prefetch = so.backward_prefetch = c.prefetch > 0;
  so.max_prefetch_units = std::max(1, c.prefetch);
  std::vector<TrainResult> results(c.world);
  const absl::Status s = LocalWorld::Run(c.world, {}, [&](Communicator& comm) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(results[comm.rank()], TrainSharded(comm, spec, so, 1, "cpu"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(s.ok()) << c.name << ": " << s;
  if (!s.ok()) return "";
  const TrainResult& r = results[0];
  std::string out;
  for (size_t i = 0; i < r.losses.size(); ++i) {
    uint32_t bits;
    std::memcpy(&bits, &r.losses[i], 4);
    absl::StrAppendFormat(&out, "%s loss%d %08x\n", c.name, i, bits);
  }
  for (size_t i = 0; i < r.grad_norms.size(); ++i) {
    uint64_t bits;
    std::memcpy(&bits, &r.grad_norms[i], 8);
    absl::StrAppendFormat(&out, "%s norm%d %016x\n", c.name, i, bits);
  }
  uint64_t h = 1469598103934665603ull;
  for (const std::vector<float>& unit : r.params) h = Fnv(h, unit.data(), unit.size() * 4);
  absl::StrAppendFormat(&out, "%s params %016x\n", c.name, h);
  return out;
}

// What decides the bits besides the code: the CPU (its ISA and caches pick oneDNN's kernels
// and their blocking) and the ISA libfsdp's own element-wise kernels run (AVX-512 where the
// CPU has it, unless FSDP_CPU_ISA=baseline: kernels/cpu/isa.h).
std::string Platform() {
  std::string model = "unknown CPU", flags;
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.rfind("model name", 0) == 0 && model == "unknown CPU") {
      model = line.substr(line.find(':') + 2);
    }
    if (line.rfind("flags", 0) == 0 && flags.empty()) flags = line + " ";
  }
  bool avx512 = true;
  for (const char* f : {" avx512f ", " avx512bw ", " avx512cd ", " avx512dq ", " avx512vl "}) {
    avx512 = avx512 && flags.find(f) != std::string::npos;
  }
  const char* isa = std::getenv("FSDP_CPU_ISA");
  if (isa != nullptr && std::string(isa) == "baseline") avx512 = false;
  return absl::StrCat("platform ", model, "; element-wise kernels ",
                      avx512 ? "avx512" : "baseline", "; build ", FSDP_GOLDEN_BUILD, "\n");
}

const std::string kGolden = std::string(FSDP_SOURCE_DIR) + "/tests/fsdp/golden/bitwise.txt";

TEST(BitwiseGoldenTest, CpuResultsEqualTheRecordedOnes) {
  if (const char* path = std::getenv("FSDP_WRITE_GOLDEN"); path != nullptr && *path != '\0') {
    std::string now = Platform();
    for (const GoldenCase& c : Cases()) now += RunCase(c);
    std::ofstream(path) << now;
    GTEST_SKIP() << "skipped: wrote " << path << " (FSDP_WRITE_GOLDEN)";
  }
  std::ifstream in(kGolden);
  ASSERT_TRUE(in.good()) << kGolden << " is missing";
  std::stringstream golden;
  golden << in.rdbuf();
  const std::vector<std::string> want = absl::StrSplit(golden.str(), '\n');
  ASSERT_FALSE(want.empty());
  const std::string platform = Platform();
  if (want[0] + "\n" != platform) {
    GTEST_SKIP() << "skipped: " << kGolden << " was recorded on '" << want[0]
                 << "', and this run's kernels and build are '"
                 << platform.substr(0, platform.size() - 1) << "': their bits differ";
  }
  std::string now = platform;
  for (const GoldenCase& c : Cases()) now += RunCase(c);
  const std::vector<std::string> got = absl::StrSplit(now, '\n');
  ASSERT_EQ(got.size(), want.size()) << now;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << "line " << i + 1;
}

}  // namespace
}  // namespace fsdp::testing
