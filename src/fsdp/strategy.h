// Every strategy is one mesh (replicate R x shard S) plus one flag (fsdp/sharding.h):
//   FULL_SHARD 1 x N, SHARD_GRAD_OP 1 x N (params kept from forward to backward),
//   NO_SHARD N x 1 (a shard is the whole unit: no gathers, gradients all-reduced),
//   HYBRID_* R x S.
#pragma once

#include "fsdp/sharding.h"

namespace fsdp::internal {

struct MeshShape {
  int replicate = 1;
  int shard = 1;
};

// The mesh of `options.strategy` on `world_size` ranks; InvalidArgument when a hybrid shard
// size does not divide the world.
absl::StatusOr<MeshShape> StrategyMesh(const ShardingOptions& options, int world_size);

}  // namespace fsdp::internal
