// metadata.json of a sharded checkpoint: for every tensor its global shape and dtype and, per
// shard file, the element ranges held and their byte offsets (parameters and each optimizer
// state alike), plus the shard files' sizes and checksums and the training state.
// Serialisation and checked parsing (hostile input: fuzzed); no I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/status.h"

namespace fsdp::checkpoint {

// Elements [begin, end) of a tensor, stored in shard file `file` from byte `offset` on.
struct PieceRef {
  int file = 0;
  int64_t begin = 0, end = 0;
  uint64_t offset = 0;
};

struct TensorRecord {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  std::vector<PieceRef> param;               // sorted by begin, tiling [0, numel)
  std::vector<std::vector<PieceRef>> state;  // one list per CheckpointMetadata::state_names
};

struct ShardFileRecord {
  std::string name;  // ShardFileName(rank, world_size)
  uint64_t bytes = 0;
  uint32_t crc32c = 0;  // of the payload (all bytes after the 64-byte header)
};

struct CheckpointMetadata {
  int world_size = 1;
  int replicate_size = 1, shard_size = 1;
  std::string strategy;        // informative: "FULL_SHARD", ...
  std::string optimizer;       // "adamw" or "sgd"
  int64_t step = 0;            // ShardingRuntime::steps()
  int64_t optimizer_step = 0;  // Optimizer::step() of every unit
  // The dynamic loss scaler (ShardingRuntime::LossScaleState).
  float loss_scale = 1.0f;
  int64_t loss_scale_good_steps = 0;
  int64_t skipped_steps = 0;
  std::vector<std::string> state_names;  // "exp_avg", "exp_avg_sq" / "momentum_buffer" / none
  std::vector<ShardFileRecord> files;    // one per rank of the saving world
  std::vector<TensorRecord> tensors;     // in the saving runtime's unit order
  std::optional<std::pair<uint64_t, int64_t>> data_loader;  // DataLoaderState (seed, step)
  std::vector<std::pair<std::string, std::string>> values;  // TrainingState::values
  // ShardingRuntime::model_description() of the saving runtime; empty in checkpoints that
  // predate it (then nothing is compared at load).
  std::vector<std::pair<std::string, std::string>> model;
};

std::string SerializeMetadata(const CheckpointMetadata& m);

using ModelDescription = std::vector<std::pair<std::string, std::string>>;
// How the model a file records differs from `current` (ShardingRuntime::model_description),
// one line per key, e.g. "num_heads: 4 in the checkpoint, 2 in this model", for every key
// of either but "name"; `file` names the file's side ("the checkpoint"). Empty when either
// description is empty (nothing to compare) or they agree.
std::vector<std::string> ModelDifferences(const ModelDescription& saved,
                                          const ModelDescription& current, std::string_view file);

// Parses and checks everything that can be checked without the files: field types, names
// of the shard files (no paths), element ranges inside each tensor and tiling it, byte
// ranges inside each file and not overlapping each other. Errors name metadata.json.
absl::StatusOr<CheckpointMetadata> ParseMetadata(std::string_view text);

}  // namespace fsdp::checkpoint
