// SaveCheckpoint: every rank writes its shard file into a temporary directory, rank 0 adds
// metadata.json and the COMMIT marker, then renames the directory into place. Each phase
// ends with all ranks agreeing on success, so a failure anywhere stops the save everywhere.
// Also the start-up checks that checkpoints and exports can be written where asked.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fsdp/checkpoint.h"
#include "fsdp/files.h"
#include "src/checkpoint/crc32c.h"
#include "src/checkpoint/file_io.h"
#include "src/checkpoint/metadata.h"
#include "src/checkpoint/finite.h"
#include "src/checkpoint/rank_sync.h"
#include "src/checkpoint/shard_file.h"
#include "src/checkpoint/shard_plan.h"
#include "src/checkpoint/sharded_save.h"

namespace fsdp {
namespace checkpoint {
namespace {

static_assert(std::endian::native == std::endian::little, "checkpoint files are little-endian");

struct FileInfo {
  uint64_t bytes = 0;
  uint32_t crc = 0;
};

// This rank's shard file: per unit, its shard's parameters then each optimizer state (data
// elements only, no padding), then the rank state.
absl::StatusOr<FileInfo> WriteShardFile(const SaveLayout& l, const ShardSource& source,
                                        const std::string& path, bool allow_nonfinite) {
  FSDP_ASSIGN_OR_RETURN(OutFile f, OutFile::Create(path));
  uint64_t at = kShardHeaderBytes;
  uint32_t crc = 0;
  std::vector<float> buf;
  auto put = [&](int u, int j, int64_t n, const std::string& what) -> absl::Status {
    FSDP_ASSIGN_OR_RETURN(const float* data, source(u, j, n, buf));
    if (!allow_nonfinite) {
      FSDP_RETURN_IF_ERROR(CheckFinite(
          data, n, absl::StrCat(what, " on rank ", l.world_rank),
          "not saving a checkpoint that training could not resume from (a newer checkpoint "
          "would hide the last good one). SaveOptions::allow_nonfinite saves it anyway"));
    }
    FSDP_RETURN_IF_ERROR(f.WriteAt(at, data, n * sizeof(float)));
    crc = Crc32cExtend(crc, data, n * sizeof(float));
    at += n * sizeof(float);
    return absl::OkStatus();
  };
  if (l.writes_tensors) {
    for (size_t u = 0; u < l.units.size(); ++u) {
      const SaveLayout::Unit& unit = l.units[u];
      if (unit.data_numel == 0) continue;
      const int ui = static_cast<int>(u);
      FSDP_RETURN_IF_ERROR(put(ui, 0, unit.data_numel,
                               absl::StrCat("the parameter shard of the unit starting with '",
                                            unit.name, "'")));
      for (size_t j = 0; j < l.state_names.size(); ++j) {
        FSDP_RETURN_IF_ERROR(put(ui, static_cast<int>(j) + 1, unit.data_numel,
                                 absl::StrCat("the optimizer state '", l.state_names[j],
                                              "' of the unit starting with '", unit.name, "'")));
      }
    }
  }
  ShardHeader h;
  h.rank = static_cast<uint32_t>(l.world_rank);
  h.world_size = static_cast<uint32_t>(l.world_size);
  h.tensor_bytes = at - kShardHeaderBytes;
  h.rank_state_bytes = l.state.rank_state.size();
  FSDP_RETURN_IF_ERROR(f.WriteAt(at, l.state.rank_state.data(), l.state.rank_state.size()));
  h.payload_crc32c = Crc32cExtend(crc, l.state.rank_state.data(), l.state.rank_state.size());
  const std::string header = EncodeShardHeader(h);
  FSDP_RETURN_IF_ERROR(f.WriteAt(0, header.data(), header.size()));
  FSDP_RETURN_IF_ERROR(f.SyncAndClose());
  return FileInfo{h.file_bytes(), h.payload_crc32c};
}

// The metadata rank 0 writes: the piece layout of every writer's file follows from the
// units and the shard size alone, so only sizes and checksums had to be gathered.
CheckpointMetadata BuildMetadata(const SaveLayout& l, const std::vector<uint64_t>& infos) {
  CheckpointMetadata m;
  m.world_size = l.world_size;
  m.replicate_size = l.replicate_size;
  m.shard_size = l.shard_size;
  m.strategy = l.strategy;
  m.optimizer = l.optimizer;
  m.step = l.step;
  m.optimizer_step = l.optimizer_step;
  m.model = l.model;
  m.loss_scale = l.loss_scale.scale;
  m.loss_scale_good_steps = l.loss_scale.good_steps;
  m.skipped_steps = l.loss_scale.skipped_steps;
  m.state_names = l.state_names;
  if (l.state.data) m.data_loader = std::make_pair(l.state.data->seed, l.state.data->step);
  m.values.assign(l.state.values.begin(), l.state.values.end());
  for (int r = 0; r < m.world_size; ++r) {
    m.files.push_back(
        {ShardFileName(r, m.world_size), infos[2 * r], static_cast<uint32_t>(infos[2 * r + 1])});
  }
  const int S = m.shard_size;
  const size_t copies = 1 + m.state_names.size();
  std::vector<uint64_t> base(S, kShardHeaderBytes);  // next unit's block in writer k's file
  for (const SaveLayout::Unit& unit : l.units) {
    const std::vector<TensorSlot>& slots = unit.tensors;
    const size_t first = m.tensors.size();
    for (const TensorSlot& t : slots) {
      m.tensors.push_back(
          {t.name, t.shape, t.numel, {}, std::vector<std::vector<PieceRef>>(m.state_names.size())});
    }
    const int64_t sn = unit.shard_numel;
    for (int k = 0; k < S; ++k) {
      const uint64_t n = ShardDataNumel(unit.numel, sn, k);
      for (const ShardPiece& p : ShardSlotPieces(slots, sn, k)) {
        TensorRecord& t = m.tensors[first + p.tensor];
        const uint64_t off = base[k] + p.shard_offset * sizeof(float);
        t.param.push_back({k, p.tensor_begin, p.tensor_end, off});
        for (size_t j = 0; j < m.state_names.size(); ++j) {
          t.state[j].push_back({k, p.tensor_begin, p.tensor_end, off + (j + 1) * n * 4});
        }
      }
      base[k] += copies * n * sizeof(float);
    }
  }
  return m;
}

// Whether a save may go to `target` as things are now: it does not exist, or it is a
// directory a save may replace (see SaveOptions).
absl::Status CheckTarget(const std::string& target, const SaveOptions& options) {
  const std::string base = BaseName(target);
  if (base.empty() || base == "." || base == "..") {
    return absl::InvalidArgumentError(
        absl::StrCat("'", target, "' is not a checkpoint directory name"));
  }
  if (!PathExists(target)) return absl::OkStatus();
  struct stat st;
  if (::lstat(target.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::AlreadyExistsError(absl::StrCat(
        target, " exists and is ", DescribePath(target),
        ", not a checkpoint directory: a save of it would fail. Remove it or move it away"));
  }
  const absl::StatusOr<CommitRecord> commit = ReadVerifiedCommit(target);
  if (commit.ok() && !options.overwrite) {
    return absl::AlreadyExistsError(absl::StrCat(
        target,
        " already exists; save each checkpoint to a new directory (e.g. step-000100) "
        "or set SaveOptions::overwrite"));
  }
  // An incomplete or damaged checkpoint (no valid COMMIT marker) is replaced like a complete
  // one; a directory holding anything else is never touched.
  if (!commit.ok() && !HoldsOnlyCheckpointFiles(target)) {
    const std::vector<std::string> odd = CheckpointFilesOfOtherKinds(target);
    return absl::AlreadyExistsError(absl::StrCat(
        target, " exists and is not a checkpoint (no valid ", kCommitFile, " marker, and ",
        odd.empty() ? "files a checkpoint does not have"
                    : absl::StrCat("entries a save never writes: ", absl::StrJoin(odd, ", ")),
        "): a save replaces checkpoints only. Remove it or move it away"));
  }
  if (!commit.ok() && !options.replace_incomplete) {
    return absl::AlreadyExistsError(absl::StrCat(
        target, " exists and holds an incomplete or damaged checkpoint (",
        std::string(commit.status().message()), "); set SaveOptions::replace_incomplete"));
  }
  return absl::OkStatus();
}

// Rank 0, before anything is written, under the directory's lock: the target must be free
// (or replaceable), temporary directories of crashed saves are removed, and a new one is made.
absl::StatusOr<std::string> PrepareTemporary(const std::string& target,
                                             const SaveOptions& options) {
  FSDP_RETURN_IF_ERROR(CheckTarget(target, options));
  const std::string parent = ParentOf(target), base = BaseName(target);
  FSDP_RETURN_IF_ERROR(MakeDirectory(parent));
  std::error_code ec;
  const std::string stale = base + ".tmp-";
  for (const auto& e : std::filesystem::directory_iterator(parent, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(stale, 0) == 0 && IsCheckpointTemporaryName(name)) {
      FSDP_RETURN_IF_ERROR(RemoveTree(e.path().string()));
    }
  }
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  const std::string tmp = absl::StrFormat("%s.tmp-%d-%x", target, ::getpid(), now & 0xffffff);
  FSDP_RETURN_IF_ERROR(MakeDirectory(tmp));
  return tmp;
}

// Rank 0: the temporary directory becomes `target`.
absl::Status Publish(const std::string& tmp, const std::string& target) {
  if (!PathExists(target)) return RenameDurably(tmp, target);
  // Not a ".tmp-" name: if we crash between the renames, this is the one complete copy.
  const std::string old =
      absl::StrCat(target, ".old-", BaseName(tmp).substr(BaseName(target).size() + 5));
  FSDP_RETURN_IF_ERROR(RenameDurably(target, old));
  absl::Status s = RenameDurably(tmp, target);
  if (!s.ok()) {
    RenameDurably(old, target).IgnoreError();  // put the previous checkpoint back
    return s;
  }
  return RemoveTree(old);
}

}  // namespace

absl::StatusOr<SaveLayout> TakeSaveLayout(ShardingRuntime& rt, const TrainingState& state) {
  SaveLayout l;
  l.world_rank = rt.world().rank();
  l.world_size = rt.world().size();
  l.replicate_size = rt.replicate_group().size();
  l.shard_size = rt.shard_group().size();
  l.writes_tensors = rt.replicate_group().rank() == 0;  // the other replicas hold equal copies
  l.strategy = std::string(StrategyName(rt.strategy()));
  l.optimizer = dynamic_cast<AdamW*>(&rt.optimizer(0)) != nullptr ? "adamw" : "sgd";
  l.step = rt.steps();
  l.optimizer_step = rt.optimizer(0).step();
  l.model = rt.model_description();
  l.loss_scale = rt.loss_scale_state();
  FSDP_ASSIGN_OR_RETURN(l.state_names, RuntimeStateNames(rt));
  const int k = rt.shard_group().rank();
  for (int u = 0; u < rt.num_units(); ++u) {
    if (rt.optimizer(u).step() != l.optimizer_step) {
      return absl::FailedPreconditionError(
          absl::StrCat("the optimizers of units 0 and ", u, " are at different steps (",
                       l.optimizer_step, " and ", rt.optimizer(u).step(), ")"));
    }
    SaveLayout::Unit unit;
    unit.tensors = rt.unit_tensors(u);
    unit.name = unit.tensors.empty() ? std::to_string(u) : unit.tensors.front().name;
    unit.numel = rt.unit_numel(u);
    unit.shard_numel = rt.unit_shard_numel(u);
    unit.data_numel = ShardDataNumel(unit.numel, unit.shard_numel, k);
    l.units.push_back(std::move(unit));
  }
  l.state = state;
  return l;
}

uint64_t SaveLayout::shard_data_bytes() const {
  if (!writes_tensors) return 0;
  uint64_t n = 0;
  for (const Unit& u : units) n += static_cast<uint64_t>(u.data_numel);
  return n * (1 + state_names.size()) * sizeof(float);
}

ShardSource DeviceShardSource(ShardingRuntime& rt) {
  return [&rt](int u, int j, int64_t n, std::vector<float>& buf) -> absl::StatusOr<const float*> {
    const View device = j == 0 ? rt.param_shard(u) : rt.optimizer(u).state()[j - 1].data;
    buf.resize(n);
    // The view's own backend: an offloaded unit's optimizer state is in host memory.
    FSDP_RETURN_IF_ERROR(device.backend->CopyToHost(buf.data(), device.Slice(0, n)));
    return buf.data();
  };
}

absl::Status WriteCheckpoint(Communicator& world, const SaveLayout& layout,
                             const ShardSource& source, const std::string& dir,
                             const SaveOptions& options) {
  const bool root = world.rank() == 0;
  std::string target = dir;
  while (target.size() > 1 && target.back() == '/') target.pop_back();

  absl::Status local;
  std::string tmp;
  // Rank 0 holds the directory's lock for the whole save: another job's start-up cleanup
  // cannot take this save's temporary directory for a crashed one.
  std::optional<CheckpointDirLock> lock;
  if (root) {
    absl::StatusOr<CheckpointDirLock> l = CheckpointDirLock::Acquire(ParentOf(target));
    local = l.status();
    if (l.ok()) lock.emplace(*std::move(l));
  }
  if (root && local.ok()) {
    auto t = PrepareTemporary(target, options);
    local = t.status();
    if (t.ok()) tmp = *t;
  }
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(world, local));
  FSDP_ASSIGN_OR_RETURN(tmp, BroadcastString(world, tmp, 0, 8192));

  // A fault injected by a test stops the save as a crash would: nothing is cleaned up.
  bool crashed = false;
  auto hook = [&](std::string_view point) {
    if (!options.fault_injection || !local.ok()) return;
    absl::Status s = options.fault_injection(point);
    if (!s.ok()) {
      crashed = true;
      local = absl::Status(s.code(), absl::StrCat("save interrupted at ", std::string(point), ": ",
                                                  std::string(s.message())));
    }
  };
  // Ends a phase: on failure anywhere, rank 0 removes the temporary directory (unless a
  // simulated crash is in progress) and every rank returns the same error.
  auto end_phase = [&]() -> absl::Status {
    absl::Status agreed = AgreeOnStatus(world, local);
    if (agreed.ok()) return agreed;
    const float mine = crashed ? 1.0f : 0.0f;
    float any = 0;
    absl::Status s = world.AllReduce(&mine, &any, 1, DType::kF32, ReduceOp::kMax);
    if (root && s.ok() && any == 0.0f) RemoveTree(tmp).IgnoreError();
    return agreed;
  };

  FileInfo info;
  {
    auto written = WriteShardFile(
        layout, source, absl::StrCat(tmp, "/", ShardFileName(world.rank(), world.size())),
        options.allow_nonfinite);
    local = written.status();
    if (written.ok()) info = *written;
  }
  hook("shard_written");
  FSDP_RETURN_IF_ERROR(end_phase());
  FSDP_ASSIGN_OR_RETURN(std::vector<uint64_t> infos, AllGatherU64(world, {info.bytes, info.crc}));

  const int64_t step = layout.step;
  if (root) {
    const CheckpointMetadata meta = BuildMetadata(layout, infos);
    {
      const std::string text = SerializeMetadata(meta);
      local = WriteFileDurably(absl::StrCat(tmp, "/", kMetadataFile), text);
      hook("metadata_written");
      if (local.ok()) {
        local = WriteFileDurably(absl::StrCat(tmp, "/", kCommitFile),
                                 EncodeCommit({step, text.size(), Crc32c(text)}));
      }
      if (local.ok()) local = SyncDirectory(tmp);
      hook("commit_written");
    }
  } else {
    hook("metadata_written");
    hook("commit_written");
  }
  FSDP_RETURN_IF_ERROR(end_phase());

  if (root) local = Publish(tmp, target);
  return end_phase();
}

}  // namespace checkpoint

absl::Status SaveCheckpoint(ShardingRuntime& rt, const std::string& dir, const TrainingState& state,
                            const SaveOptions& options) {
  using namespace checkpoint;  // NOLINT: this file's own helpers
  absl::StatusOr<SaveLayout> layout = TakeSaveLayout(rt, state);
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(rt.world(), layout.status()));
  return WriteCheckpoint(rt.world(), *layout, DeviceShardSource(rt), dir, options);
}

absl::Status CheckCheckpointDirWritable(const std::string& parent) {
  using namespace checkpoint;  // NOLINT: this file's own helpers
  if (parent.empty()) return absl::InvalidArgumentError("the checkpoint directory name is empty");
  auto fail = [&](absl::StatusCode code, std::string_view why) {
    return absl::Status(code, absl::StrCat("cannot save checkpoints in ", parent, ": ",
                                           std::string(why)));
  };
  std::error_code ec;
  if (PathExists(parent) && !std::filesystem::is_directory(parent, ec)) {
    return fail(absl::StatusCode::kFailedPrecondition, "it exists and is not a directory");
  }
  std::filesystem::create_directories(parent, ec);
  if (ec) {
    return fail(ec == std::errc::permission_denied ? absl::StatusCode::kPermissionDenied
                                                   : absl::StatusCode::kFailedPrecondition,
                absl::StrCat("cannot create the directory: ", ec.message()));
  }
  // O_EXCL: a new file of our own, never whatever (a FIFO, a link) happens to have the name.
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  const std::string probe =
      absl::StrFormat("%s/.fsdp-write-probe-%d-%x", parent, ::getpid(), now & 0xffffff);
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return fail(err == EACCES || err == EPERM ? absl::StatusCode::kPermissionDenied
                                              : absl::StatusCode::kFailedPrecondition,
                absl::StrCat("cannot create a file in it: ", std::strerror(err)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

uint64_t CheckpointBytes(int64_t num_parameters, int64_t num_tensors, int optimizer_states,
                         int world_size) {
  const uint64_t p = static_cast<uint64_t>(std::max<int64_t>(0, num_parameters));
  const uint64_t t = static_cast<uint64_t>(std::max<int64_t>(0, num_tensors));
  const uint64_t w = static_cast<uint64_t>(std::max(1, world_size));
  const uint64_t copies = 1 + static_cast<uint64_t>(std::max(0, optimizer_states));
  // Each shard boundary splits at most one tensor: at most t + w pieces per copy, each a
  // JSON array of four integers; per tensor a name and a shape; per file a record.
  const uint64_t metadata = 4096 + t * 512 + (t + w) * copies * 96 + w * 160;
  return p * 4 * copies + w * (checkpoint::kShardHeaderBytes + 64) + metadata + 256;
}

uint64_t SafetensorsExportBytes(int64_t num_parameters, int64_t num_tensors, DType dtype) {
  const uint64_t p = static_cast<uint64_t>(std::max<int64_t>(0, num_parameters));
  const uint64_t t = static_cast<uint64_t>(std::max<int64_t>(0, num_tensors));
  return 8 + 4096 + t * 256 + p * DTypeSize(dtype);
}

absl::Status CheckCanSaveCheckpoint(const std::string& dir, const SaveOptions& options) {
  std::string target = dir;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  return checkpoint::CheckTarget(target, options);
}

absl::Status CheckExportPathWritable(const std::string& path,
                                     const std::vector<std::string>& inputs) {
  using namespace checkpoint;  // NOLINT: this file's own helpers
  auto fail = [&](absl::StatusCode code, std::string_view why) {
    return absl::Status(code, absl::StrCat("cannot export to ", path, ": ", std::string(why)));
  };
  struct stat st;
  if (path.empty() || path.back() == '/' ||
      (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))) {
    return fail(absl::StatusCode::kInvalidArgument, "it names a directory, not a file");
  }
  FSDP_RETURN_IF_ERROR(CheckOutputPath(path, kSafetensorsFile, inputs, "export to"));
  const std::string dir = ParentOf(path);
  const std::string probe = absl::StrFormat("%s.write-probe-%d", path, ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int err = errno;
    return fail(err == EACCES || err == EPERM ? absl::StatusCode::kPermissionDenied
                                              : absl::StatusCode::kFailedPrecondition,
                absl::StrCat("cannot create a file in ", dir, ": ", std::strerror(err)));
  }
  ::close(fd);
  ::unlink(probe.c_str());
  return absl::OkStatus();
}

}  // namespace fsdp
