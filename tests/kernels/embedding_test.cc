// Embedding lookup and scatter-add backward, with repeated indices.
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

struct Shape {
  int64_t N, C, rows;  // rows in the table
};

class EmbeddingTest : public ::testing::TestWithParam<Shape> {};

std::vector<int32_t> Indices(int64_t N, int64_t rows, std::mt19937& rng) {
  std::uniform_int_distribution<int32_t> dist(0, static_cast<int32_t>(rows - 1));
  std::vector<int32_t> idx(N);
  for (int32_t& i : idx) i = dist(rng);
  if (N >= 3) idx[1] = idx[2] = idx[0];  // make sure some index repeats
  return idx;
}

DVec EmbeddingRef(const DVec& table, const std::vector<int32_t>& idx, int64_t C) {
  DVec out(idx.size() * C);
  for (size_t n = 0; n < idx.size(); ++n) {
    for (int64_t c = 0; c < C; ++c) out[n * C + c] = table[idx[n] * C + c];
  }
  return out;
}

TEST_P(EmbeddingTest, ForwardCopiesRows) {
  const auto [N, C, rows] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N * 3 + C));
  const Vec table = Random(rows * C, rng);
  const std::vector<int32_t> idx = Indices(N, rows, rng);
  Vec out(N * C);
  embedding_forward(out.data(), idx.data(), table.data(), N, C);
  ExpectClose(out, EmbeddingRef(ToDouble(table), idx, C), 0.0, 0.0, "out");
}

TEST_P(EmbeddingTest, BackwardMatchesFiniteDifferences) {
  const auto [N, C, rows] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(N + C * 5));
  const Vec table = Random(rows * C, rng), dout = Random(N * C, rng);
  const std::vector<int32_t> idx = Indices(N, rows, rng);
  DVec want;
  if (rows * C <= 4000) {
    want = NumericGrad([&](const DVec& t) { return Dot(EmbeddingRef(t, idx, C), dout); },
                       ToDouble(table));
  } else {  // the gradient by definition: sum of dout rows per index
    want.assign(rows * C, 0.0);
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t c = 0; c < C; ++c) want[idx[n] * C + c] += dout[n * C + c];
    }
  }
  const Vec d0 = Random(rows * C, rng);
  Vec dtable = d0;
  embedding_backward(dtable.data(), dout.data(), idx.data(), N, C);
  ExpectAccumulatedClose(dtable, d0, want, 1e-5, 1e-5, "dtable");
}

INSTANTIATE_TEST_SUITE_P(Shapes, EmbeddingTest,
                         ::testing::Values(Shape{1, 1, 1}, Shape{5, 3, 4}, Shape{7, 13, 5},
                                           Shape{16, 65, 9}, Shape{300, 130, 40},
                                           Shape{1000, 96, 256}),
                         [](const auto& info) {
                           return absl::StrCat("N", info.param.N, "C", info.param.C, "R", info.param.rows);
                         });

}  // namespace
}  // namespace fsdp::kernels::cpu
