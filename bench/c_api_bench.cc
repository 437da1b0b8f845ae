// The C API's overhead: the same training step through libfsdp.so's C API (include/fsdp/c_api.h)
// and through the C++ API, on the same two rank threads, alternating step by step so that the
// machine's noise falls on both alike:
//   (a) the bundled GPT "nano" (FULL_SHARD, 2 ranks, B = 8, T = 64): fsdp_model_forward_backward
//       + fsdp_model_step against ShardedModel::ForwardBackward + Step;
//   (b) the two-layer perceptron of tests/capi/mlp.h driven through the hooks (10 hook calls and
//       a step per micro-batch, with almost no compute): what each call through the C boundary
//       costs a framework that runs its own autograd.
// Prints the median step times, their ratio, and (b)'s cost per hook call.
//
//   c_api_bench [--steps N] [--check] [--only c|cpp]
//
// --check: exit 1 unless (a)'s C / C++ ratio is within 1.02. --only: (a) through one API alone
// (the other library copy idle), for comparing processes run one after another: with both
// running, each step also pays for the other copy of the library's code in the caches.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fsdp/c_api.h"
#include "fsdp/local_world.h"
#include "fsdp/nn/model_config.h"
#include "fsdp/nn/sharded_model.h"
#include "fsdp/registry.h"
#include "tests/capi/mlp.h"
#include "tests/capi/mlp_cpp.h"
#include "bench/timing.h"

namespace {

using fsdp_bench::Clock;
using fsdp_bench::Median;
using fsdp_bench::Seconds;

#define C_OK(call)                                                                       \
  do {                                                                                   \
    fsdp_error* e_ = (call);                                                             \
    if (e_ != nullptr) {                                                                 \
      absl::Status s_(static_cast<absl::StatusCode>(fsdp_error_code(e_)),                \
                      std::string(#call) + ": " + fsdp_error_message(e_));               \
      fsdp_error_destroy(e_);                                                            \
      return s_;                                                                         \
    }                                                                                    \
  } while (0)

struct Times {
  std::vector<double> cpp, c;
};

constexpr int kRanks = 2;
constexpr int kBatch = 8, kSeq = 64;

// (a): both models on rank `rank`'s thread; rank 0 records the step times.
// `only`: 0 both, 'c' or 'p' (C++) alone.
absl::Status NanoRank(fsdp::Communicator& comm, fsdp_world* cworld, int steps, char only,
                      Times& t) {
  const int rank = comm.rank();
  FSDP_ASSIGN_OR_RETURN(fsdp::nn::ModelConfig config, fsdp::nn::ModelConfig::FromName("nano"));
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Backend> backend,
                        fsdp::CreateBackend("cpu", {}, rank));
  fsdp::nn::ShardedModelOptions o;
  o.batch_size = kBatch;
  o.seq_len = kSeq;
  o.sharding.max_grad_norm = 1.0f;
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::nn::ShardedModel> model,
                        fsdp::nn::ShardedModel::Create(config, backend.get(), comm, o));
  fsdp_backend* cbackend = nullptr;
  C_OK(fsdp_backend_create("cpu", nullptr, 0, rank, &cbackend));
  std::unique_ptr<fsdp_backend, void (*)(fsdp_backend*)> backend_guard(cbackend,
                                                                      fsdp_backend_destroy);
  fsdp_sharding_options so;
  fsdp_sharding_options_init(&so);
  so.max_grad_norm = 1.0f;
  fsdp_model_options mo;
  fsdp_model_options_init(&mo);
  mo.config = "nano";
  mo.batch_size = kBatch;
  mo.seq_len = kSeq;
  fsdp_model* cmodel = nullptr;
  C_OK(fsdp_model_create(cbackend, cworld, &so, &mo, &cmodel));
  std::unique_ptr<fsdp_model, void (*)(fsdp_model*)> model_guard(cmodel, fsdp_model_destroy);
  std::vector<int32_t> in(kBatch * kSeq), tg(kBatch * kSeq);
  for (int step = 0; step <= steps; ++step) {
    for (size_t i = 0; i < in.size(); ++i) {
      in[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(step) * 13 + rank) % 256);
      tg[i] = static_cast<int32_t>((i * 7 + static_cast<size_t>(step) * 13 + rank + 1) % 256);
    }
    // Which API goes first alternates from step to step.
    double cpp_s = 0, c_s = 0;
    for (int k = 0; k < 2; ++k) {
      const auto t0 = Clock::now();
      const bool cpp = (k + step) % 2 == 0;
      if (only != 0 && only != (cpp ? 'p' : 'c')) continue;
      if (cpp) {
        FSDP_RETURN_IF_ERROR(model->ForwardBackward(in.data(), tg.data()).status());
        FSDP_RETURN_IF_ERROR(model->Step(1e-3f).status());
        cpp_s = Seconds(t0, Clock::now());
      } else {
        C_OK(fsdp_model_forward_backward(cmodel, in.data(), tg.data(),
                                         static_cast<int64_t>(in.size()), nullptr));
        C_OK(fsdp_model_step(cmodel, 1e-3f, nullptr));
        c_s = Seconds(t0, Clock::now());
      }
    }
    if (rank == 0 && step > 0) {  // step 0 records the prefetch order
      if (only != 'c') t.cpp.push_back(cpp_s);
      if (only != 'p') t.c.push_back(c_s);
    }
  }
  return absl::OkStatus();
}

// (b): the perceptron through the hooks, C++ then C, alternating.
constexpr int kHookCalls = 10;  // per micro-batch: 2 x (pre/post forward, pre/post backward),
                                // finish_backward, set_sync_gradients

absl::Status MlpRank(fsdp::Communicator& comm, fsdp_world* cworld, int steps, Times& t) {
  const int rank = comm.rank();
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::Backend> backend,
                        fsdp::CreateBackend("cpu", {}, rank));
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<fsdp::ShardingRuntime> rt,
                        fsdp::ShardingRuntime::Create(backend.get(), comm, {}));
  fsdp_backend* cbackend = nullptr;
  C_OK(fsdp_backend_create("cpu", nullptr, 0, rank, &cbackend));
  std::unique_ptr<fsdp_backend, void (*)(fsdp_backend*)> backend_guard(cbackend,
                                                                      fsdp_backend_destroy);
  fsdp_runtime* crt = nullptr;
  C_OK(fsdp_runtime_create(cbackend, cworld, nullptr, &crt));
  std::unique_ptr<fsdp_runtime, void (*)(fsdp_runtime*)> rt_guard(crt, fsdp_runtime_destroy);
  FSDP_RETURN_IF_ERROR(fsdp_capi_test::RegisterMlp(*rt));
  const char* names[2][2] = {{"w1", "b1"}, {"w2", "b2"}};
  for (int u = 0; u < 2; ++u) {
    fsdp_param cparams[2];
    int64_t shapes[2][2];
    for (int p = 0; p < 2; ++p) {
      mlp_param_shape(u, p, shapes[p]);
      fsdp_param_init(&cparams[p]);
      cparams[p].name = names[u][p];
      cparams[p].shape = shapes[p];
      cparams[p].ndim = mlp_param_ndim(u, p);
    }
    C_OK(fsdp_runtime_register_unit(crt, u == 0 ? "layer1" : "layer2", cparams, 2, nullptr));
  }
  C_OK(fsdp_runtime_finalize(
      crt,
      [](void*, int u, int p, int64_t b, int64_t e, float* out) -> fsdp_error* {
        for (int64_t i = b; i < e; ++i) out[i - b] = mlp_init(u, p, i);
        return nullptr;
      },
      nullptr));
  const int64_t b1 = rt->unit_tensors(0)[1].offset, b2 = rt->unit_tensors(1)[1].offset;
  mlp_acts a;
  auto cpp_step = [&](int step) -> absl::Status {
    for (int m = 0; m < MLP_MICRO_BATCHES; ++m) {
      FSDP_RETURN_IF_ERROR(fsdp_capi_test::MlpMicroBatch(*rt, a, rank, step, m).status());
    }
    return rt->Step(MLP_LR).status();
  };
  auto c_step = [&](int step) -> absl::Status {
    for (int m = 0; m < MLP_MICRO_BATCHES; ++m) {
      fsdp_unit_view v0, v1;
      v0.struct_size = sizeof v0;
      v1.struct_size = sizeof v1;
      mlp_batch(rank, step, m, a.x, a.t);
      C_OK(fsdp_set_sync_gradients(crt, m == MLP_MICRO_BATCHES - 1));
      C_OK(fsdp_pre_forward(crt, 0, &v0));
      const float* p0 = static_cast<const float*>(v0.params.host);
      mlp_forward1(&a, p0, p0 + b1);
      C_OK(fsdp_post_forward(crt, 0));
      C_OK(fsdp_pre_forward(crt, 1, &v1));
      const float* p1 = static_cast<const float*>(v1.params.host);
      mlp_forward2(&a, p1, p1 + b2);
      C_OK(fsdp_post_forward(crt, 1));
      C_OK(fsdp_pre_backward(crt, 1, &v1));
      p1 = static_cast<const float*>(v1.params.host);
      float* g1 = static_cast<float*>(v1.grads.host);
      mlp_backward2(&a, p1, g1, g1 + b2);
      C_OK(fsdp_post_backward(crt, 1));
      C_OK(fsdp_pre_backward(crt, 0, &v0));
      float* g0 = static_cast<float*>(v0.grads.host);
      mlp_backward1(&a, g0, g0 + b1);
      C_OK(fsdp_post_backward(crt, 0));
      C_OK(fsdp_finish_backward(crt));
    }
    C_OK(fsdp_step(crt, MLP_LR, nullptr));
    return absl::OkStatus();
  };
  for (int step = 0; step <= steps; ++step) {
    double cpp_s = 0, c_s = 0;
    for (int k = 0; k < 2; ++k) {  // which API goes first alternates
      const auto t0 = Clock::now();
      if ((k + step) % 2 == 0) {
        FSDP_RETURN_IF_ERROR(cpp_step(step));
        cpp_s = Seconds(t0, Clock::now());
      } else {
        FSDP_RETURN_IF_ERROR(c_step(step));
        c_s = Seconds(t0, Clock::now());
      }
    }
    if (rank == 0 && step > 0) {
      t.cpp.push_back(cpp_s);
      t.c.push_back(c_s);
    }
  }
  return absl::OkStatus();
}

// Runs `body` on kRanks threads, each with its rank's C++ communicator and C world.
template <typename Body>
absl::Status RunBoth(Body body) {
  fsdp_thread_group* group = nullptr;
  C_OK(fsdp_thread_group_create(kRanks, nullptr, &group));
  std::unique_ptr<fsdp_thread_group, void (*)(fsdp_thread_group*)> guard(
      group, fsdp_thread_group_destroy);
  return fsdp::LocalWorld::Run(kRanks, {}, [&](fsdp::Communicator& comm) -> absl::Status {
    fsdp_world* world = nullptr;
    C_OK(fsdp_thread_group_take_rank(group, comm.rank(), &world));
    std::unique_ptr<fsdp_world, void (*)(fsdp_world*)> world_guard(world, fsdp_world_destroy);
    return body(comm, world);
  });
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 100;
  bool check = false;
  char only = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--check") == 0) {
      check = true;
    } else if (std::strcmp(argv[i], "--only") == 0 && i + 1 < argc &&
               (std::strcmp(argv[i + 1], "c") == 0 || std::strcmp(argv[i + 1], "cpp") == 0)) {
      only = argv[++i][1] == 'p' ? 'p' : 'c';
    } else {
      std::fprintf(stderr, "usage: %s [--steps N >= 1] [--check] [--only c|cpp]\n", argv[0]);
      return 2;
    }
  }
  if (steps < 1) {
    std::fprintf(stderr, "c_api_bench: --steps must be >= 1\n");
    return 2;
  }
  std::printf("c_api_bench: %s; %d ranks as threads, cpu backend, %d steps (medians)\n",
              fsdp_version_string(), kRanks, steps);
  Times nano, mlp;
  absl::Status s = RunBoth([&](fsdp::Communicator& comm, fsdp_world* w) {
    return NanoRank(comm, w, steps, only, nano);
  });
  if (s.ok() && only != 0) {
    const std::vector<double>& v = only == 'c' ? nano.c : nano.cpp;
    std::printf("(a) nano step, FULL_SHARD, B=%d T=%d, the %s API alone: %8.3f ms\n", kBatch,
                kSeq, only == 'c' ? "C" : "C++", 1e3 * Median(v));
    return 0;
  }
  if (s.ok()) {
    s = RunBoth([&](fsdp::Communicator& comm, fsdp_world* w) {
      return MlpRank(comm, w, steps * 10, mlp);
    });
  }
  if (!s.ok()) {
    std::fprintf(stderr, "c_api_bench: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  const double nano_cpp = Median(nano.cpp), nano_c = Median(nano.c);
  const double mlp_cpp = Median(mlp.cpp), mlp_c = Median(mlp.c);
  // The median of the step-by-step ratios (each C step against the C++ step beside it): the
  // machine's drift cancels within a pair.
  std::vector<double> pairs;
  for (size_t i = 0; i < nano.c.size(); ++i) pairs.push_back(nano.c[i] / nano.cpp[i]);
  const double ratio = Median(pairs);
  const int calls = MLP_MICRO_BATCHES * kHookCalls + 1;
  std::printf("(a) nano step, FULL_SHARD, B=%d T=%d:  C++ API %8.3f ms   C API %8.3f ms   "
              "C / C++ %.4f (median of the paired steps' ratios)\n",
              kBatch, kSeq, 1e3 * nano_cpp, 1e3 * nano_c, ratio);
  std::printf("(b) two-layer perceptron through the hooks (%d calls per step):  C++ API %7.2f us"
              "   C API %7.2f us   C / C++ %.3f;  %+.3f us per call\n",
              calls, 1e6 * mlp_cpp, 1e6 * mlp_c, mlp_c / mlp_cpp,
              1e6 * (mlp_c - mlp_cpp) / calls);
  if (check && ratio > 1.02) {
    std::printf("c_api_bench: FAILED: the nano step through the C API is %.2f%% slower (limit 2%%)\n",
                100 * (ratio - 1));
    return 1;
  }
  return 0;
}
