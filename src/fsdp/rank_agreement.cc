// Rank agreement checks over the communicator (64-bit values through collectives/control.h),
// and the runtime's options as named settings.
#include "src/fsdp/rank_agreement.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collectives/control.h"

namespace fsdp::internal {
absl::Status CheckUnitsAgree(Communicator& comm, const std::vector<uint64_t>& units,
                             const std::vector<std::string>& names) {
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> counts, AllGatherU64(comm, {units.size()}));
  const int n = comm.size();
  for (int r = 1; r < n; ++r) {
    if (counts[r] != counts[0]) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranks registered different units: rank 0 registered ", counts[0], " units, rank ",
          r, " registered ", counts[r], "; every rank must register the same units"));
    }
  }
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> all, AllGatherU64(comm, units));
  const size_t k = units.size();
  for (int r = 1; r < n; ++r) {
    for (size_t i = 0; i < k; ++i) {
      if (all[r * k + i] != all[i]) {
        return absl::InvalidArgumentError(absl::StrCat(
            "ranks registered different units: unit ", i, " ('", names[i], "' on rank ",
            comm.rank(), ") differs between rank 0 and rank ", r,
            " in its name, parameter names, shapes or flags; every rank must register the "
            "same units in the same order"));
      }
    }
  }
  return absl::OkStatus();
}

std::vector<Setting> ShardingOptionSettings(const ShardingOptions& o) {
  auto num = [](double v) { return absl::StrFormat("%.9g", v); };
  const MixedPrecision& mp = o.mixed_precision;
  std::vector<Setting> out = {
      {"strategy", std::string(StrategyName(o.strategy))},
      {"hybrid_shard_size", absl::StrCat(o.hybrid_shard_size)},
      {"secondary_shard_size", absl::StrCat(o.secondary_shard_size)},
      {"forward_prefetch", absl::StrCat(o.forward_prefetch)},
      {"backward_prefetch", absl::StrCat(o.backward_prefetch)},
      {"max_prefetch_units", absl::StrCat(o.max_prefetch_units)},
      {"max_grad_norm", num(o.max_grad_norm)},
      {"param_dtype", std::string(DTypeName(mp.param_dtype))},
      {"reduce_dtype", std::string(DTypeName(mp.reduce_dtype))},
      {"dynamic_loss_scale", absl::StrCat(mp.dynamic_loss_scale)},
      {"nonfinite", o.nonfinite == NonFinitePolicy::kError ? "error" : "skip"},
      {"communication.all_gather", std::string(WireFormatName(o.communication.all_gather))},
  };
  out.push_back({"communication.reduction", std::string(WireFormatName(o.communication.reduction))});
  out.push_back({"offload", std::string(OffloadName(o.offload.what))});
  if (o.offload.what != OffloadKind::kNone) {
    out.push_back({"offload.units", absl::StrJoin(o.offload.units, ",")});
    out.push_back({"offload.budget_bytes", absl::StrCat(o.offload.budget_bytes)});
  }
  if (o.communication.quantizes()) {
    out.push_back({"communication.block_size", absl::StrCat(o.communication.block_size)});
  }
  if (mp.dynamic_loss_scale) {
    out.push_back({"initial_loss_scale", num(mp.initial_loss_scale)});
    out.push_back({"growth_factor", num(mp.growth_factor)});
    out.push_back({"backoff_factor", num(mp.backoff_factor)});
    out.push_back({"growth_interval", absl::StrCat(mp.growth_interval)});
  }
  if (o.optimizer == OptimizerKind::kAdamW) {
    out.push_back({"optimizer", "AdamW"});
    out.push_back({"adamw.lr", num(o.adamw.lr)});
    out.push_back({"adamw.beta1", num(o.adamw.beta1)});
    out.push_back({"adamw.beta2", num(o.adamw.beta2)});
    out.push_back({"adamw.eps", num(o.adamw.eps)});
    out.push_back({"adamw.weight_decay", num(o.adamw.weight_decay)});
  } else {
    out.push_back({"optimizer", "SGD"});
    out.push_back({"sgd.lr", num(o.sgd.lr)});
    out.push_back({"sgd.momentum", num(o.sgd.momentum)});
    out.push_back({"sgd.dampening", num(o.sgd.dampening)});
    out.push_back({"sgd.weight_decay", num(o.sgd.weight_decay)});
    out.push_back({"sgd.nesterov", absl::StrCat(o.sgd.nesterov)});
  }
  return out;
}

}  // namespace fsdp::internal
