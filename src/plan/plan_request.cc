// The memory planner's front: a bundled model's configuration turned into the plain numbers the
// core plans with (plan.cc), request checks with messages that say what to do, the largest
// micro-batch that fits, and tables over strategies and world sizes.
#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fsdp/plan.h"
#include "src/core/checked.h"

namespace fsdp {
namespace {

absl::Status Invalid(std::string message) { return absl::InvalidArgumentError(std::move(message)); }

// The checkpoint flags ShardedModel derives from its options (ShardedModelOptions).
absl::StatusOr<std::vector<bool>> CheckpointLayers(const PlanRequest& r, int L) {
  if (!r.checkpoint_blocks.empty()) {
    if (static_cast<int>(r.checkpoint_blocks.size()) != L) {
      return Invalid(absl::StrCat("checkpoint_blocks has ", r.checkpoint_blocks.size(),
                                  " flags; give one per block (", L, ") or leave it empty"));
    }
    return r.checkpoint_blocks;
  }
  if (r.checkpoint_every < 0) {
    return Invalid(absl::StrCat("checkpoint every ", r.checkpoint_every,
                                " blocks: give 0 (no checkpointing) or k >= 1 (blocks 0, k, 2k, "
                                "...; 1 = every block)"));
  }
  std::vector<bool> out;
  if (r.checkpoint_every > 0) {
    for (int i = 0; i < L; ++i) out.push_back(i % r.checkpoint_every == 0);
  }
  return out;
}

absl::StatusOr<nn::ModelConfig> RequestConfig(const PlanRequest& r) {
  if (r.config.has_value()) return *r.config;
  absl::StatusOr<nn::ModelConfig> c = nn::ModelConfig::FromName(r.model);
  if (!c.ok()) {
    return Invalid(absl::StrCat(c.status().message(),
                                " (or give the sizes explicitly instead of a name)"));
  }
  return c;
}

// The bytes the model holds on the device for one micro-batch of B x T with checkpoint flags
// `layers`: its activations and ShardedModel's token buffers (inputs and targets, int32 B x T),
// which ShardedModel::Create's SetActivationBytes counts with them. InvalidArgument when they
// come to more than int64 bytes. `config` has been validated.
absl::StatusOr<int64_t> MicroBatchBytes(const nn::ModelConfig& config, DType dtype,
                                        std::vector<bool> layers, int B, int T) {
  nn::ModelOptions mo;
  mo.compute_dtype = dtype;
  mo.checkpoint_layers = std::move(layers);
  const absl::StatusOr<int64_t> model = config.ActivationBytes(B, T, mo);
  int64_t tokens = 0, total = 0;
  if (!model.ok() ||
      !internal::CheckedProduct({2 * static_cast<int64_t>(sizeof(int32_t)), B, T}, &tokens) ||
      !internal::CheckedAdd(*model, tokens, &total)) {
    return Invalid(absl::StrCat("the activations of ", config.name(), " for B=", B, " x T=", T,
                                " come to more than 2^63 - 1 bytes (8 EiB); give a smaller "
                                "batch size B or sequence length T"));
  }
  return total;
}

// Checks what every plan of the request needs, whatever the model.
absl::Status CheckRequest(const PlanRequest& r) {
  if (r.batch_size < 1) {
    return Invalid(absl::StrCat("batch size B = ", r.batch_size,
                                ": give at least 1 sequence per rank and micro-batch"));
  }
  if (r.seq_len < 0) {
    return Invalid(absl::StrCat("sequence length T = ", r.seq_len,
                                ": give at least 1 (or 0 for the model's block size)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PlanModel> PlanModelFor(const nn::ModelConfig& config, const PlanRequest& r) {
  if (absl::Status s = config.Validate(); !s.ok()) {
    return Invalid(absl::StrCat("model '", config.name(), "': ", s.message()));
  }
  FSDP_RETURN_IF_ERROR(CheckRequest(r));
  const int T = r.seq_len == 0 ? config.block_size() : r.seq_len;
  if (T > config.block_size()) {
    return Invalid(absl::StrCat("sequence length T = ", T, " is longer than ", config.name(),
                                "'s block size (", config.block_size(),
                                "); give T <= ", config.block_size(),
                                " or a config with a larger block size"));
  }
  if (!IsFloat16Or32(r.param_dtype)) {
    return Invalid(absl::StrCat("param_dtype is ", std::string(DTypeName(r.param_dtype)),
                                "; use f32, bf16 or f16"));
  }
  const int L = config.num_layers();
  FSDP_ASSIGN_OR_RETURN(std::vector<bool> layers, CheckpointLayers(r, L));
  auto activations = [&](std::vector<bool> flags) {
    return MicroBatchBytes(config, r.param_dtype, std::move(flags), r.batch_size, T);
  };
  PlanModel m;
  m.name = config.name();
  m.num_parameters = config.num_parameters();
  m.unit_names.push_back("root");
  m.unit_numel.push_back(config.UnitNumel(0));
  for (int i = 0; i < L; ++i) {
    m.unit_names.push_back(config.BlockName(i));
    m.unit_numel.push_back(config.UnitNumel(1 + i));
  }
  const bool any = std::find(layers.begin(), layers.end(), true) != layers.end();
  FSDP_ASSIGN_OR_RETURN(m.activation_bytes, activations(layers));
  FSDP_ASSIGN_OR_RETURN(m.activation_bytes_without_checkpointing, activations({}));
  if (any) {
    m.activation_bytes_with_checkpointing = m.activation_bytes;
  } else {
    FSDP_ASSIGN_OR_RETURN(m.activation_bytes_with_checkpointing,
                          activations(std::vector<bool>(L, true)));
  }
  return m;
}

absl::StatusOr<MemoryPlan> PlanMemory(const PlanRequest& r) {
  FSDP_RETURN_IF_ERROR(CheckRequest(r));
  if (r.explicit_model.has_value() && !r.config.has_value()) {
    MemoryPlan p;
    FSDP_ASSIGN_OR_RETURN(p, PlanMemory(*r.explicit_model, r));
    return p;
  }
  FSDP_ASSIGN_OR_RETURN(nn::ModelConfig config, RequestConfig(r));
  FSDP_ASSIGN_OR_RETURN(PlanModel model, PlanModelFor(config, r));
  PlanRequest settled = r;
  if (settled.seq_len == 0) settled.seq_len = config.block_size();
  return PlanMemory(model, settled);
}

absl::StatusOr<int> LargestMicroBatch(const PlanRequest& request) {
  if (request.device_memory_bytes <= 0) {
    return Invalid("the largest micro-batch needs the device memory per rank (e.g. 80GiB)");
  }
  if (request.explicit_model.has_value() && !request.config.has_value()) {
    return Invalid(
        "the largest micro-batch needs a model whose activations the planner can size for any "
        "B: give a bundled model's name or a config instead of explicit unit sizes");
  }
  PlanRequest r = request;
  r.batch_size = 1;
  FSDP_ASSIGN_OR_RETURN(MemoryPlan one, PlanMemory(r));
  if (!one.fits) return 0;
  // Everything but the activations is independent of B (the replay never sees it), and the
  // activations grow with B: B fits when its activations fit in what the rest leaves. So the
  // replay runs once and each B only counts activations; a B whose activations do not fit in
  // int64 bytes fits no device.
  const int64_t room = r.device_memory_bytes - (one.peak_bytes - one.activation_peak_bytes);
  FSDP_ASSIGN_OR_RETURN(nn::ModelConfig config, RequestConfig(r));
  FSDP_ASSIGN_OR_RETURN(std::vector<bool> layers, CheckpointLayers(r, config.num_layers()));
  auto fits = [&](int B) {
    absl::StatusOr<int64_t> bytes = MicroBatchBytes(config, r.param_dtype, layers, B, one.seq_len);
    return bytes.ok() && *bytes <= room;
  };
  constexpr int kMax = 1 << 20;
  int lo = 1, hi = 2;  // lo fits; hi is unknown
  while (hi <= kMax && fits(hi)) {
    lo = hi;
    hi *= 2;
  }
  if (hi > kMax) return lo;
  while (hi - lo > 1) {  // lo fits, hi does not
    const int mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

absl::StatusOr<std::vector<PlanTableCell>> PlanTable(
    const PlanRequest& request, const std::vector<ShardingStrategy>& strategies,
    const std::vector<int>& world_sizes) {
  if (strategies.empty() || world_sizes.empty()) {
    return Invalid("a table needs at least one strategy and one world size");
  }
  std::vector<PlanTableCell> cells;
  for (ShardingStrategy s : strategies) {
    for (int world : world_sizes) {
      PlanTableCell c;
      c.strategy = s;
      c.world_size = world;
      PlanRequest r = request;
      r.strategy = s;
      r.world_size = world;
      absl::StatusOr<MemoryPlan> p = PlanMemory(r);
      if (p.ok()) {
        c.plan = *std::move(p);
        if (r.device_memory_bytes > 0) {
          FSDP_ASSIGN_OR_RETURN(c.largest_micro_batch, LargestMicroBatch(r));
        }
      } else {
        c.status = p.status();
      }
      cells.push_back(std::move(c));
    }
  }
  // An error no cell escapes is the request's, not the table's.
  if (std::all_of(cells.begin(), cells.end(), [&](const PlanTableCell& c) {
        return !c.status.ok() && c.status.message() == cells.front().status.message();
      })) {
    return cells.front().status;
  }
  return cells;
}

}  // namespace fsdp
