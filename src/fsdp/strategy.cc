// The strategies: their names, and the mesh (replicate x shard) each one is.
#include "src/fsdp/strategy.h"

#include <algorithm>
#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace fsdp {

std::string_view StrategyName(ShardingStrategy s) {
  switch (s) {
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kHybridShard: return "HYBRID_SHARD";
    case ShardingStrategy::kHybridShardGradOp: return "HYBRID_SHARD_GRAD_OP";
  }
  return "?";
}

absl::StatusOr<ShardingStrategy> ParseStrategy(std::string_view name) {
  std::string n = absl::AsciiStrToUpper(absl::string_view(name.data(), name.size()));
  std::replace(n.begin(), n.end(), '-', '_');
  for (auto s : {ShardingStrategy::kFullShard, ShardingStrategy::kShardGradOp,
                 ShardingStrategy::kNoShard, ShardingStrategy::kHybridShard,
                 ShardingStrategy::kHybridShardGradOp}) {
    if (n == StrategyName(s)) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown sharding strategy '", std::string(name),
      "'; use FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_GRAD_OP"));
}

std::string_view AccumulationName(Accumulation a) {
  switch (a) {
    case Accumulation::kNoSync: return "no_sync";
    case Accumulation::kSharded: return "sharded";
    case Accumulation::kEvery: return "every";
  }
  return "?";
}

absl::StatusOr<Accumulation> ParseAccumulation(std::string_view name) {
  std::string n = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  std::replace(n.begin(), n.end(), '-', '_');
  for (auto a : {Accumulation::kNoSync, Accumulation::kSharded, Accumulation::kEvery}) {
    if (n == AccumulationName(a)) return a;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown accumulation mode '", std::string(name),
      "'; use no_sync (whole gradients held until the last micro-batch), sharded (reduce-scatter "
      "every micro-batch, all-reduce across replicas in the last) or every"));
}

MicroBatchSwitches AccumulationSwitches(Accumulation mode, int micro_batch, int micro_batches) {
  const bool last = micro_batch + 1 >= micro_batches;
  return {mode != Accumulation::kNoSync || last, mode != Accumulation::kSharded || last};
}

void ConfigureMicroBatch(ShardingRuntime& rt, Accumulation mode, int micro_batch,
                         int micro_batches) {
  const MicroBatchSwitches s = AccumulationSwitches(mode, micro_batch, micro_batches);
  rt.set_sync_gradients(s.sync_gradients);
  rt.set_requires_all_reduce(s.requires_all_reduce);
}

namespace internal {

absl::StatusOr<MeshShape> StrategyMesh(const ShardingOptions& options, int world_size) {
  const int n = world_size;
  switch (options.strategy) {
    case ShardingStrategy::kFullShard:
    case ShardingStrategy::kShardGradOp:
      return MeshShape{1, n};
    case ShardingStrategy::kNoShard:
      return MeshShape{n, 1};
    case ShardingStrategy::kHybridShard:
    case ShardingStrategy::kHybridShardGradOp:
      if (options.hybrid_shard_size < 1 || n % options.hybrid_shard_size != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            std::string(StrategyName(options.strategy)), ": hybrid_shard_size (",
            options.hybrid_shard_size, ") must be >= 1 and divide the world size (", n,
            "); it is the number of ranks in a shard group, e.g. the ranks of one host"));
      }
      return MeshShape{n / options.hybrid_shard_size, options.hybrid_shard_size};
  }
  return absl::InvalidArgumentError("unknown sharding strategy");
}

}  // namespace internal

absl::Status CheckReductionDtype(const CommunicationOptions& c, DType reduce_dtype) {
  if (c.reduction == WireFormat::kDType || reduce_dtype == DType::kF32) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "communication.reduction is ", std::string(WireFormatName(c.reduction)),
      " with reduce_dtype ", std::string(DTypeName(reduce_dtype)),
      ": a quantized reduction encodes the f32 gradient and adds in f32; set reduce_dtype to "
      "f32 (the dtype of an unquantized reduction), or the reduction to dtype"));
}

absl::Status CheckSecondaryShard(const ShardingOptions& o, int shard_size) {
  const int n = o.secondary_shard_size;
  if (n == 0) return absl::OkStatus();
  auto bad = [&](std::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(
        "secondary_shard_size is ", n, " with ", std::string(StrategyName(o.strategy)),
        shard_size > 0 ? absl::StrCat(" and a shard group of ", shard_size, " ranks")
                       : std::string(" and a shard group per host"),
        ": ", std::string(why)));
  };
  if (o.strategy != ShardingStrategy::kFullShard && o.strategy != ShardingStrategy::kHybridShard) {
    return bad("a secondary shard is what FULL_SHARD and HYBRID_SHARD keep after forward; the "
               "other strategies keep the whole unit or never shard it; set it to 0");
  }
  if (shard_size <= 0 && n < 2) {  // the hosts are not known yet
    return bad("allowed: 0 (off) or N >= 2 dividing the ranks of a host (1 keeps every unit "
               "whole: SHARD_GRAD_OP)");
  }
  if (shard_size > 0 && (n < 2 || n >= shard_size || shard_size % n != 0)) {
    return bad(absl::StrCat(
        "allowed: 0 (off) or a divisor N of the shard group size with 2 <= N < ", shard_size,
        " (1 keeps every unit whole: SHARD_GRAD_OP; ", shard_size,
        " is the shard group itself: 0)"));
  }
  return absl::OkStatus();
}

absl::Status CheckCommunicationOptions(const CommunicationOptions& c) {
  if (!c.quantizes()) return absl::OkStatus();
  const int b = c.block_size;
  if (b < 16 || b > 65536 || (b & (b - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "communication.block_size is ", b, "; allowed: a power of two from 16 to 65536 "
        "(elements per f32 scale; 256 is DeepSpeed's default)"));
  }
  return absl::OkStatus();
}

}  // namespace fsdp
