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
}  // namespace fsdp
