// Shared by uneven_units_test (ranks as threads) and uneven_units_mpi_test (mpirun): a model
// written the way a framework writes its own layers, driven through the sharding runtime's
// per-unit hooks (as examples/custom_layers.cc does), whose units are uneven or degenerate:
// Linear layers whose sizes do not divide the shard group (FSDP2's awkward (16,15)/(15,8),
// (7,15)/(15,3), (16,17)/(17,8) MLPs), a unit of 1 element, a unit of 3 elements (on 8
// ranks, 5 shards hold only padding), a unit whose every parameter is frozen, a unit holding
// only biases. Its forward and backward are plain loops over host memory (UnitView on the CPU
// backend); the runtime only gathers, reduces and updates.
//
// The reference trains the same model on one rank, on the concatenated global batch, with
// whole tensors in plain host buffers, the library's AdamW per unit (padding-free ranges) and
// global-norm clipping: nothing of the sharding runtime.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/checkpoint.h"
#include "fsdp/communicator.h"
#include "fsdp/cpu_backend.h"
#include "fsdp/optim.h"
#include "fsdp/sharding.h"
#include "tests/checkpoint/safetensors_ref_reader.h"
#include "tests/fsdp/parity_util.h"

namespace fsdp::testing::uneven {

// ---- the model ---------------------------------------------------------------------------------

enum class OpKind {
  kLinear,      // y = W x (+ b): W [out, in], b [out]
  kAddBias,     // y = x + b
  kTanh,        // y = tanh(x)
  kGain,        // y = g x, g [1]
  kScaleShift,  // y_j = a x_j + c[j % 2], a [1], c [2]
};

struct Op {
  OpKind kind;
  int w = -1, b = -1;  // indices into the stage's parameters (-1: none)
  int in = 0, out = 0;
};

// One unit and the ops that use it, run between its PreForward and PostForward.
struct Stage {
  std::string unit;
  std::vector<ParamInfo> params;
  std::vector<Op> ops;
};

struct Model {
  std::string name;
  int in = 0, out = 0;
  std::vector<Stage> stages;
};

inline Op Linear(int w, int b, int in, int out) { return {OpKind::kLinear, w, b, in, out}; }
inline Op AddBias(int b, int d) { return {OpKind::kAddBias, -1, b, d, d}; }
inline Op Tanh(int d) { return {OpKind::kTanh, -1, -1, d, d}; }

// Linear(in, hid) + bias, tanh, Linear(hid, out) + bias; one unit per Linear.
inline Model Mlp(int in, int hid, int out) {
  Model m;
  m.name = absl::StrCat("mlp_", in, "_", hid, "_", out);
  m.in = in;
  m.out = out;
  m.stages.push_back({"fc1",
                      {{"fc1.weight", {hid, in}}, {"fc1.bias", {hid}}},
                      {Linear(0, 1, in, hid), Tanh(hid)}});
  m.stages.push_back({"fc2",
                      {{"fc2.weight", {out, hid}}, {"fc2.bias", {out}}},
                      {Linear(0, 1, hid, out)}});
  return m;
}

// Every degenerate unit in one model: fc1's weight alone; a unit of biases only (fc1's bias
// and a shift after the activation); a gain of 1 element; a scale-and-shift of 3 elements; a
// Linear whose weight and bias are both frozen; fc2.
inline Model Degenerate(int in, int hid, int out) {
  Model m;
  m.name = absl::StrCat("degenerate_", in, "_", hid, "_", out);
  m.in = in;
  m.out = out;
  m.stages.push_back({"fc1", {{"fc1.weight", {hid, in}}}, {Linear(0, -1, in, hid)}});
  m.stages.push_back({"biases",
                      {{"fc1.bias", {hid}}, {"act.shift", {hid}}},
                      {AddBias(0, hid), Tanh(hid), AddBias(1, hid)}});
  m.stages.push_back({"gain", {{"gain", {1}}}, {{OpKind::kGain, 0, -1, hid, hid}}});
  m.stages.push_back({"scale_shift",
                      {{"scale_shift.a", {1}}, {"scale_shift.c", {2}}},
                      {{OpKind::kScaleShift, 0, 1, hid, hid}}});
  m.stages.push_back({"frozen",
                      {{"frozen.weight", {hid, hid}, false}, {"frozen.bias", {hid}, false}},
                      {Linear(0, 1, hid, hid), Tanh(hid)}});
  m.stages.push_back({"fc2",
                      {{"fc2.weight", {out, hid}}, {"fc2.bias", {out}}},
                      {Linear(0, 1, hid, out)}});
  return m;
}

inline int64_t Numel(const ParamInfo& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}
inline int64_t StageNumel(const Stage& s) {
  int64_t n = 0;
  for (const ParamInfo& p : s.params) n += Numel(p);
  return n;
}

// A uniform value in [-1, 1) from a tuple of indices (splitmix64 of their mix).
inline float Uniform(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xBF58476D1CE4E5B9ull ^
               (c + 0x85157AF5ull) * 0x94D049BB133111EBull ^ (d + 0x1B873593ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

inline uint64_t NameHash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
  return h;
}

// Initial value of element `i` of parameter `p`: a function of the name and index only, so
// every world size and strategy starts from the same model.
inline float InitValue(const ParamInfo& p, int64_t i) {
  const float u = Uniform(NameHash(p.name), 1, static_cast<uint64_t>(i), 0);
  if (p.name == "gain") return 1.0f + 0.1f * u;
  if (p.name == "scale_shift.a") return 0.9f + 0.1f * u;
  if (p.shape.size() == 1) return 0.1f * u;  // biases, shifts
  return u / std::sqrt(static_cast<float>(p.shape[1]));
}

// ---- forward and backward of the ops, over B samples (row-major B x dim) -----------------------

// Where a stage's tensors are: parameters (read) and gradients (accumulated into, +=).
struct StagePtrs {
  std::vector<const float*> p;
  std::vector<float*> g;
};

inline void OpForward(const Op& op, const StagePtrs& t, const float* x, float* y, int B) {
  for (int i = 0; i < B; ++i) {
    const float* xi = x + static_cast<size_t>(i) * op.in;
    float* yi = y + static_cast<size_t>(i) * op.out;
    switch (op.kind) {
      case OpKind::kLinear:
        for (int k = 0; k < op.out; ++k) {
          float s = op.b >= 0 ? t.p[op.b][k] : 0.0f;
          const float* w = t.p[op.w] + static_cast<size_t>(k) * op.in;
          for (int j = 0; j < op.in; ++j) s += w[j] * xi[j];
          yi[k] = s;
        }
        break;
      case OpKind::kAddBias:
        for (int k = 0; k < op.out; ++k) yi[k] = xi[k] + t.p[op.b][k];
        break;
      case OpKind::kTanh:
        for (int k = 0; k < op.out; ++k) yi[k] = std::tanh(xi[k]);
        break;
      case OpKind::kGain:
        for (int k = 0; k < op.out; ++k) yi[k] = t.p[op.w][0] * xi[k];
        break;
      case OpKind::kScaleShift:
        for (int k = 0; k < op.out; ++k) yi[k] = t.p[op.w][0] * xi[k] + t.p[op.b][k % 2];
        break;
    }
  }
}

// dx = dL/dx from dy; parameter gradients accumulated (frozen ones too, as a framework that
// computes them anyway would: the runtime must drop them). The sums over the batch are taken
// in double and added once, so the reference's and the ranks' sums differ by the rounding of
// the reduction alone, not by that of summing a few hundred samples in another order.
inline void OpBackward(const Op& op, const StagePtrs& t, const float* x, const float* y,
                       const float* dy, float* dx, int B) {
  const size_t nw = op.kind == OpKind::kLinear ? static_cast<size_t>(op.out) * op.in
                    : op.w >= 0                ? 1
                                               : 0;
  const size_t nb = op.kind == OpKind::kScaleShift ? 2 : op.b >= 0 ? op.out : 0;
  std::vector<double> gw(nw, 0.0), gb(nb, 0.0);
  for (int i = 0; i < B; ++i) {
    const float* xi = x + static_cast<size_t>(i) * op.in;
    const float* yi = y + static_cast<size_t>(i) * op.out;
    const float* dyi = dy + static_cast<size_t>(i) * op.out;
    float* dxi = dx + static_cast<size_t>(i) * op.in;
    switch (op.kind) {
      case OpKind::kLinear:
        std::fill_n(dxi, op.in, 0.0f);
        for (int k = 0; k < op.out; ++k) {
          if (op.b >= 0) gb[k] += dyi[k];
          for (int j = 0; j < op.in; ++j) {
            gw[static_cast<size_t>(k) * op.in + j] += static_cast<double>(dyi[k]) * xi[j];
            dxi[j] += t.p[op.w][static_cast<size_t>(k) * op.in + j] * dyi[k];
          }
        }
        break;
      case OpKind::kAddBias:
        for (int k = 0; k < op.out; ++k) {
          gb[k] += dyi[k];
          dxi[k] = dyi[k];
        }
        break;
      case OpKind::kTanh:
        for (int k = 0; k < op.out; ++k) dxi[k] = dyi[k] * (1.0f - yi[k] * yi[k]);
        break;
      case OpKind::kGain:
        for (int k = 0; k < op.out; ++k) {
          gw[0] += static_cast<double>(dyi[k]) * xi[k];
          dxi[k] = t.p[op.w][0] * dyi[k];
        }
        break;
      case OpKind::kScaleShift:
        for (int k = 0; k < op.out; ++k) {
          gw[0] += static_cast<double>(dyi[k]) * xi[k];
          gb[k % 2] += dyi[k];
          dxi[k] = t.p[op.w][0] * dyi[k];
        }
        break;
    }
  }
  for (size_t j = 0; j < nw; ++j) t.g[op.w][j] += static_cast<float>(gw[j]);
  for (size_t j = 0; j < nb; ++j) t.g[op.b][j] += static_cast<float>(gb[j]);
}

// The activations of one pass: acts[k] is the input of op k of the whole model (stages in
// order), acts.back() the output.
struct Tape {
  std::vector<std::vector<float>> acts;
};

inline std::vector<const Op*> AllOps(const Model& m) {
  std::vector<const Op*> ops;
  for (const Stage& s : m.stages) {
    for (const Op& op : s.ops) ops.push_back(&op);
  }
  return ops;
}

// ---- data --------------------------------------------------------------------------------------

struct Spec {
  int global_batch = 840;  // divisible by every world size 1..8
  int steps = 6;
  float lr = 1e-2f;
  float max_grad_norm = 0;  // 0: no clipping
  uint64_t seed = 5;
};

// Samples [first, first + count) of step `step`: inputs uniform in [-1, 1)^in, targets
// tanh(T x) of a fixed teacher T.
inline void Samples(const Model& m, const Spec& spec, int step, int first, int count,
                    std::vector<float>& x, std::vector<float>& target) {
  x.resize(static_cast<size_t>(count) * m.in);
  target.resize(static_cast<size_t>(count) * m.out);
  for (int i = 0; i < count; ++i) {
    float* xi = &x[static_cast<size_t>(i) * m.in];
    for (int j = 0; j < m.in; ++j) xi[j] = Uniform(spec.seed, 100 + step, first + i, j);
    for (int k = 0; k < m.out; ++k) {
      float z = 0;
      for (int j = 0; j < m.in; ++j) z += Uniform(spec.seed, 7, k, j) * xi[j];
      target[static_cast<size_t>(i) * m.out + k] = std::tanh(1.5f * z);
    }
  }
}

// Mean squared error over the B samples and outputs, and its gradient.
inline float MseLoss(const std::vector<float>& y, const std::vector<float>& target,
                     std::vector<float>& dy) {
  const float inv = 1.0f / static_cast<float>(y.size());
  dy.resize(y.size());
  double loss = 0;
  for (size_t k = 0; k < y.size(); ++k) {
    const float d = y[k] - target[k];
    loss += static_cast<double>(d) * d;
    dy[k] = 2.0f * d * inv;
  }
  return static_cast<float>(loss / static_cast<double>(y.size()));
}

// ---- results -----------------------------------------------------------------------------------

struct Result {
  std::vector<float> losses;                     // the global batch's mean loss, per step
  std::vector<double> grad_norms;                // pre-clip global gradient norm, per step
  std::vector<std::vector<float>> first_grads;   // per unit, the gradient of the first step
  std::vector<std::vector<float>> params;        // per unit, after the last step
  int clipped_steps = 0;
  MemoryReport memory;
  MemoryStats backend_memory;
};

// Parity with the reference: losses and norms relative to each value, gradients and
// parameters as ||got - ref|| / ||ref|| per unit (tests/fsdp/parity_util.h). The batch sums are
// taken in double on both sides, so what differs is the rounding of the ranks' reduction:
// measured, the losses within 2.2e-7 and everything else within 1e-7 relative, hence 1e-6
// (tighter than the GPT parity's 1e-5; a shard piece lost or a sum in place of a mean is off by
// orders of magnitude more).
inline void ExpectParity(const Result& got, const Result& ref, const std::string& where,
                         double tol = 1e-6) {
  EXPECT_EQ(got.clipped_steps, ref.clipped_steps) << where;
  ASSERT_EQ(got.losses.size(), ref.losses.size()) << where;
  for (size_t i = 0; i < ref.losses.size(); ++i) {
    EXPECT_NEAR(got.losses[i], ref.losses[i], tol * ref.losses[i]) << where << " step " << i;
  }
  ASSERT_EQ(got.grad_norms.size(), ref.grad_norms.size()) << where;
  for (size_t i = 0; i < ref.grad_norms.size(); ++i) {
    EXPECT_NEAR(got.grad_norms[i], ref.grad_norms[i], tol * ref.grad_norms[i])
        << where << " step " << i << ": the pre-clip gradient norm";
  }
  ASSERT_EQ(got.first_grads.size(), ref.first_grads.size()) << where;
  for (size_t u = 0; u < ref.first_grads.size(); ++u) {
    EXPECT_LT(NormRelDiff(got.first_grads[u], ref.first_grads[u]), tol)
        << where << " unit " << u << ": the reduced gradient of the first step";
  }
  ASSERT_EQ(got.params.size(), ref.params.size()) << where;
  for (size_t u = 0; u < ref.params.size(); ++u) {
    EXPECT_LT(NormRelDiff(got.params[u], ref.params[u]), tol)
        << where << " unit " << u << ": the parameters after the last step";
  }
}

// ---- the sharded run: the framework's side of the hooks ----------------------------------------

inline absl::StatusOr<std::unique_ptr<ShardingRuntime>> BuildRuntime(Backend* backend,
                                                                     Communicator& comm,
                                                                     const Model& m,
                                                                     ShardingOptions options) {
  FSDP_ASSIGN_OR_RETURN(auto rt, ShardingRuntime::Create(backend, comm, options));
  for (const Stage& s : m.stages) {
    FSDP_RETURN_IF_ERROR(rt->RegisterUnit(s.unit, s.params).status());
  }
  FSDP_RETURN_IF_ERROR(rt->Finalize(
      [](int, const ParamInfo& p, int64_t begin, int64_t end, float* out) {
        for (int64_t j = begin; j < end; ++j) out[j - begin] = InitValue(p, j);
      }));
  return rt;
}

inline StagePtrs PtrsOf(const UnitView& v, int n, bool grads) {
  StagePtrs t;
  for (int i = 0; i < n; ++i) {
    t.p.push_back(v.param(i));
    t.g.push_back(grads ? v.grad(i) : nullptr);
  }
  return t;
}

// Trains steps [first_step, first_step + steps) on this rank's share of each global batch,
// appending to `out`; at step 0 also gathers every unit's reduced gradient.
inline absl::Status TrainSteps(ShardingRuntime& rt, Communicator& comm, const Model& m,
                               const Spec& spec, int first_step, int steps, Result& out) {
  const int local = spec.global_batch / comm.size();
  const int first_sample = comm.rank() * local;
  const std::vector<const Op*> ops = AllOps(m);
  Tape tape;
  tape.acts.resize(ops.size() + 1);
  std::vector<float> target, dy, dx;
  for (int step = first_step; step < first_step + steps; ++step) {
    Samples(m, spec, step, first_sample, local, tape.acts[0], target);
    size_t k = 0;
    for (size_t s = 0; s < m.stages.size(); ++s) {
      const Stage& st = m.stages[s];
      FSDP_ASSIGN_OR_RETURN(UnitView v, rt.PreForward(static_cast<int>(s)));
      const StagePtrs t = PtrsOf(v, static_cast<int>(st.params.size()), false);
      for (const Op& op : st.ops) {
        tape.acts[k + 1].resize(static_cast<size_t>(local) * op.out);
        OpForward(op, t, tape.acts[k].data(), tape.acts[k + 1].data(), local);
        ++k;
      }
      FSDP_RETURN_IF_ERROR(rt.PostForward(static_cast<int>(s)));
    }
    float loss = MseLoss(tape.acts.back(), target, dy);
    FSDP_RETURN_IF_ERROR(comm.AllReduce(&loss, &loss, 1, DType::kF32, ReduceOp::kAvg));
    out.losses.push_back(loss);
    for (size_t s = m.stages.size(); s-- > 0;) {
      const Stage& st = m.stages[s];
      FSDP_ASSIGN_OR_RETURN(UnitView v, rt.PreBackward(static_cast<int>(s)));
      const StagePtrs t = PtrsOf(v, static_cast<int>(st.params.size()), true);
      for (size_t o = st.ops.size(); o-- > 0;) {
        --k;
        const Op& op = st.ops[o];
        dx.resize(static_cast<size_t>(local) * op.in);
        OpBackward(op, t, tape.acts[k].data(), tape.acts[k + 1].data(), dy.data(), dx.data(),
                   local);
        dy.swap(dx);
      }
      FSDP_RETURN_IF_ERROR(rt.PostBackward(static_cast<int>(s)));
    }
    FSDP_RETURN_IF_ERROR(rt.FinishBackward());
    if (step == 0) {
      for (int u = 0; u < rt.num_units(); ++u) {
        std::vector<float> g(rt.unit_numel(u));
        FSDP_RETURN_IF_ERROR(rt.GatherUnitGradient(u, g.data()));
        out.first_grads.push_back(std::move(g));
      }
    }
    FSDP_ASSIGN_OR_RETURN(StepStats st, rt.Step(spec.lr));
    out.grad_norms.push_back(st.grad_norm);
    if (st.clip_coefficient < 1.0f) ++out.clipped_steps;
  }
  return absl::OkStatus();
}

inline absl::Status GatherParams(ShardingRuntime& rt, Result& out) {
  out.params.clear();
  for (int u = 0; u < rt.num_units(); ++u) {
    std::vector<float> p(rt.unit_numel(u));
    FSDP_RETURN_IF_ERROR(rt.GatherUnit(u, p.data()));
    out.params.push_back(std::move(p));
  }
  return absl::OkStatus();
}

inline ShardingOptions Options(ShardingStrategy strategy, int hybrid_shard, const Spec& spec) {
  ShardingOptions o;
  o.strategy = strategy;
  o.hybrid_shard_size = hybrid_shard;
  o.max_grad_norm = spec.max_grad_norm;
  return o;
}

// One rank's whole run: every step, then the parameters and the memory report. On the CPU
// backend, or on the backend `make_backend` makes (a host backend: the layers read its memory).
inline absl::StatusOr<Result> TrainSharded(
    Communicator& comm, const Model& m, const Spec& spec, const ShardingOptions& options,
    const std::function<absl::StatusOr<std::unique_ptr<Backend>>()>& make_backend = nullptr) {
  std::unique_ptr<Backend> backend;
  if (make_backend) {
    FSDP_ASSIGN_OR_RETURN(backend, make_backend());
  } else {
    FSDP_ASSIGN_OR_RETURN(backend, CpuBackend::Create({.num_threads = 1,
                                                       .ranks_sharing_cores = comm.size()}));
  }
  Result out;
  {
    FSDP_ASSIGN_OR_RETURN(auto rt, BuildRuntime(backend.get(), comm, m, options));
    FSDP_RETURN_IF_ERROR(TrainSteps(*rt, comm, m, spec, 0, spec.steps, out));
    FSDP_RETURN_IF_ERROR(GatherParams(*rt, out));
    out.memory = rt->memory();
    out.backend_memory = backend->memory_stats();
  }
  return out;
}

// ---- checkpoints across world sizes ------------------------------------------------------------

// One leg of a run that moves between world sizes: on this world and strategy, load the
// previous leg's checkpoint (unless `load` is empty), train `steps` steps from `first_step`,
// gather the parameters, then save a checkpoint to `save` or export to `export_to`.
struct Leg {
  int world;
  ShardingStrategy strategy;
  int hybrid_shard = 0;
  int steps;
};

inline absl::Status RunLeg(Communicator& comm, const Model& m, const Spec& spec, const Leg& leg,
                           int first_step, const std::string& load, const std::string& save,
                           const std::string& export_to, Result& out, LoadedCheckpoint* loaded) {
  FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1,
                                                          .ranks_sharing_cores = comm.size()}));
  FSDP_ASSIGN_OR_RETURN(auto rt, BuildRuntime(backend.get(), comm, m,
                                              Options(leg.strategy, leg.hybrid_shard, spec)));
  if (!load.empty()) {
    FSDP_ASSIGN_OR_RETURN(*loaded, LoadCheckpoint(*rt, load));
  }
  FSDP_RETURN_IF_ERROR(TrainSteps(*rt, comm, m, spec, first_step, leg.steps, out));
  FSDP_RETURN_IF_ERROR(GatherParams(*rt, out));
  if (!save.empty()) {
    FSDP_RETURN_IF_ERROR(SaveCheckpoint(*rt, save));
  }
  if (!export_to.empty()) {
    FSDP_RETURN_IF_ERROR(ExportSafetensors(*rt, export_to));
  }
  return absl::OkStatus();
}

// The export holds every tensor by name and shape, in F32, equal to the gathered parameters
// `params` (per unit) and near the reference's.
inline void ExpectExportHolds(const std::string& path, const Model& m,
                              const std::vector<std::vector<float>>& params,
                              const std::vector<std::vector<float>>& reference) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream raw;
  raw << f.rdbuf();
  absl::StatusOr<ref_st::File> file = ref_st::Parse(raw.str());
  ASSERT_TRUE(file.ok()) << path << ": " << file.status();
  ASSERT_EQ(params.size(), m.stages.size());
  ASSERT_EQ(reference.size(), m.stages.size());
  size_t tensors = 0;
  for (size_t u = 0; u < m.stages.size(); ++u) {
    int64_t off = 0;
    for (const ParamInfo& p : m.stages[u].params) {
      auto it = file->tensors.find(p.name);
      ASSERT_NE(it, file->tensors.end()) << p.name;
      EXPECT_EQ(it->second.dtype, "F32") << p.name;
      EXPECT_EQ(it->second.shape, p.shape) << p.name;
      const std::vector<float> values = ref_st::F32Values(it->second);
      EXPECT_EQ(values, std::vector<float>(params[u].begin() + off,
                                           params[u].begin() + off + Numel(p)))
          << p.name;
      EXPECT_LT(NormRelDiff(values, std::vector<float>(reference[u].begin() + off,
                                                       reference[u].begin() + off + Numel(p))),
                1e-6)
          << p.name;
      off += Numel(p);
      ++tensors;
    }
  }
  EXPECT_EQ(file->tensors.size(), tensors);
}

// ---- the reference -----------------------------------------------------------------------------

inline absl::StatusOr<Result> TrainReference(const Model& m, const Spec& spec) {
  FSDP_ASSIGN_OR_RETURN(auto backend, CpuBackend::Create({.num_threads = 1}));
  const int U = static_cast<int>(m.stages.size());
  std::vector<Buffer> params(U), grads(U);
  std::vector<std::unique_ptr<AdamW>> opts;
  std::vector<StagePtrs> ptrs(U);
  for (int u = 0; u < U; ++u) {
    const Stage& st = m.stages[u];
    const size_t bytes = static_cast<size_t>(StageNumel(st)) * sizeof(float);
    FSDP_ASSIGN_OR_RETURN(params[u], Buffer::Create(backend.get(), bytes));
    FSDP_ASSIGN_OR_RETURN(grads[u], Buffer::Create(backend.get(), bytes));
    std::vector<DecayRange> ranges;
    int64_t off = 0;
    for (const ParamInfo& p : st.params) {
      for (int64_t i = 0; i < Numel(p); ++i) params[u].as<float>()[off + i] = InitValue(p, i);
      if (p.requires_grad) {
        ranges.push_back({off, off + Numel(p), p.weight_decay.value_or(p.shape.size() >= 2)});
      }
      ptrs[u].p.push_back(params[u].as<float>() + off);
      ptrs[u].g.push_back(grads[u].as<float>() + off);
      off += Numel(p);
    }
    FSDP_ASSIGN_OR_RETURN(auto opt, AdamW::Create(backend.get(), off, ranges));
    opts.push_back(std::move(opt));
  }
  auto numel = [&](int u) { return StageNumel(m.stages[u]); };
  const std::vector<const Op*> ops = AllOps(m);
  const int B = spec.global_batch;
  Tape tape;
  tape.acts.resize(ops.size() + 1);
  std::vector<float> target, dy, dx;
  Result out;
  for (int step = 0; step < spec.steps; ++step) {
    for (int u = 0; u < U; ++u) std::fill_n(grads[u].as<float>(), numel(u), 0.0f);
    Samples(m, spec, step, 0, B, tape.acts[0], target);
    size_t k = 0;
    for (int u = 0; u < U; ++u) {
      for (const Op& op : m.stages[u].ops) {
        tape.acts[k + 1].resize(static_cast<size_t>(B) * op.out);
        OpForward(op, ptrs[u], tape.acts[k].data(), tape.acts[k + 1].data(), B);
        ++k;
      }
    }
    out.losses.push_back(MseLoss(tape.acts.back(), target, dy));
    for (int u = U; u-- > 0;) {
      const Stage& st = m.stages[u];
      for (size_t o = st.ops.size(); o-- > 0;) {
        --k;
        const Op& op = st.ops[o];
        dx.resize(static_cast<size_t>(B) * op.in);
        OpBackward(op, ptrs[u], tape.acts[k].data(), tape.acts[k + 1].data(), dy.data(),
                   dx.data(), B);
        dy.swap(dx);
      }
    }
    // Frozen tensors have no gradient.
    double sq = 0;
    for (int u = 0; u < U; ++u) {
      const Stage& st = m.stages[u];
      for (size_t i = 0; i < st.params.size(); ++i) {
        if (!st.params[i].requires_grad) std::fill_n(ptrs[u].g[i], Numel(st.params[i]), 0.0f);
      }
      for (int64_t i = 0; i < numel(u); ++i) {
        sq += static_cast<double>(grads[u].as<float>()[i]) * grads[u].as<float>()[i];
      }
    }
    out.grad_norms.push_back(std::sqrt(sq));
    if (step == 0) {
      for (int u = 0; u < U; ++u) {
        out.first_grads.emplace_back(grads[u].as<float>(), grads[u].as<float>() + numel(u));
      }
    }
    const float coef = ClipCoefficient(std::sqrt(sq), spec.max_grad_norm);
    if (coef < 1.0f) ++out.clipped_steps;
    for (int u = 0; u < U; ++u) {
      if (coef != 1.0f) {
        for (int64_t i = 0; i < numel(u); ++i) grads[u].as<float>()[i] *= coef;
      }
      opts[u]->set_lr(spec.lr);
      FSDP_RETURN_IF_ERROR(opts[u]->Step(params[u].view(), grads[u].view()));
    }
  }
  for (int u = 0; u < U; ++u) {
    out.params.emplace_back(params[u].as<float>(), params[u].as<float>() + numel(u));
  }
  return out;
}

// A model's reference run with clipping at the median of the unclipped run's gradient norms,
// so that some steps clip and some do not.
struct Reference {
  Spec spec;
  Result result;
};
inline Reference MakeReference(const Model& m) {
  Reference ref;
  absl::StatusOr<Result> unclipped = TrainReference(m, ref.spec);
  EXPECT_TRUE(unclipped.ok()) << unclipped.status();
  if (!unclipped.ok()) return ref;
  ref.spec.max_grad_norm = ClipThreshold(Clip::kSome, unclipped->grad_norms);
  absl::StatusOr<Result> r = TrainReference(m, ref.spec);
  EXPECT_TRUE(r.ok()) << r.status();
  if (r.ok()) ref.result = *std::move(r);
  return ref;
}

// The models of the tests, by name.
inline std::vector<Model> AllModels() {
  return {Mlp(16, 15, 8), Mlp(7, 15, 3), Mlp(16, 17, 8), Degenerate(7, 15, 3)};
}
inline Model ModelByName(const std::string& name) {
  for (Model& m : AllModels()) {
    if (m.name == name) return m;
  }
  return {};
}

}  // namespace fsdp::testing::uneven
