// The memory loops of the collectives against a scalar reference built on dtype.h's
// converters: random (not exactly representable) values, odd lengths, misaligned buffers and
// sizes that take the streaming-store path.
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collectives/reduce.h"
#include "gtest/gtest.h"

namespace fsdp::coll {
namespace {

uint32_t Encode(DType t, float v) {
  switch (t) {
    case DType::kF32: return std::bit_cast<uint32_t>(v);
    case DType::kBF16: return FloatToBf16(v);
    case DType::kF16: return FloatToF16(v);
    default: return 0;
  }
}
float Decode(DType t, uint32_t b) {
  switch (t) {
    case DType::kF32: return std::bit_cast<float>(b);
    case DType::kBF16: return Bf16ToFloat(static_cast<uint16_t>(b));
    case DType::kF16: return F16ToFloat(static_cast<uint16_t>(b));
    default: return 0;
  }
}

struct Param {
  DType dtype;
  ReduceOp op;
  int nsrc;
  int64_t count;
  int misalign;  // elements
};

class ReduceBuffersTest : public ::testing::TestWithParam<Param> {};

TEST_P(ReduceBuffersTest, MatchesScalarReference) {
  const auto [t, op, nsrc, count, misalign] = GetParam();
  const size_t e = DTypeSize(t);
  std::mt19937 rng(count * 31 + nsrc);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<std::vector<char>> srcs(nsrc, std::vector<char>((count + misalign) * e));
  std::vector<const void*> ptrs(nsrc);
  for (int q = 0; q < nsrc; ++q) {
    for (int64_t i = 0; i < count; ++i) {
      float v = dist(rng);
      if (i % 997 == 5) v = std::numeric_limits<float>::infinity() * (q % 2 ? -1.f : 1.f);
      if (i % 1009 == 7) v = 1e-6f * v;  // f16 subnormals
      const uint32_t b = Encode(t, v);
      std::memcpy(srcs[q].data() + (misalign + i) * e, &b, e);
    }
    ptrs[q] = srcs[q].data() + misalign * e;
  }
  std::vector<char> dst((count + misalign) * e);
  ReduceBuffers(t, op, ptrs.data(), nsrc, dst.data() + misalign * e, count, nsrc);
  int64_t wrong = 0;
  for (int64_t i = 0; i < count; ++i) {
    auto load = [&](int q) {
      uint32_t b = 0;
      std::memcpy(&b, static_cast<const char*>(ptrs[q]) + i * e, e);
      return Decode(t, b);
    };
    float acc = load(0);
    for (int q = 1; q < nsrc; ++q) {
      const float v = load(q);
      acc = op == ReduceOp::kMax ? (v > acc ? v : acc) : acc + v;
    }
    if (op == ReduceOp::kAvg) acc = acc / static_cast<float>(nsrc);
    uint32_t got = 0;
    std::memcpy(&got, dst.data() + (misalign + i) * e, e);
    const uint32_t want = Encode(t, acc);
    const bool both_nan = std::isnan(acc) && std::isnan(Decode(t, got));
    if (got != want && !both_nan && wrong++ < 5) {
      ADD_FAILURE() << "element " << i << ": got 0x" << std::hex << got << " want 0x" << want;
    }
  }
  EXPECT_EQ(wrong, 0);
}

std::vector<Param> Params() {
  std::vector<Param> p;
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
      for (int nsrc : {1, 2, 3, 8}) {
        for (int64_t count : {int64_t{1}, int64_t{13}, int64_t{2048 * 3 + 5}, int64_t{(1 << 20) + 37}}) {
          if (count > 10000 && nsrc != 1 && nsrc != 3) continue;  // keep the suite quick
          p.push_back({t, op, nsrc, count, static_cast<int>(count % 3)});
        }
      }
    }
  }
  return p;
}

INSTANTIATE_TEST_SUITE_P(All, ReduceBuffersTest, ::testing::ValuesIn(Params()),
                         [](const auto& info) {
                           const Param& p = info.param;
                           return std::string(DTypeName(p.dtype)) + "_" + std::string(ReduceOpName(p.op)) +
                                  "_n" + std::to_string(p.nsrc) + "_" + std::to_string(p.count);
                         });

TEST(CopyBytes, LargeAndMisaligned) {
  for (size_t bytes : {size_t{1}, size_t{100}, kStreamBytes - 1, kStreamBytes + 77, size_t{5} << 20}) {
    std::vector<char> src(bytes + 7), dst(bytes + 7, 0);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<char>(i * 7 + 3);
    CopyBytes(dst.data() + 3, src.data() + 5, bytes);
    EXPECT_EQ(std::memcmp(dst.data() + 3, src.data() + 5, bytes), 0) << bytes;
    EXPECT_EQ(dst[bytes + 3], 0);
  }
}

TEST(WidenNarrow, RoundTripAndDivide) {
  std::vector<float> x(1003), wide(1003);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) * 0.37f - 100.0f;
  for (DType t : {DType::kBF16, DType::kF16}) {
    std::vector<uint16_t> h(x.size()), back(x.size());
    NarrowFromF32(t, x.data(), h.data(), static_cast<int64_t>(x.size()), 1);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(h[i], Encode(t, x[i])) << i;
    WidenToF32(t, h.data(), wide.data(), static_cast<int64_t>(x.size()));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(wide[i], Decode(t, h[i])) << i;
    NarrowFromF32(t, x.data(), back.data(), static_cast<int64_t>(x.size()), 3);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(back[i], Encode(t, x[i] / 3.0f)) << i;
  }
}

}  // namespace
}  // namespace fsdp::coll
