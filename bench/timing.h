// Timing helpers the benchmarks share: seconds between two steady_clock points, and the median
// of a series (the upper middle element for an even count; 0 for none).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace fsdp_bench {

using Clock = std::chrono::steady_clock;

inline double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

inline double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace fsdp_bench
