// Runs the fsdp_bench binary (FSDP_BENCH_BINARY, set by tests/bench/CMakeLists.txt) with
// arguments and collects its exit code and output, for the tests of its command line. Without
// the benchmarks (FSDP_BUILD_BENCH=OFF) there is no binary and nothing here is defined.
#pragma once

#ifdef FSDP_BENCH_BINARY

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <string>

#include "gtest/gtest.h"

namespace fsdp::testing {

struct Ran {
  int rc = -1;
  std::string output;  // stdout and stderr
};

inline Ran RunCli(const std::string& args) {
  const std::string cmd = std::string(FSDP_BENCH_BINARY) + " " + args + " 2>&1";
  Ran r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// fsdp_bench refuses `args` as bad usage: exit code 2 and one line starting "fsdp_bench: ".
inline void ExpectUsageError(const std::string& args) {
  const Ran r = RunCli(args);
  EXPECT_EQ(r.rc, 2) << args << "\n" << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << args << "\n" << r.output;
  EXPECT_EQ(r.output.rfind("fsdp_bench: ", 0), 0u) << r.output;
}

}  // namespace fsdp::testing

#endif  // FSDP_BENCH_BINARY
