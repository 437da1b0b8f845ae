// oneDNN plumbing behind internal::Gemm: per-thread engine, stream and a cache of matmul
// primitives keyed by shape, strides and OpenMP thread count.
#include "kernels/cpu/gemm.h"

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <unordered_map>

#include "dnnl.hpp"

namespace fsdp::kernels::cpu::internal {
namespace {

using dnnl::memory;

struct GemmKey {
  int64_t M, K, N, lda, ldb, ldc;
  bool a_trans, b_trans, bias, accumulate;
  int threads;  // oneDNN sizes its work split by the OpenMP thread count at creation
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    size_t h = 0;
    for (int64_t v : {k.M, k.K, k.N, k.lda, k.ldb, k.ldc,
                      int64_t{k.a_trans} | int64_t{k.b_trans} << 1 | int64_t{k.bias} << 2 |
                          int64_t{k.accumulate} << 3,
                      int64_t{k.threads}}) {
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return h;
  }
};

struct GemmPlan {
  dnnl::matmul prim;
  memory::desc a, b, c, bias;
};

// Kernels run concurrently on several rank threads (and on their OpenMP workers): each thread
// owns its engine, stream and plans, so there is no shared mutable state here (oneDNN's own
// primitive cache is thread safe).
struct ThreadContext {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<GemmKey, GemmPlan, GemmKeyHash> plans;
};

ThreadContext& Context() {
  thread_local ThreadContext ctx;
  return ctx;
}

// Row-major [rows, cols] with leading dimension ld, or its transpose.
memory::desc View(int64_t rows, int64_t cols, int64_t ld, bool transposed) {
  return memory::desc({rows, cols}, memory::data_type::f32,
                      transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

const GemmPlan& Plan(ThreadContext& ctx, const GemmKey& key) {
  auto it = ctx.plans.find(key);
  if (it != ctx.plans.end()) return it->second;
  // A model uses a few dozen shapes; the cap only matters for sweeps over many shapes.
  if (ctx.plans.size() >= 1024) ctx.plans.clear();
  GemmPlan plan;
  plan.a = View(key.M, key.K, key.lda, key.a_trans);
  plan.b = View(key.K, key.N, key.ldb, key.b_trans);
  plan.c = View(key.M, key.N, key.ldc, false);
  dnnl::primitive_attr attr;
  if (key.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  if (key.bias) {
    plan.bias = memory::desc({1, key.N}, memory::data_type::f32, memory::format_tag::ab);
    plan.prim = dnnl::matmul(dnnl::matmul::primitive_desc(
        dnnl::matmul::desc(plan.a, plan.b, plan.bias, plan.c), attr, ctx.engine));
  } else {
    plan.prim = dnnl::matmul(dnnl::matmul::primitive_desc(
        dnnl::matmul::desc(plan.a, plan.b, plan.c), attr, ctx.engine));
  }
  return ctx.plans.emplace(key, std::move(plan)).first->second;
}

}  // namespace

void Gemm(float* c, int64_t ldc, Operand a, Operand b, const float* bias, int64_t M, int64_t K,
          int64_t N, bool accumulate) {
  if (M == 0 || N == 0) return;
  if (K == 0) {  // empty product: oneDNN rejects zero-sized reductions
    if (accumulate) return;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = bias != nullptr ? bias[j] : 0.0f;
    }
    return;
  }
  try {
    ThreadContext& ctx = Context();
    const GemmKey key{M,           K,           N,       a.ld,       b.ld,
                      ldc,         a.transposed, b.transposed, bias != nullptr, accumulate,
                      omp_get_max_threads()};
    const GemmPlan& plan = Plan(ctx, key);
    std::unordered_map<int, memory> args = {
        {DNNL_ARG_SRC, memory(plan.a, ctx.engine, const_cast<float*>(a.data))},
        {DNNL_ARG_WEIGHTS, memory(plan.b, ctx.engine, const_cast<float*>(b.data))},
        {DNNL_ARG_DST, memory(plan.c, ctx.engine, c)}};
    if (bias != nullptr) {
      args.emplace(DNNL_ARG_BIAS, memory(plan.bias, ctx.engine, const_cast<float*>(bias)));
    }
    plan.prim.execute(ctx.stream, args);
    ctx.stream.wait();
  } catch (const dnnl::error& e) {
    // Only a bad shape or an out-of-memory gets here; the kernel API has no error channel.
    std::fprintf(stderr, "fsdp: oneDNN matmul M=%lld K=%lld N=%lld failed: %s\n",
                 static_cast<long long>(M), static_cast<long long>(K),
                 static_cast<long long>(N), e.what());
    std::abort();
  }
}

}  // namespace fsdp::kernels::cpu::internal
