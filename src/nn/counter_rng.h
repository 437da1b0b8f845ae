// Counter-based random numbers: a value is a pure function of its key and index, so any slice
// of a random stream (a shard of a tensor, a rank's rows of a batch) can be drawn alone.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>
#include <string_view>

namespace fsdp::nn::internal {

// splitmix64's output function: a bijective mix of 64 bits.
inline uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Stable across platforms and runs, unlike std::hash.
inline uint64_t Fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Random 64 bits number `index` of the stream `key`.
inline uint64_t RandomAt(uint64_t key, uint64_t index) {
  return SplitMix64(key ^ SplitMix64(index));
}

// Standard normal number j of the stream `key`: Box-Muller on two independent uniforms.
inline double NormalAt(uint64_t key, int64_t j) {
  const uint64_t a = RandomAt(key, 2 * static_cast<uint64_t>(j));
  const uint64_t b = RandomAt(key, 2 * static_cast<uint64_t>(j) + 1);
  const double u1 = (static_cast<double>(a >> 11) + 1.0) * 0x1.0p-53;  // (0, 1]: log is finite
  const double u2 = static_cast<double>(b >> 11) * 0x1.0p-53;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * std::numbers::pi * u2);
}

}  // namespace fsdp::nn::internal
