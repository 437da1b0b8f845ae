// Integer arithmetic that says when it overflows, for sizes that come from users (B x T x C
// products, byte totals, hosts x ranks per host): a figure too large for int64 is reported as
// such, never wrapped into a small or negative one.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace fsdp::internal {

// *out = a * b; false when the exact product does not fit in int64 (*out is then unspecified).
inline bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

// *out = a + b; false when the exact sum does not fit in int64 (*out is then unspecified).
inline bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

// *out = the product of `factors`, left to right; false when a partial product does not fit.
inline bool CheckedProduct(std::initializer_list<int64_t> factors, int64_t* out) {
  int64_t p = 1;
  for (int64_t f : factors) {
    if (!CheckedMul(p, f, &p)) return false;
  }
  *out = p;
  return true;
}

}  // namespace fsdp::internal
