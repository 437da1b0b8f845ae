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
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/time/time.h"
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
  // Load a checkpoint whose recorded model configuration differs from the runtime's
  // (ShardingRuntime::model_description), e.g. to change the number of heads on purpose; the
  // tensors must still have the same names and shapes. Off: a FailedPrecondition error naming
  // every field that differs, with both values, and nothing is loaded.
  bool allow_model_change = false;
};

struct LoadedCheckpoint {
  TrainingState state;  // rank_state: this rank's, when restored
  bool rank_state_restored = false;
  int64_t step = 0;  // the runtime's steps() (the LR schedule position) now
  int saved_world_size = 0;
  std::string saved_strategy;  // "FULL_SHARD", ...
  // Whether the checkpoint recorded its model configuration (checkpoints of older versions
  // did not: then it was not compared), and, under LoadOptions::allow_model_change, how it
  // differs from this runtime's ("num_heads: 4 in the checkpoint, 2 in this model").
  bool model_recorded = false;
  std::vector<std::string> model_changes;
};

// Saves the runtime's parameters, optimizer state and step counters plus `state` to the
// directory `dir`, which appears complete or not at all. Temporary directories of earlier
// crashed saves of the same `dir` (dir.tmp-*) are removed first. An existing `dir` is replaced
// when it is a complete checkpoint and options.overwrite is set, or when it is an incomplete
// or damaged one (options.replace_incomplete); otherwise it is an AlreadyExists error.
absl::Status SaveCheckpoint(ShardingRuntime& runtime, const std::string& dir,
                            const TrainingState& state = {}, const SaveOptions& options = {});

// ---- asynchronous saves ----------------------------------------------------------------------

struct AsyncSaveOptions {
  // A save asked for while the previous one is still being written: false waits for it (the
  // training thread blocks until it is durable); true skips the new one (Save returns
  // kSkipped). The ranks agree, so they all wait or all skip.
  bool skip_when_busy = false;
  // A bound on one snapshot's host memory on a rank (snapshot_bytes()); 0: none. A save over
  // it, or one the host cannot allocate, is refused on every rank before anything is copied,
  // and training goes on.
  uint64_t max_snapshot_bytes = 0;
  // How long Shutdown (and the destructor) waits for a save in flight before it gives up.
  absl::Duration shutdown_deadline = absl::Minutes(10);
};

enum class AsyncSaveStart { kStarted, kSkipped };

// The outcome of one background save.
struct AsyncSaveResult {
  std::string dir;
  absl::Status status;            // as SaveCheckpoint's
  double snapshot_seconds = 0;    // what Save blocked training for (agreement and copies)
  double write_seconds = 0;       // the background write, to the rename
};

// Saves that do not stop training (docs/checkpoints.md, "Asynchronous saves"). Save() takes
// this rank's shards (parameters and optimizer state) to host memory and returns; a writer
// thread per rank then runs SaveCheckpoint's protocol on that snapshot: every rank writes and
// fsyncs its shard file, the ranks agree (over their own group, split from the world at
// Create, never from the training thread), rank 0 writes metadata.json and COMMIT only after
// every rank's file is durable, and the directory is renamed into place. A crash during the
// background write leaves the previous checkpoint intact, as for a synchronous save. At most
// one save is in flight. One object per rank, used from the rank's training thread; destroy it
// before the runtime and its world (its writers' group is split from that world).
class AsyncCheckpointer {
 public:
  // Collective over the runtime's world.
  static absl::StatusOr<std::unique_ptr<AsyncCheckpointer>> Create(
      ShardingRuntime& runtime, const AsyncSaveOptions& options = {});
  // Shutdown(options.shutdown_deadline); an error is printed, as a destructor cannot return it.
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Collective, between steps, with SaveCheckpoint's arguments. Returns once the snapshot is
  // taken (kStarted), or at once when a save is in flight and skip_when_busy (kSkipped). An
  // error here (the snapshot's memory, the runtime) is the same on every rank and nothing is
  // written; the background write's outcome comes from TakeFinished() and Wait().
  absl::StatusOr<AsyncSaveStart> Save(const std::string& dir, const TrainingState& state = {},
                                      const SaveOptions& options = {});
  // Not collective: the saves that finished since the last call, in order.
  std::vector<AsyncSaveResult> TakeFinished();
  // Not collective: waits for this rank's save in flight; the latest finished save's status
  // (OK when there was none). DeadlineExceeded, naming the directory, when it is still being
  // written after `deadline`.
  absl::Status Wait(absl::Duration deadline = absl::InfiniteDuration());
  // Waits as Wait does; past the deadline it aborts the writers' group (the save fails on every
  // rank; its temporary directory is left as after a crash) and returns the DeadlineExceeded
  // error. Later Saves are refused.
  absl::Status Shutdown(absl::Duration deadline);
  bool in_flight() const;
  // The host bytes of one snapshot on this rank: its shard's parameters and optimizer state.
  uint64_t snapshot_bytes() const;

 private:
  struct State;
  explicit AsyncCheckpointer(std::unique_ptr<State> state);
  std::unique_ptr<State> s_;
};

// Loads a checkpoint saved by SaveCheckpoint, on any world size, strategy or wrap policy
// whose tensors have the same names and shapes. Restores the parameters, the optimizer state
// and step of every unit and the runtime's steps(). Errors (a missing COMMIT marker, a
// checksum mismatch, a truncated or missing file, another model) name the file and the
// problem; then nothing is loaded on any rank.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(ShardingRuntime& runtime, const std::string& dir,
                                                const LoadOptions& options = {});

// Not collective: the step that the verified COMMIT marker of checkpoint `dir` records (the
// runtime's steps() when it was saved). The errors of LatestCheckpoint's check.
absl::StatusOr<int64_t> CheckpointStep(const std::string& dir);

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

// Collective over `world`: verifies every file of checkpoint `dir` completely (the COMMIT
// marker, metadata.json, and each shard file's header, size and CRC32C), the shard files split
// among the ranks (file f on rank f % world.size()). OK on every rank, or on every rank the
// DataLoss error naming the first damaged file and why ("rank 1: DIR/shard-00001-of-00002.bin:
// checksum mismatch ..."). LoadCheckpoint verifies what it reads as well; this checks the
// files no rank would read (the optimizer state under load_optimizer_state = false, the other
// ranks' rank state) and tells a damaged checkpoint from a model that does not fit it.
absl::Status VerifyCheckpoint(Communicator& world, const std::string& dir);

struct ResumeOptions {
  LoadOptions load;
  // A checkpoint with a valid COMMIT marker one of whose files is damaged or missing: passed
  // over (reported in ResumedCheckpoint::skipped with the file and the reason) for the next
  // older intact one, as a checkpoint without a valid COMMIT marker always is. Off: the
  // DataLoss error naming the file, and nothing is loaded. A damaged checkpoint directory that
  // holds anything but regular checkpoint files (a FIFO in place of a shard file, a file of the
  // user's) is never passed over: a save of that name could not replace it without removing
  // what is not a checkpoint's; the error names the entries.
  bool fallback = true;
};

struct ResumedCheckpoint {
  // The checkpoint loaded; empty when there is none to resume from (nothing loaded: start
  // from the beginning), e.g. a new run, or every checkpoint passed over.
  std::string path;
  LoadedCheckpoint loaded;  // when `path` is set
  // Every checkpoint passed over, sorted by path, with why: no valid COMMIT marker, or (with
  // fallback) a damaged file. A program that resumes should say so.
  std::vector<SkippedCheckpoint> skipped;
};

// Collective: resumes from the newest intact checkpoint among the subdirectories of `parent`
// (the candidates of LatestCheckpoint, newest first). Each candidate's files are verified in
// full (VerifyCheckpoint) before anything is loaded; a damaged one is passed over, or is an
// error under fallback = false. Errors that are not damage (another model, non-finite values,
// the ranks listing different checkpoints) are returned as they are, with nothing loaded.
absl::StatusOr<ResumedCheckpoint> ResumeFromLatestCheckpoint(ShardingRuntime& runtime,
                                                             const std::string& parent,
                                                             const ResumeOptions& options = {});

// The lock file of a checkpoint directory (see CheckpointDirLock).
inline constexpr char kCheckpointLockFile[] = ".fsdp-lock";

// An advisory lock on a checkpoint directory, so that two jobs never save into one directory
// (each would remove the other's saves in flight as crashed ones). flock(2) on
// PARENT/.fsdp-lock, which records the holder (pid, host, start time, command line); the
// kernel releases it when the process ends, however it ends. Counted inside a process: a
// trainer holds it for its run, and SaveCheckpoint and CleanUpCheckpointDirectory take it
// again without conflict. Take it on one rank (rank 0). On a file system without locks it is
// not held (locked() is false) and nothing is refused.
class CheckpointDirLock {
 public:
  // Not collective. Creates `parent` when missing. FailedPrecondition naming the holder when
  // another process holds the lock, or when the lock file is not a regular file.
  static absl::StatusOr<CheckpointDirLock> Acquire(const std::string& parent);
  CheckpointDirLock(CheckpointDirLock&& o) noexcept;
  CheckpointDirLock& operator=(CheckpointDirLock&&) = delete;
  ~CheckpointDirLock();
  bool locked() const { return locked_; }

 private:
  CheckpointDirLock(uint64_t dev, uint64_t ino) : dev_(dev), ino_(ino) {}
  uint64_t dev_ = 0, ino_ = 0;
  bool active_ = true;
  bool locked_ = true;
};

// What CleanUpCheckpointDirectory did with one entry.
struct CheckpointCleanup {
  std::string path;
  // "removed: the temporary directory of a save that did not finish", "removed: the old copy
  // of step-4, which a finished save replaced", "restored as step-4: ...".
  std::string action;
};

// Not collective, under the directory's lock (CheckpointDirLock; it fails when another job
// holds it): removes what saves that crashed left in `parent`, and only that:
//  - the temporary directories of saves (NAME.tmp-<pid>-<hex>);
//  - the old copy of a replaced checkpoint (NAME.old-<pid>-<hex>) once NAME is complete; when
//    NAME is missing (a crash between the two renames of the replacement), the complete one
//    of the new and the old copy is renamed back to NAME instead (the new one first).
// Returns what it did (sorted by path); nothing when `parent` does not exist. Call it on one
// rank at start-up.
absl::StatusOr<std::vector<CheckpointCleanup>> CleanUpCheckpointDirectory(
    const std::string& parent);

// CleanUpCheckpointDirectory, returning the paths it removed or restored.
absl::StatusOr<std::vector<std::string>> RemoveCheckpointTemporaries(const std::string& parent);

// Not collective: whether SaveCheckpoint(dir, ..., options) could save at `dir` as things are
// now, without writing anything. OK when `dir` does not exist or holds what the save may
// replace; otherwise the AlreadyExists or FailedPrecondition error the save would return,
// naming what is in the way (a file where the directory would go, a directory of other files,
// a COMMIT that is a FIFO, ...). For start-up checks, so that a save is not refused after
// hours of training.
absl::Status CheckCanSaveCheckpoint(const std::string& dir, const SaveOptions& options = {});

// The bytes one checkpoint takes on disk (an upper bound within a few KiB): the shard files'
// f32 data (each parameter and `optimizer_states` states per parameter: 2 for AdamW), their
// headers, metadata.json and COMMIT, for a model of `num_parameters` parameters in
// `num_tensors` tensors saved by `world_size` ranks. For the start-up check of free space.
uint64_t CheckpointBytes(int64_t num_parameters, int64_t num_tensors, int optimizer_states,
                         int world_size);
// The bytes of a safetensors export of the same model in `dtype` (an upper bound).
uint64_t SafetensorsExportBytes(int64_t num_parameters, int64_t num_tensors, DType dtype);

// Not collective: checks that checkpoints can be saved under `parent` before any is: creates
// it (with its parents) when missing, then creates and removes a probe file in it. An error
// naming `parent` and the reason otherwise. For start-up checks, so that a bad directory is
// reported before training rather than at the first save.
absl::Status CheckCheckpointDirWritable(const std::string& parent);

// Not collective: checks that ExportSafetensors can write `path`: a new file or a safetensors
// file (never a directory, device, FIFO, symbolic link or a file of another kind), not the
// same file as any of `inputs` ("--data=PATH" or a path: what the program reads), in a
// directory that exists and accepts a new file (a probe file is created and removed).
absl::Status CheckExportPathWritable(const std::string& path,
                                     const std::vector<std::string>& inputs = {});

// Not collective: removes the temporary files that exports to `path` which were killed left
// beside it (PATH.tmp-<pid>: regular files that no live export holds locked), and returns
// their paths. Call it on the rank that exports, at start-up.
absl::StatusOr<std::vector<std::string>> RemoveDeadExportTemporaries(const std::string& path);

struct SafetensorsExportOptions {
  DType dtype = DType::kF32;  // kF32 or kBF16 (kF16 works too)
  // Free-form string pairs for the header's "__metadata__" ("format": "pt" is added unless
  // the caller sets "format").
  std::map<std::string, std::string> metadata;
  // Export parameters holding inf or NaN. Off: a FailedPrecondition error naming the tensor,
  // and no file is written.
  bool allow_nonfinite = false;
  // ExportSafetensorsDirectory: the largest file it writes, as transformers' max_shard_size
  // (5 GB by default, as there); a tensor larger than this has a file of its own.
  uint64_t max_file_bytes = 5'000'000'000;
  // A bound on the host memory an export takes on a rank (SafetensorsExportReport::
  // host_bytes_per_rank); 0: none. Over it: ResourceExhausted before anything is written.
  uint64_t max_host_bytes = 0;
  // ExportSafetensorsDirectory: more files written beside the model's, by name (e.g.
  // "config.json" from nn::HuggingFaceConfigJson, so that from_pretrained loads the directory).
  std::map<std::string, std::string> extra_files;
};

// What ExportSafetensorsDirectory wrote.
struct SafetensorsExportReport {
  int files = 0;            // safetensors files
  uint64_t total_size = 0;  // the tensors' bytes (the index's metadata.total_size)
  // The host memory the export held at its peak on a rank: the largest unit gathered (f32)
  // plus its largest tensor encoded; the same on every rank of the gathering group.
  uint64_t host_bytes_per_rank = 0;
};

// The "__metadata__" keys of an export that record the runtime's model description: the
// prefix, then the description's key ("libfsdp.model.num_heads").
inline constexpr char kSafetensorsModelKeyPrefix[] = "libfsdp.model.";

// Writes every registered tensor to one safetensors file at `path` (atomically: a temporary
// name PATH.tmp-<pid>, fsync, rename), with the runtime's model description in its
// "__metadata__" (kSafetensorsModelKeyPrefix). Units are gathered one at a time; rank 0
// writes. `path` must be new or a safetensors file (see CheckExportPathWritable): anything
// else is a FailedPrecondition error and nothing is written.
absl::Status ExportSafetensors(ShardingRuntime& runtime, const std::string& path,
                               const SafetensorsExportOptions& options = {});

// Writes every registered tensor in the Hugging Face layout to the directory `dir`, as
// save_pretrained does: model.safetensors when the tensors fit in options.max_file_bytes,
// otherwise model-0000K-of-0000N.safetensors (tensors in order, a file closed before it would
// pass the limit) and model.safetensors.index.json ({"metadata": {"total_parameters": N,
// "total_size": BYTES}, "weight_map": {NAME: FILE}}), plus options.extra_files; every file has ExportSafetensors'
// "__metadata__". Units are gathered one at a time and rank 0 writes each tensor at its offset,
// so no rank holds more than host_bytes_per_rank. Atomic: written into DIR.tmp-<pid> and
// renamed; `dir` must be new, empty, or an earlier export (only safetensors files, indexes,
// config.json and options.extra_files' names), which is replaced; anything else is a
// FailedPrecondition error and nothing is written.
absl::StatusOr<SafetensorsExportReport> ExportSafetensorsDirectory(
    ShardingRuntime& runtime, const std::string& dir, const SafetensorsExportOptions& options = {});

// Not collective: whether ExportSafetensorsDirectory could write `dir` now: it is new, empty or
// an earlier export (only safetensors files, indexes, config.json and `extra_files`), and a
// directory can be created beside it. The FailedPrecondition error the export would return
// otherwise. For start-up checks.
absl::Status CheckExportDirectoryWritable(const std::string& dir,
                                          const std::vector<std::string>& extra_files = {});

struct SafetensorsImportOptions {
  // Tensors in the file that the runtime lacks: an error unless this is set.
  bool ignore_extra_tensors = false;
  // Import tensors holding inf or NaN. Off: a FailedPrecondition error naming the tensor,
  // and nothing is imported.
  bool allow_nonfinite = false;
  // Import a file whose recorded model configuration (kSafetensorsModelKeyPrefix keys, as
  // ExportSafetensors writes them) differs from the runtime's. Off: a FailedPrecondition
  // error naming every field that differs. A file without them (from another library) is
  // matched by tensor names and shapes only.
  bool allow_model_change = false;
};

// Sets the parameters of every registered tensor from safetensors (F32, BF16 or F16, converted
// to f32); each rank reads only the bytes of its shards. `path` is a safetensors file, an index
// (NAME.safetensors.index.json, its files beside it), or a directory in the Hugging Face layout
// (its one index, else its model.safetensors or only safetensors file). An index is checked
// against its files first: a file it names that is missing or not safetensors, a tensor it
// maps to a file that lacks it, a tensor in two files or in none of the map, a total_size that
// is not the tensors' bytes, more than one index in a directory: each an error naming the file
// and the tensor. The optimizer state and step counters are not touched.
absl::Status ImportSafetensors(ShardingRuntime& runtime, const std::string& path,
                               const SafetensorsImportOptions& options = {});

}  // namespace fsdp
