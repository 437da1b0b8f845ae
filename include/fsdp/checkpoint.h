// Checkpoints of a sharding runtime (docs/checkpoints.md has the format and the protocol).
//
// Sharded checkpoints: every rank writes its own shard file in parallel (parameters and
// optimizer state of its shard, cut into per-tensor pieces, and its own rank state); rank 0
// writes metadata.json (per tensor: global shape, dtype and the element ranges each shard
// file holds) and a COMMIT marker last. A save goes to a temporary directory that is renamed
// into place only when complete, so a crash never leaves a half checkpoint behind nor damages
// an older one. A load may use another world size, mesh, strategy or wrap policy: each rank
// reads just the byte ranges that cover its new shards. Every file is checksummed (CRC32C)
// and verified; any error leaves the model untouched, on every rank.
//
// Full model: one safetensors file (F32 or BF16) with the names and shapes of the registered
// tensors (MODEL_SPEC.md names for the bundled GPT), gathered one unit at a time; importing
// reads only each rank's byte ranges, on any world size.
//
// Every function here is collective over the runtime's world: all ranks call it with the
// same arguments (except TrainingState::rank_state) and get the same status. Call them
// between steps (after Step(), or right after Finalize()), never inside a forward/backward.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/data_position.h"
#include "fsdp/dtype.h"
#include "fsdp/sharding.h"
#include "fsdp/status.h"

namespace fsdp {

// What a training loop needs to resume exactly, besides parameters and optimizer state
// (which come from the runtime).
struct TrainingState {
  // Where the data loader stands (e.g. the GPT's DataLoader::state()); optional.
  std::optional<DataPosition> data;
  // Any other global values of the loop (equal on every rank; rank 0's are saved).
  std::map<std::string, std::string> values;
  // This rank's own bytes, e.g. an RNG state. Restored to the same rank only when the world
  // size is unchanged (see LoadedCheckpoint::rank_state_restored).
  std::string rank_state;
};

struct SaveOptions {
  // Replace an existing checkpoint at `dir` (the old one is renamed aside, the new one renamed
  // in, the old one removed). Off: an existing `dir` is an AlreadyExists error.
  bool overwrite = false;
  // Replace an incomplete or damaged checkpoint at `dir`: a directory holding only checkpoint
  // files (shard-*.bin, metadata.json, COMMIT) but no valid COMMIT marker, which LatestCheckpoint
  // skips and LoadCheckpoint refuses. A run that fell back to an older checkpoint can then save
  // that step again. Off: such a directory is an AlreadyExists error. A directory holding
  // anything else is never replaced.
  bool replace_incomplete = true;
  // Testing only: called on every rank at each point of the save ("shard_written",
  // "metadata_written", "commit_written"); a non-OK status makes the save stop right there as
  // if the process had crashed (the temporary directory is left behind, nothing renamed).
  std::function<absl::Status(std::string_view point)> fault_injection;
  // Save parameters or optimizer state holding inf or NaN. Off: such a save is a
  // FailedPrecondition error on every rank, naming the unit, and nothing is written (a
  // diverged model is not saved as the newest checkpoint to resume from).
  bool allow_nonfinite = false;
};

struct LoadOptions {
  // Off: parameters only (e.g. to fine-tune); the optimizer state and the step counters of
  // the runtime are left as they are.
  bool load_optimizer_state = true;
  // Load parameters or optimizer state holding inf or NaN. Off: a FailedPrecondition error,
  // and nothing is loaded.
  bool allow_nonfinite = false;
};

struct LoadedCheckpoint {
  TrainingState state;  // rank_state: this rank's, when restored
  bool rank_state_restored = false;
  int64_t step = 0;  // the runtime's steps() (the LR schedule position) now
  int saved_world_size = 0;
  std::string saved_strategy;  // "FULL_SHARD", ...
};

// Saves the runtime's parameters, optimizer state and step counters plus `state` to the
// directory `dir`, which appears complete or not at all. Temporary directories of earlier
// crashed saves of the same `dir` (dir.tmp-*) are removed first. An existing `dir` is replaced
// when it is a complete checkpoint and options.overwrite is set, or when it is an incomplete
// or damaged one (options.replace_incomplete); otherwise it is an AlreadyExists error.
absl::Status SaveCheckpoint(ShardingRuntime& runtime, const std::string& dir,
                            const TrainingState& state = {}, const SaveOptions& options = {});

// Loads a checkpoint saved by SaveCheckpoint, on any world size, strategy or wrap policy
// whose tensors have the same names and shapes. Restores the parameters, the optimizer state
// and step of every unit and the runtime's steps(). Errors (a missing COMMIT marker, a
// checksum mismatch, a truncated or missing file, another model) name the file and the
// problem; then nothing is loaded on any rank.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(ShardingRuntime& runtime, const std::string& dir,
                                                const LoadOptions& options = {});

// A subdirectory that LatestCheckpoint passed over: it holds checkpoint files but no valid
// COMMIT marker (missing, damaged, or not matching metadata.json), e.g. a checkpoint damaged
// after it was written. `why` is the DataLoss error that LoadCheckpoint would return for it.
struct SkippedCheckpoint {
  std::string path;
  absl::Status why;
};

// Not collective: the complete checkpoint (with a valid COMMIT marker that matches its
// metadata.json) of the highest step among the subdirectories of `parent`, ties broken by
// name; NotFound when there is none. Temporary directories of saves (NAME.tmp-*) are ignored.
// With `skipped`, it receives (sorted by path) every subdirectory that holds checkpoint files
// but was passed over because its COMMIT marker is missing or damaged, and why: a program
// that resumes should say so, since the checkpoint it resumes from is then not the newest.
// Shard files are not read here; LoadCheckpoint verifies them.
absl::StatusOr<std::string> LatestCheckpoint(const std::string& parent,
                                             std::vector<SkippedCheckpoint>* skipped = nullptr);

// Not collective: removes the temporary directories (NAME.tmp-<pid>-<hex>) that saves which
// crashed left in `parent`, and returns their paths (sorted); an empty list when there is
// none or `parent` does not exist. Call it on one rank at start-up, while no save into
// `parent` is in progress (no other job may be saving there).
absl::StatusOr<std::vector<std::string>> RemoveCheckpointTemporaries(const std::string& parent);

// Not collective: checks that checkpoints can be saved under `parent` before any is: creates
// it (with its parents) when missing, then creates and removes a probe file in it. An error
// naming `parent` and the reason otherwise. For start-up checks, so that a bad directory is
// reported before training rather than at the first save.
absl::Status CheckCheckpointDirWritable(const std::string& parent);

// Not collective: checks that ExportSafetensors can write `path`: `path` is not a directory,
// and its directory exists and accepts a new file (a probe file is created and removed).
absl::Status CheckExportPathWritable(const std::string& path);

struct SafetensorsExportOptions {
  DType dtype = DType::kF32;  // kF32 or kBF16 (kF16 works too)
  // Free-form string pairs for the header's "__metadata__" ("format": "pt" is added unless
  // the caller sets "format").
  std::map<std::string, std::string> metadata;
  // Export parameters holding inf or NaN. Off: a FailedPrecondition error naming the tensor,
  // and no file is written.
  bool allow_nonfinite = false;
};

// Writes every registered tensor to one safetensors file at `path` (atomically: a temporary
// name, fsync, rename). Units are gathered one at a time; rank 0 writes.
absl::Status ExportSafetensors(ShardingRuntime& runtime, const std::string& path,
                               const SafetensorsExportOptions& options = {});

struct SafetensorsImportOptions {
  // Tensors in the file that the runtime lacks: an error unless this is set.
  bool ignore_extra_tensors = false;
  // Import tensors holding inf or NaN. Off: a FailedPrecondition error naming the tensor,
  // and nothing is imported.
  bool allow_nonfinite = false;
};

// Sets the parameters of every registered tensor from a safetensors file (F32, BF16 or F16,
// converted to f32); each rank reads only the bytes of its shards. The optimizer state and
// step counters are not touched.
absl::Status ImportSafetensors(ShardingRuntime& runtime, const std::string& path,
                               const SafetensorsImportOptions& options = {});

}  // namespace fsdp
