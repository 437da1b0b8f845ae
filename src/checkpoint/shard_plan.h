// Which pieces of which tensors a rank's shard of a unit holds: shard k of a unit is
// elements [k * shard_numel, (k + 1) * shard_numel) of the unit's padded flat buffer, and
// each tensor occupies [offset, offset + numel) of it (TensorSlot). Shared by the sharded
// save/load and the safetensors export/import.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/sharding.h"
#include "src/fsdp/flat_layout.h"

namespace fsdp::checkpoint {

// The pieces inside shard `k` (shard_numel elements per shard), in shard order: the
// runtime's own definition (internal::ShardPieces), `tensor` indexing the unit's TensorSlots.
using internal::ShardPiece;
inline std::vector<ShardPiece> ShardSlotPieces(const std::vector<TensorSlot>& slots,
                                               int64_t shard_numel, int k) {
  return internal::ShardPieces(slots, shard_numel, k);
}

// Elements of shard `k` that hold data (the rest is padding at the unit's end).
int64_t ShardDataNumel(int64_t unit_numel, int64_t shard_numel, int k);

// The optimizer state names of the runtime ("exp_avg", "exp_avg_sq" / "momentum_buffer" /
// none), which every unit must share.
absl::StatusOr<std::vector<std::string>> RuntimeStateNames(ShardingRuntime& runtime);

// "[256, 64]".
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace fsdp::checkpoint
