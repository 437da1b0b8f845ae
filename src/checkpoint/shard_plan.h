// Which pieces of which tensors a rank's shard of a unit holds: shard k of a unit is
// elements [k * shard_numel, (k + 1) * shard_numel) of the unit's padded flat buffer, and
// each tensor occupies [offset, offset + numel) of it (TensorSlot). Shared by the sharded
// save/load and the safetensors export/import.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/sharding.h"

namespace fsdp::checkpoint {

struct SlotPiece {
  int slot = 0;              // index into the unit's TensorSlots
  int64_t tensor_begin = 0;  // elements [tensor_begin, tensor_end) of that tensor
  int64_t tensor_end = 0;
  int64_t shard_offset = 0;  // where tensor_begin sits in the shard
};

// The pieces inside shard `k` (shard_numel elements per shard), in shard order.
std::vector<SlotPiece> ShardSlotPieces(const std::vector<TensorSlot>& slots, int64_t shard_numel,
                                       int k);

// Elements of shard `k` that hold data (the rest is padding at the unit's end).
int64_t ShardDataNumel(int64_t unit_numel, int64_t shard_numel, int k);

// The optimizer state names of the runtime ("exp_avg", "exp_avg_sq" / "momentum_buffer" /
// none), which every unit must share.
absl::StatusOr<std::vector<std::string>> RuntimeStateNames(ShardingRuntime& runtime);

// "[256, 64]".
std::string ShapeString(const std::vector<int64_t>& shape);

}  // namespace fsdp::checkpoint
