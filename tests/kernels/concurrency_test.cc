// Kernels called from several rank threads at once (as in-process worlds do) must give the
// results they give alone: no shared mutable state between callers.
#include <omp.h>

#include <thread>

#include "fsdp/cpu_backend.h"
#include "fsdp/kernels_cpu.h"
#include "tests/kernels/reference.h"

namespace fsdp::kernels::cpu {
namespace {

using namespace fsdp::kernels::cpu::testing;

// One rank's work: a linear layer and an attention layer, forward and backward.
struct Work {
  int64_t M, K, N;         // matmul
  int64_t B, T, C, NH;     // attention
  Vec inp, weight, bias, dmm;
  Vec qkv, datt_out;

  struct Result {
    Vec out, dinp, dweight, dbias, att_out, lse, dqkv;
  };

  Work(int64_t m, int64_t k, int64_t n, int64_t b, int64_t t, int64_t c, int64_t nh,
       unsigned seed)
      : M(m), K(k), N(n), B(b), T(t), C(c), NH(nh) {
    std::mt19937 rng(seed);
    inp = Random(M * K, rng);
    weight = Random(N * K, rng);
    bias = Random(N, rng);
    dmm = Random(M * N, rng);
    qkv = Random(B * T * 3 * C, rng);
    datt_out = Random(B * T * C, rng);
  }

  Result Run() const {
    Result r{Vec(M * N), Vec(M * K, 0.0f), Vec(N * K, 0.0f), Vec(N, 0.0f), Vec(B * T * C),
             Vec(B * NH * T), Vec(B * T * 3 * C, 0.0f)};
    matmul_forward(r.out.data(), inp.data(), weight.data(), bias.data(), M, K, N);
    matmul_backward(r.dinp.data(), r.dweight.data(), r.dbias.data(), dmm.data(), inp.data(),
                    weight.data(), M, K, N);
    attention_forward(r.att_out.data(), r.lse.data(), qkv.data(), B, T, C, NH);
    attention_backward(r.dqkv.data(), datt_out.data(), qkv.data(), r.att_out.data(), r.lse.data(),
                       B, T, C, NH);
    return r;
  }
};

void ExpectSame(const Work::Result& got, const Work::Result& want, int rank) {
  const std::string r = absl::StrCat(" rank ", rank);
  // The GEMMs get rounding-level slack: oneDNN's work split is its own business. Everything
  // else must be bit-identical (no shared state, no dependence on addresses).
  ExpectClose(got.out, want.out, 1e-5, 1e-5, absl::StrCat("matmul out", r));
  ExpectClose(got.dinp, want.dinp, 1e-5, 1e-5, absl::StrCat("dinp", r));
  ExpectClose(got.dweight, want.dweight, 1e-5, 1e-5, absl::StrCat("dweight", r));
  ExpectClose(got.dbias, want.dbias, 0.0, 0.0, absl::StrCat("dbias", r));
  ExpectClose(got.att_out, want.att_out, 0.0, 0.0, absl::StrCat("attention out", r));
  ExpectClose(got.lse, want.lse, 0.0, 0.0, absl::StrCat("lse", r));
  ExpectClose(got.dqkv, want.dqkv, 0.0, 0.0, absl::StrCat("dqkv", r));
}

TEST(Concurrency, FourRankThreadsMatchSingleThreadedResults) {
  const std::vector<Work> work = {
      Work(64, 48, 40, 2, 16, 32, 4, 1), Work(7, 13, 5, 1, 9, 12, 3, 2),
      Work(100, 96, 33, 3, 24, 48, 2, 3), Work(33, 64, 128, 2, 1, 8, 1, 4)};
  constexpr int kThreadsPerRank = 2;  // what CpuBackend::BindCurrentThread would set
  const int saved = omp_get_max_threads();
  omp_set_num_threads(kThreadsPerRank);
  std::vector<Work::Result> want;
  for (const Work& w : work) want.push_back(w.Run());
  omp_set_num_threads(saved);

  for (int round = 0; round < 3; ++round) {  // repeat so the calls overlap in different ways
    std::vector<Work::Result> got(work.size());
    std::vector<std::thread> ranks;
    for (size_t i = 0; i < work.size(); ++i) {
      ranks.emplace_back([&, i] {
        omp_set_num_threads(kThreadsPerRank);
        for (int rep = 0; rep < 3; ++rep) got[i] = work[i].Run();
      });
    }
    for (std::thread& t : ranks) t.join();
    for (size_t i = 0; i < work.size(); ++i) ExpectSame(got[i], want[i], static_cast<int>(i));
  }
}

TEST(Concurrency, SameShapeFromManyThreads) {
  // All ranks on one shape: the per-thread oneDNN plans must not be shared.
  const Work w(96, 64, 80, 2, 32, 32, 4, 7);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Work::Result want = w.Run();
  omp_set_num_threads(saved);
  std::vector<Work::Result> got(4);
  std::vector<std::thread> ranks;
  for (int i = 0; i < 4; ++i) {
    ranks.emplace_back([&, i] {
      omp_set_num_threads(1);
      got[i] = w.Run();
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int i = 0; i < 4; ++i) ExpectSame(got[i], want, i);
}

}  // namespace
}  // namespace fsdp::kernels::cpu
