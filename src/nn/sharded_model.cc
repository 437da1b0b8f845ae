// ShardedModel: a bundled model's staged forward/backward driven through the sharding runtime's hooks,
// with units chosen by a wrap policy.
#include "fsdp/nn/sharded_model.h"

#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "fsdp/trace.h"

namespace fsdp::nn {
namespace {

// Groups the blocks into runs per the policy. Returns, per block, the index of its group, or
// -1 when the block joins the root unit.
absl::StatusOr<std::vector<int>> GroupBlocks(const ModelConfig& config,
                                             const WrapPolicy& policy) {
  const int L = config.num_layers();
  std::vector<int> group(L, -1);
  switch (policy.kind) {
    case WrapPolicy::Kind::kPerBlock:
      for (int i = 0; i < L; ++i) group[i] = i;
      break;
    case WrapPolicy::Kind::kMinParams: {
      if (policy.min_params < 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            "WrapPolicy kMinParams: min_params must be >= 1, got ", policy.min_params));
      }
      int g = 0;
      int64_t in_group = 0;
      for (int i = 0; i < L; ++i) {
        group[i] = g;
        in_group += config.UnitNumel(1 + i);
        if (in_group >= policy.min_params && i + 1 < L) {
          ++g;
          in_group = 0;
        }
      }
      // A last run below the threshold joins the run before it.
      if (L > 0 && in_group < policy.min_params && g > 0) {
        for (int i = 0; i < L; ++i) {
          if (group[i] == g) group[i] = g - 1;
        }
      }
      break;
    }
    case WrapPolicy::Kind::kExplicit: {
      std::set<std::string> seen;
      for (const std::string& m : policy.modules) {
        int i = -1;
        const std::string prefix = config.BlockPrefix();
        if (m.rfind(prefix, 0) == 0) {
          const std::string digits = m.substr(prefix.size());
          if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos ||
              !absl::SimpleAtoi(digits, &i)) {
            i = -1;
          }
        }
        if (i < 0 || i >= L) {
          return absl::InvalidArgumentError(absl::StrCat(
              "WrapPolicy kExplicit: '", m, "' is not a block of this model; name blocks as ",
              config.BlockName(0), " .. ", config.BlockName(L - 1)));
        }
        if (!seen.insert(m).second) {
          return absl::InvalidArgumentError(
              absl::StrCat("WrapPolicy kExplicit: '", m, "' is listed twice"));
        }
        group[i] = i;
      }
      break;
    }
  }
  return group;
}

// A model unit's parameters (numel elements from `offset`) inside a runtime unit's view.
View ParamsAt(const UnitView& v, int64_t offset, int64_t numel) {
  return v.data_view.Slice(offset, numel);
}
View GradsAt(const UnitView& v, int64_t offset, int64_t numel) {
  return v.grads_view.Slice(offset, numel);
}

}  // namespace

ShardedModel::~ShardedModel() = default;

absl::StatusOr<std::unique_ptr<ShardedModel>> ShardedModel::Create(const ModelConfig& config,
                                                                   Backend* backend,
                                                                   Communicator& world,
                                                                   ShardedModelOptions options) {
  FSDP_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<ShardedModel> g(new ShardedModel());
  g->config_ = config;
  g->backend_ = backend;
  ModelOptions model_options;
  model_options.compute_dtype = options.sharding.mixed_precision.param_dtype;
  if (!options.checkpoint_blocks.empty()) {
    if (static_cast<int>(options.checkpoint_blocks.size()) != config.num_layers()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint_blocks has ", options.checkpoint_blocks.size(),
          " flags; give one per block (", config.num_layers(), ") or leave it empty"));
    }
    model_options.checkpoint_layers = options.checkpoint_blocks;
  } else if (options.checkpoint_every > 0) {
    for (int i = 0; i < config.num_layers(); ++i) {
      model_options.checkpoint_layers.push_back(i % options.checkpoint_every == 0);
    }
  } else if (options.checkpoint_every < 0) {
    return absl::InvalidArgumentError("checkpoint_every must be >= 0 (0 = off)");
  }
  FSDP_ASSIGN_OR_RETURN(g->model_, config.CreateModel(backend, options.batch_size,
                                                      options.seq_len, model_options));
  FSDP_ASSIGN_OR_RETURN(g->runtime_, ShardingRuntime::Create(backend, world, options.sharding));
  g->runtime_->set_model_description(config.Describe());
  FSDP_ASSIGN_OR_RETURN(std::vector<int> group, GroupBlocks(config, options.wrap));

  const std::set<std::string> frozen(options.frozen.begin(), options.frozen.end());
  std::set<std::string> frozen_found;
  const int num_modules = g->model_->num_units();
  auto infos = [&](int module) {
    std::vector<ParamInfo> out;
    for (const ParamSpec* s : g->model_->unit_params(module)) {
      const bool is_frozen = frozen.count(s->name) > 0;
      if (is_frozen) frozen_found.insert(s->name);
      out.push_back({s->name, s->shape, !is_frozen, s->weight_decay});
    }
    return out;
  };
  // Runtime units: the root unit (root + unwrapped blocks) first, then the block runs.
  g->module_unit_.assign(num_modules, 0);
  g->module_offset_.assign(num_modules, 0);
  std::vector<ParamInfo> root = infos(0);
  int64_t root_numel = g->model_->unit_numel(0);
  for (int i = 0; i < config.num_layers(); ++i) {
    if (group[i] >= 0) continue;
    g->module_offset_[1 + i] = root_numel;
    root_numel += g->model_->unit_numel(1 + i);
    for (ParamInfo& p : infos(1 + i)) root.push_back(std::move(p));
  }
  // The root unit is registered first, so it is unit 0 (module_unit_ defaults to it).
  FSDP_RETURN_IF_ERROR(g->runtime_->RegisterUnit("root", std::move(root)).status());
  g->first_block_.push_back(-1);
  g->last_block_.push_back(-1);
  for (int i = 0; i < config.num_layers();) {
    if (group[i] < 0) {
      ++i;
      continue;
    }
    int j = i;
    std::vector<ParamInfo> params;
    int64_t numel = 0;
    while (j < config.num_layers() && group[j] == group[i]) {
      g->module_offset_[1 + j] = numel;
      numel += g->model_->unit_numel(1 + j);
      for (ParamInfo& p : infos(1 + j)) params.push_back(std::move(p));
      ++j;
    }
    const std::string name =
        j - i == 1 ? config.BlockName(i) : absl::StrCat(config.BlockName(i), "-", j - 1);
    FSDP_ASSIGN_OR_RETURN(int unit, g->runtime_->RegisterUnit(name, std::move(params)));
    for (int b = i; b < j; ++b) g->module_unit_[1 + b] = unit;
    g->first_block_.push_back(i);
    g->last_block_.push_back(j - 1);
    i = j;
  }
  for (const std::string& f : frozen) {
    if (!frozen_found.count(f)) {
      return absl::InvalidArgumentError(
          absl::StrCat("frozen parameter '", f, "' is not a parameter of this model"));
    }
  }
  // Initialise each rank's shard directly: InitParamSlice is a pure function of the index.
  std::map<std::string, const ParamSpec*> by_name;
  for (const ParamSpec& s : g->model_->params()) by_name[s.name] = &s;
  const uint64_t seed = options.seed;
  FSDP_RETURN_IF_ERROR(g->runtime_->Finalize(
      [&](int, const ParamInfo& p, int64_t begin, int64_t end, float* out) {
        config.InitParamSlice(*by_name.at(p.name), seed, begin, end, out);
      }));
  const size_t token_bytes = sizeof(int32_t) * options.batch_size * options.seq_len;
  FSDP_ASSIGN_OR_RETURN(g->inputs_, Buffer::Create(backend, token_bytes));
  FSDP_ASSIGN_OR_RETURN(g->targets_, Buffer::Create(backend, token_bytes));
  // Everything the model holds on the backend: its activations and the token buffers.
  g->runtime_->SetActivationBytes(g->model_->activation_bytes() +
                                  static_cast<int64_t>(g->inputs_.bytes() + g->targets_.bytes()));
  return g;
}

absl::Status ShardedModel::CopyTokens(const int32_t* inputs, const int32_t* targets) {
  if (inputs == nullptr) return absl::InvalidArgumentError("ShardedModel: inputs is null");
  const int64_t n = static_cast<int64_t>(model_->batch_size()) * model_->seq_len();
  // The ids are checked here, where they are host data, before they go to the device.
  FSDP_RETURN_IF_ERROR(CheckTokenIds(inputs, n, config_.vocab_size(), model_->seq_len(), "idx"));
  FSDP_RETURN_IF_ERROR(backend_->CopyFromHost(inputs_.view(DType::kI32), inputs));
  if (targets != nullptr) {
    FSDP_RETURN_IF_ERROR(
        CheckTokenIds(targets, n, config_.vocab_size(), model_->seq_len(), "targets"));
    FSDP_RETURN_IF_ERROR(backend_->CopyFromHost(targets_.view(DType::kI32), targets));
  }
  return absl::OkStatus();
}

absl::StatusOr<float> ShardedModel::RunForward(bool with_targets) {
  ShardingRuntime& rt = *runtime_;
  const int root = module_unit_[0];
  FSDP_ASSIGN_OR_RETURN(UnitView root_view, rt.PreForward(root));
  const View root_params = ParamsAt(root_view, module_offset_[0], model_->unit_numel(0));
  FSDP_RETURN_IF_ERROR(model_->ForwardEmbed(root_params, inputs_.view(DType::kI32)));
  UnitView view = root_view;
  for (int i = 0; i < config_.num_layers(); ++i) {
    const int u = module_unit_[1 + i];
    if (u == root) {
      view = root_view;
    } else if (first_block_[u] == i) {
      FSDP_ASSIGN_OR_RETURN(view, rt.PreForward(u));
    }
    {
      TraceSpan span("forward", kComputeStream, {{"block", i}});
      FSDP_RETURN_IF_ERROR(model_->ForwardBlock(
          i, ParamsAt(view, module_offset_[1 + i], model_->unit_numel(1 + i))));
    }
    if (u != root && last_block_[u] == i) FSDP_RETURN_IF_ERROR(rt.PostForward(u));
  }
  FSDP_ASSIGN_OR_RETURN(float loss,
                        model_->ForwardHead(root_params, with_targets ? targets_.view(DType::kI32)
                                                                      : View{}));
  FSDP_RETURN_IF_ERROR(rt.PostForward(root));
  return loss;
}

absl::Status ShardedModel::RunBackward() {
  ShardingRuntime& rt = *runtime_;
  const int root = module_unit_[0];
  const int64_t root_numel = model_->unit_numel(0);
  FSDP_ASSIGN_OR_RETURN(UnitView root_view, rt.PreBackward(root));
  FSDP_RETURN_IF_ERROR(model_->BackwardHead(ParamsAt(root_view, module_offset_[0], root_numel),
                                            GradsAt(root_view, module_offset_[0], root_numel),
                                            rt.loss_scale()));
  UnitView view = root_view;
  for (int i = config_.num_layers() - 1; i >= 0; --i) {
    const int u = module_unit_[1 + i];
    if (u == root) {
      view = root_view;
    } else if (last_block_[u] == i) {
      FSDP_ASSIGN_OR_RETURN(view, rt.PreBackward(u));
    }
    const int64_t off = module_offset_[1 + i], numel = model_->unit_numel(1 + i);
    if (model_->layer_checkpointed(i)) {  // recompute the activations it did not keep
      TraceSpan span("recompute", kComputeStream, {{"block", i}});
      FSDP_RETURN_IF_ERROR(model_->ForwardBlock(i, ParamsAt(view, off, numel)));
    }
    {
      TraceSpan span("backward", kComputeStream, {{"block", i}});
      FSDP_RETURN_IF_ERROR(
          model_->BackwardBlock(i, ParamsAt(view, off, numel), GradsAt(view, off, numel)));
    }
    if (u != root && first_block_[u] == i) FSDP_RETURN_IF_ERROR(rt.PostBackward(u));
  }
  FSDP_RETURN_IF_ERROR(model_->BackwardEmbed(GradsAt(root_view, module_offset_[0], root_numel)));
  FSDP_RETURN_IF_ERROR(rt.PostBackward(root));
  return rt.FinishBackward();
}

absl::StatusOr<float> ShardedModel::ForwardBackward(const int32_t* inputs, const int32_t* targets) {
  FSDP_ASSIGN_OR_RETURN(float loss, TrainForward(inputs, targets));
  FSDP_RETURN_IF_ERROR(Backward());
  return loss;
}

absl::StatusOr<float> ShardedModel::TrainForward(const int32_t* inputs, const int32_t* targets) {
  if (targets == nullptr) return absl::InvalidArgumentError("TrainForward: targets is null");
  if (backward_due_) {
    return absl::FailedPreconditionError(
        "TrainForward: the previous TrainForward's Backward() has not run");
  }
  FSDP_RETURN_IF_ERROR(CopyTokens(inputs, targets));
  FSDP_ASSIGN_OR_RETURN(float loss, RunForward(true));
  backward_due_ = true;
  return loss;
}

absl::Status ShardedModel::Backward() {
  if (!backward_due_) {
    return absl::FailedPreconditionError(
        "Backward: no training forward to run the backward of; call TrainForward() first");
  }
  backward_due_ = false;
  return RunBackward();
}

absl::StatusOr<float> ShardedModel::Forward(const int32_t* inputs, const int32_t* targets) {
  if (backward_due_) {
    return absl::FailedPreconditionError(
        "Forward: the previous TrainForward's Backward() has not run");
  }
  FSDP_RETURN_IF_ERROR(CopyTokens(inputs, targets));
  FSDP_ASSIGN_OR_RETURN(float loss, RunForward(targets != nullptr));
  FSDP_RETURN_IF_ERROR(runtime_->FinishForwardOnly());
  return loss;
}

absl::StatusOr<StepStats> ShardedModel::Step(float lr) { return runtime_->Step(lr); }

absl::StatusOr<float> ShardedModel::MeanOverRanks(float value) {
  // A host scalar: the control plane (the world's host communicator) carries it.
  float out = 0;
  FSDP_RETURN_IF_ERROR(runtime_->world().AllReduce(&value, &out, 1, DType::kF32, ReduceOp::kAvg));
  return out;
}

absl::StatusOr<std::vector<std::vector<float>>> ShardedModel::GatherModelUnits() {
  return GatherModel(false);
}

absl::StatusOr<std::vector<std::vector<float>>> ShardedModel::GatherModelGradients() {
  return GatherModel(true);
}

absl::StatusOr<std::vector<std::vector<float>>> ShardedModel::GatherModel(bool gradients) {
  std::vector<std::vector<float>> out(model_->num_units());
  for (int m = 0; m < model_->num_units(); ++m) out[m].resize(model_->unit_numel(m));
  for (int u = 0; u < runtime_->num_units(); ++u) {
    std::vector<float> whole(runtime_->unit_numel(u));
    FSDP_RETURN_IF_ERROR(gradients ? runtime_->GatherUnitGradient(u, whole.data())
                                   : runtime_->GatherUnit(u, whole.data()));
    for (int m = 0; m < model_->num_units(); ++m) {
      if (module_unit_[m] != u) continue;
      std::copy_n(whole.begin() + module_offset_[m], out[m].size(), out[m].begin());
    }
  }
  return out;
}

}  // namespace fsdp::nn
