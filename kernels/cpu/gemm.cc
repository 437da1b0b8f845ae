// oneDNN plumbing behind internal::Gemm: per-thread engine, stream and a cache of matmul
// primitives keyed by shape, strides, operand types and OpenMP thread count.
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
  DType a_type, b_type;
  int threads;  // oneDNN sizes its work split by the OpenMP thread count at creation
  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    size_t h = 0;
    for (int64_t v : {k.M, k.K, k.N, k.lda, k.ldb, k.ldc,
                      int64_t{k.a_trans} | int64_t{k.b_trans} << 1 | int64_t{k.bias} << 2 |
                          int64_t{k.accumulate} << 3 | int64_t(k.a_type) << 4 |
                          int64_t(k.b_type) << 6,
                      int64_t{k.threads}}) {
      h ^= std::hash<int64_t>()(v) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    }
    return h;
  }
};

struct GemmPlan {
  bool supported = true;  // false: oneDNN has no matmul for these types (TryGemm says so)
  dnnl::matmul prim;
  memory::desc a, b, c, bias;
  // The execution arguments, made once: a call only points them at its data
  // (set_data_handle), so a small GEMM pays no allocation per call.
  std::unordered_map<int, memory> args;
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

memory::data_type DnnlType(DType t) {
  switch (t) {
    case DType::kBF16: return memory::data_type::bf16;
    case DType::kF16: return memory::data_type::f16;
    default: break;  // f32 (the matmuls take f32, bf16 and f16 only)
  }
  return memory::data_type::f32;
}

// Row-major [rows, cols] with leading dimension ld, or its transpose.
memory::desc View(int64_t rows, int64_t cols, int64_t ld, bool transposed, DType type) {
  return memory::desc({rows, cols}, DnnlType(type),
                      transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

GemmPlan& Plan(ThreadContext& ctx, const GemmKey& key) {
  auto it = ctx.plans.find(key);
  if (it != ctx.plans.end()) return it->second;
  // A model uses a few dozen shapes; the cap only matters for sweeps over many shapes.
  if (ctx.plans.size() >= 1024) ctx.plans.clear();
  GemmPlan plan;
  plan.a = View(key.M, key.K, key.lda, key.a_trans, key.a_type);
  plan.b = View(key.K, key.N, key.ldb, key.b_trans, key.b_type);
  plan.c = View(key.M, key.N, key.ldc, false, DType::kF32);
  dnnl::primitive_attr attr;
  if (key.accumulate) {
    dnnl::post_ops ops;
    ops.append_sum(1.0f);
    attr.set_post_ops(ops);
  }
  try {
    if (key.bias) {
      plan.bias = memory::desc({1, key.N}, memory::data_type::f32, memory::format_tag::ab);
      plan.prim = dnnl::matmul(dnnl::matmul::primitive_desc(
          dnnl::matmul::desc(plan.a, plan.b, plan.bias, plan.c), attr, ctx.engine));
    } else {
      plan.prim = dnnl::matmul(dnnl::matmul::primitive_desc(
          dnnl::matmul::desc(plan.a, plan.b, plan.c), attr, ctx.engine));
    }
  } catch (const dnnl::error&) {
    // f32 is always implemented: only a 16-bit type this CPU (or this oneDNN) lacks gets here.
    if (key.a_type == DType::kF32 && key.b_type == DType::kF32) throw;
    plan.supported = false;
  }
  if (plan.supported) {
    plan.args = {{DNNL_ARG_SRC, memory(plan.a, ctx.engine, nullptr)},
                 {DNNL_ARG_WEIGHTS, memory(plan.b, ctx.engine, nullptr)},
                 {DNNL_ARG_DST, memory(plan.c, ctx.engine, nullptr)}};
    if (key.bias) plan.args.emplace(DNNL_ARG_BIAS, memory(plan.bias, ctx.engine, nullptr));
  }
  return ctx.plans.emplace(key, std::move(plan)).first->second;
}

}  // namespace

bool TryGemm(float* c, int64_t ldc, Operand a, Operand b, const float* bias, int64_t M,
             int64_t K, int64_t N, bool accumulate) {
  if (M == 0 || N == 0) return true;
  if (K == 0) {  // empty product: oneDNN rejects zero-sized reductions
    if (accumulate) return true;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) c[i * ldc + j] = bias != nullptr ? bias[j] : 0.0f;
    }
    return true;
  }
  try {
    ThreadContext& ctx = Context();
    const GemmKey key{M, K, N, a.ld, b.ld, ldc, a.transposed, b.transposed, bias != nullptr,
                      accumulate, a.dtype, b.dtype, omp_get_max_threads()};
    GemmPlan& plan = Plan(ctx, key);
    if (!plan.supported) return false;
    plan.args.at(DNNL_ARG_SRC).set_data_handle(const_cast<void*>(a.data));
    plan.args.at(DNNL_ARG_WEIGHTS).set_data_handle(const_cast<void*>(b.data));
    plan.args.at(DNNL_ARG_DST).set_data_handle(c);
    if (bias != nullptr) plan.args.at(DNNL_ARG_BIAS).set_data_handle(const_cast<float*>(bias));
    plan.prim.execute(ctx.stream, plan.args);
    ctx.stream.wait();
  } catch (const dnnl::error& e) {
    // Only a bad shape or an out-of-memory gets here; the kernel API has no error channel.
    std::fprintf(stderr, "fsdp: oneDNN matmul M=%lld K=%lld N=%lld (%s x %s) failed: %s\n",
                 static_cast<long long>(M), static_cast<long long>(K),
                 static_cast<long long>(N), DTypeName(a.dtype).data(),
                 DTypeName(b.dtype).data(), e.what());
    std::abort();
  }
  return true;
}

void Gemm(float* c, int64_t ldc, Operand a, Operand b, const float* bias, int64_t M, int64_t K,
          int64_t N, bool accumulate) {
  if (!TryGemm(c, ldc, a, b, bias, M, K, N, accumulate)) {
    std::fprintf(stderr, "fsdp: oneDNN has no %s x %s matmul on this CPU\n",
                 DTypeName(a.dtype).data(), DTypeName(b.dtype).data());
    std::abort();
  }
}

}  // namespace fsdp::kernels::cpu::internal
