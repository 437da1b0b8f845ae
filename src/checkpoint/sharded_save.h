// The save protocol of sharded_save.cc in two halves, so that a save can run on another thread
// than training (async_save.cc): what the runtime holds between two steps (the layout and the
// values a checkpoint records), and the protocol that writes it through a source of the rank's
// shard data over a communicator of the same ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint.h"
#include "fsdp/sharding.h"

namespace fsdp::checkpoint {

// Everything a checkpoint records besides the shard data, taken from the runtime between steps.
struct SaveLayout {
  struct Unit {
    std::vector<TensorSlot> tensors;
    std::string name;  // its first tensor's, for messages
    int64_t numel = 0, shard_numel = 0;
    int64_t data_numel = 0;  // this rank's shard without padding
  };
  int world_rank = 0, world_size = 1, replicate_size = 1, shard_size = 1;
  bool writes_tensors = true;  // replicate index 0: the other replicas hold equal copies
  std::string strategy, optimizer;
  int64_t step = 0, optimizer_step = 0;
  std::vector<std::pair<std::string, std::string>> model;
  ShardingRuntime::LossScaleState loss_scale;
  std::vector<std::string> state_names;  // the optimizer's, in state() order
  std::vector<Unit> units;
  TrainingState state;
  // The bytes of this rank's shard data a save writes (parameters and optimizer states).
  uint64_t shard_data_bytes() const;
};

// Not collective: the layout now (FailedPrecondition when the units' optimizers disagree).
absl::StatusOr<SaveLayout> TakeSaveLayout(ShardingRuntime& rt, const TrainingState& state);

// This rank's shard data of unit u, copy j (0: the parameters, 1 + i: optimizer state i), n
// elements: a pointer valid until the next call, using `buf` when it copies.
using ShardSource = std::function<absl::StatusOr<const float*>(int u, int j, int64_t n,
                                                               std::vector<float>& buf)>;
// The runtime's shards, copied from the device one piece at a time.
ShardSource DeviceShardSource(ShardingRuntime& rt);

// Collective over `world` (the runtime's ranks, in the same order): SaveCheckpoint's protocol
// for `layout` and `source`.
absl::Status WriteCheckpoint(Communicator& world, const SaveLayout& layout,
                             const ShardSource& source, const std::string& dir,
                             const SaveOptions& options);

}  // namespace fsdp::checkpoint
