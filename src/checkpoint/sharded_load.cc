// LoadCheckpoint (with resharding), LatestCheckpoint (reporting the damaged checkpoints it
// skips), VerifyCheckpoint and ResumeFromLatestCheckpoint (falling back past a damaged one),
// and RemoveCheckpointTemporaries. Each rank checks the COMMIT marker
// and metadata.json, matches the checkpoint's tensors with the runtime's, works out which
// byte ranges of which shard files cover its new shards, verifies those files' checksums,
// reads the ranges into host staging buffers, and only after every rank has succeeded copies
// them into the live shards.
#include <algorithm>
#include <bit>
#include <filesystem>
#include <functional>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/checkpoint.h"
#include "src/checkpoint/crc32c.h"
#include "src/checkpoint/file_io.h"
#include "src/checkpoint/metadata.h"
#include "src/checkpoint/finite.h"
#include "src/checkpoint/rank_sync.h"
#include "src/checkpoint/shard_file.h"
#include "src/checkpoint/shard_plan.h"

namespace fsdp {
namespace checkpoint {
namespace {

static_assert(std::endian::native == std::endian::little, "checkpoint files are little-endian");

void SortByPath(std::vector<SkippedCheckpoint>& v) {
  std::sort(v.begin(), v.end(), [](const SkippedCheckpoint& a, const SkippedCheckpoint& b) {
    return a.path < b.path;
  });
}

struct Read {
  uint64_t offset = 0;
  size_t bytes = 0;
  void* dest = nullptr;
};

// Everything a rank loads, staged on the host before anything live is touched.
struct Staged {
  CheckpointMetadata meta;
  std::vector<std::vector<float>> params;               // per unit, a whole new shard
  std::vector<std::vector<std::vector<float>>> states;  // per unit, per runtime state
  std::string rank_state;
  bool rank_state_restored = false;
  std::vector<std::string> model_changes;  // accepted under LoadOptions::allow_model_change
};

absl::StatusOr<CheckpointMetadata> ReadMetadata(const std::string& dir) {
  std::string text;
  FSDP_RETURN_IF_ERROR(ReadVerifiedCommit(dir, &text).status());
  absl::StatusOr<CheckpointMetadata> meta = ParseMetadata(text);
  if (!meta.ok()) {
    return absl::DataLossError(absl::StrCat(dir, "/", std::string(meta.status().message())));
  }
  return meta;
}

// The checkpoint must hold exactly the runtime's tensors, with the same shapes. Returns, per
// unit and slot, the index of the tensor in the metadata.
absl::StatusOr<std::vector<std::vector<int>>> MatchTensors(ShardingRuntime& rt,
                                                           const CheckpointMetadata& m,
                                                           const std::string& dir) {
  std::map<std::string, int> index;
  for (size_t i = 0; i < m.tensors.size(); ++i) index[m.tensors[i].name] = static_cast<int>(i);
  std::vector<std::vector<int>> out(rt.num_units());
  std::vector<bool> used(m.tensors.size(), false);
  const std::string other = absl::StrCat(dir, " holds another model: ");
  for (int u = 0; u < rt.num_units(); ++u) {
    for (const TensorSlot& t : rt.unit_tensors(u)) {
      auto it = index.find(t.name);
      if (it == index.end()) {
        return absl::FailedPreconditionError(
            absl::StrCat(other, "tensor '", t.name, "' of this model is not in it"));
      }
      const TensorRecord& rec = m.tensors[it->second];
      if (rec.shape != t.shape) {
        return absl::FailedPreconditionError(
            absl::StrCat(other, "tensor '", t.name, "' has shape ", ShapeString(rec.shape),
                         " in the checkpoint but ", ShapeString(t.shape), " in this model"));
      }
      used[it->second] = true;
      out[u].push_back(it->second);
    }
  }
  for (size_t i = 0; i < used.size(); ++i) {
    if (!used[i]) {
      return absl::FailedPreconditionError(absl::StrCat(
          other, "it holds tensor '", m.tensors[i].name, "' that this model does not have"));
    }
  }
  return out;
}

// Adds the reads that fill tensor elements [b, e) from `pieces` into dest (element b first).
void PlanReads(const std::vector<PieceRef>& pieces, int64_t b, int64_t e, float* dest,
               std::map<int, std::vector<Read>>& reads) {
  auto it = std::upper_bound(pieces.begin(), pieces.end(), b,
                             [](int64_t x, const PieceRef& p) { return x < p.begin; });
  if (it != pieces.begin()) --it;
  for (; it != pieces.end() && it->begin < e; ++it) {
    const int64_t lo = std::max(b, it->begin), hi = std::min(e, it->end);
    if (lo >= hi) continue;
    reads[it->file].push_back({it->offset + static_cast<uint64_t>(lo - it->begin) * 4,
                               static_cast<size_t>(hi - lo) * 4, dest + (lo - b)});
  }
}

// Opens a shard file and verifies it against its header and the metadata: completely, or
// (`check_crc` false: its checksum was verified just before, by VerifyFiles) all but the
// checksum.
absl::StatusOr<InFile> OpenVerified(const std::string& dir, const CheckpointMetadata& m, int f,
                                    ShardHeader* header, bool check_crc = true) {
  const ShardFileRecord& rec = m.files[f];
  const std::string path = absl::StrCat(dir, "/", rec.name);
  FSDP_ASSIGN_OR_RETURN(InFile file, InFile::Open(path));
  std::string head(std::min<uint64_t>(file.size(), kShardHeaderBytes), '\0');
  FSDP_RETURN_IF_ERROR(file.ReadAt(0, head.data(), head.size()));
  FSDP_ASSIGN_OR_RETURN(*header, DecodeShardHeader(head, path));
  if (header->rank != static_cast<uint32_t>(f) ||
      header->world_size != static_cast<uint32_t>(m.world_size)) {
    return absl::DataLossError(absl::StrCat(path, ": the header says rank ", header->rank, " of ",
                                            header->world_size, ", not a file of this checkpoint"));
  }
  if (file.size() != header->file_bytes() || file.size() != rec.bytes) {
    return absl::DataLossError(absl::StrCat(path, ": ", file.size(), " bytes, but the header says ",
                                            header->file_bytes(), " and metadata.json ", rec.bytes,
                                            file.size() < rec.bytes ? " (truncated)" : ""));
  }
  if (!check_crc) return file;
  FSDP_ASSIGN_OR_RETURN(uint32_t crc,
                        file.Crc32cOf(kShardHeaderBytes, file.size() - kShardHeaderBytes));
  if (crc != header->payload_crc32c || crc != rec.crc32c) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch: the data has CRC32C ",
                                            CrcHex(crc), ", the file header records ",
                                            CrcHex(header->payload_crc32c), " and metadata.json ",
                                            CrcHex(rec.crc32c), " (corrupted)"));
  }
  return file;
}

// Every file of checkpoint `dir` that is this part's (shard file f when f % parts == part), and
// the COMMIT marker and metadata.json: present, of their sizes, and matching their checksums.
absl::Status VerifyFiles(const std::string& dir, int part, int parts) {
  FSDP_ASSIGN_OR_RETURN(CheckpointMetadata m, ReadMetadata(dir));
  for (int f = part; f < static_cast<int>(m.files.size()); f += parts) {
    ShardHeader header;
    absl::StatusOr<InFile> file = OpenVerified(dir, m, f, &header);
    if (absl::IsNotFound(file.status())) {
      return absl::DataLossError(absl::StrCat(dir, "/", m.files[f].name,
                                              ": shard file missing or unreadable (",
                                              std::string(file.status().message()), ")"));
    }
    FSDP_RETURN_IF_ERROR(file.status());
  }
  return absl::OkStatus();
}

// `files_verified`: VerifyFiles passed on every rank just before; the checksums are not
// computed again.
absl::StatusOr<Staged> Stage(ShardingRuntime& rt, const std::string& dir,
                             const LoadOptions& options, bool files_verified) {
  Staged st;
  FSDP_ASSIGN_OR_RETURN(st.meta, ReadMetadata(dir));
  const CheckpointMetadata& m = st.meta;
  // The tensors must match, and so must the architecture: equal shapes do not make the same
  // model (another number of heads).
  st.model_changes = ModelDifferences(m.model, rt.model_description(), "the checkpoint");
  absl::StatusOr<std::vector<std::vector<int>>> matched = MatchTensors(rt, m, dir);
  if (!matched.ok()) {
    if (st.model_changes.empty()) return matched.status();
    return absl::Status(matched.status().code(),
                        absl::StrCat(matched.status().message(), " (the configurations differ: ",
                                     absl::StrJoin(st.model_changes, "; "), ")"));
  }
  if (!st.model_changes.empty() && !options.allow_model_change) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " holds another model: ", absl::StrJoin(st.model_changes, "; "),
        ". Use the checkpoint's configuration, or LoadOptions::allow_model_change to load it "
        "anyway"));
  }
  const std::vector<std::vector<int>>& match = *matched;
  // Runtime state j comes from checkpoint state state_src[j].
  std::vector<size_t> state_src;
  if (options.load_optimizer_state) {
    FSDP_ASSIGN_OR_RETURN(std::vector<std::string> names, RuntimeStateNames(rt));
    std::vector<std::string> a = names, b = m.state_names;
    std::sort(a.begin(), a.end());
    std::sort(b.begin(), b.end());
    if (a != b) {
      return absl::FailedPreconditionError(
          absl::StrCat(dir, ": the checkpoint's optimizer (", m.optimizer, ") has state {",
                       absl::StrJoin(m.state_names, ", "), "} but this runtime's has {",
                       absl::StrJoin(names, ", "),
                       "}; use the same optimizer, or LoadOptions::load_optimizer_state = false"));
    }
    for (const std::string& n : names) {
      state_src.push_back(std::find(m.state_names.begin(), m.state_names.end(), n) -
                          m.state_names.begin());
    }
  }
  // Every file listed must be there with its size, even those this rank does not read.
  for (const ShardFileRecord& f : m.files) {
    const std::string path = absl::StrCat(dir, "/", f.name);
    absl::StatusOr<InFile> file = InFile::Open(path);
    if (!file.ok()) {
      return absl::DataLossError(absl::StrCat(path, ": shard file missing or unreadable (",
                                              std::string(file.status().message()), ")"));
    }
    if (file->size() != f.bytes) {
      return absl::DataLossError(absl::StrCat(path, ": ", file->size(),
                                              " bytes, metadata.json says ", f.bytes,
                                              file->size() < f.bytes ? " (truncated)" : ""));
    }
  }
  // Plan every read into the staging buffers.
  const int k = rt.shard_group().rank();
  std::map<int, std::vector<Read>> reads;
  st.params.resize(rt.num_units());
  st.states.resize(rt.num_units());
  for (int u = 0; u < rt.num_units(); ++u) {
    const int64_t sn = rt.unit_shard_numel(u);
    st.params[u].assign(sn, 0.0f);
    st.states[u].assign(state_src.size(), std::vector<float>(sn, 0.0f));
    for (const ShardPiece& p : ShardSlotPieces(rt.unit_tensors(u), sn, k)) {
      const TensorRecord& rec = m.tensors[match[u][p.tensor]];
      PlanReads(rec.param, p.tensor_begin, p.tensor_end, st.params[u].data() + p.shard_offset,
                reads);
      for (size_t j = 0; j < state_src.size(); ++j) {
        PlanReads(rec.state[state_src[j]], p.tensor_begin, p.tensor_end,
                  st.states[u][j].data() + p.shard_offset, reads);
      }
    }
  }
  const int rank = rt.world().rank();
  st.rank_state_restored = m.world_size == rt.world().size();
  if (st.rank_state_restored) reads[rank];  // read (and verify) our own file for the rank state
  for (auto& [f, list] : reads) {
    ShardHeader header;
    FSDP_ASSIGN_OR_RETURN(InFile file, OpenVerified(dir, m, f, &header, !files_verified));
    for (const Read& r : list) FSDP_RETURN_IF_ERROR(file.ReadAt(r.offset, r.dest, r.bytes));
    if (f == rank && st.rank_state_restored) {
      st.rank_state.resize(header.rank_state_bytes);
      FSDP_RETURN_IF_ERROR(file.ReadAt(kShardHeaderBytes + header.tensor_bytes,
                                       st.rank_state.data(), st.rank_state.size()));
    }
  }
  if (!options.allow_nonfinite) {
    const std::string fix = absl::StrCat(
        "not resuming from ", dir, ". Resume from an older checkpoint, or set "
        "LoadOptions::allow_nonfinite to load it anyway");
    for (int u = 0; u < rt.num_units(); ++u) {
      const std::string unit = rt.unit_tensors(u).front().name;
      FSDP_RETURN_IF_ERROR(CheckFinite(
          st.params[u].data(), static_cast<int64_t>(st.params[u].size()),
          absl::StrCat(dir, ": the parameters of the unit starting with '", unit, "'"), fix));
      for (const std::vector<float>& state : st.states[u]) {
        FSDP_RETURN_IF_ERROR(CheckFinite(
            state.data(), static_cast<int64_t>(state.size()),
            absl::StrCat(dir, ": the optimizer state of the unit starting with '", unit, "'"),
            fix));
      }
    }
  }
  return st;
}

// Copies the staged shards into the runtime; host-to-device copies only.
absl::Status Apply(ShardingRuntime& rt, const Staged& st, const LoadOptions& options) {
  for (int u = 0; u < rt.num_units(); ++u) {
    const int64_t n = static_cast<int64_t>(st.params[u].size());
    // The shard's own backend: offload all keeps it in host memory.
    const View params = rt.param_shard(u);
    FSDP_RETURN_IF_ERROR(params.backend->CopyFromHost(params.Slice(0, n), st.params[u].data()));
    if (!options.load_optimizer_state) continue;
    std::vector<OptimizerState> states = rt.optimizer(u).state();
    for (size_t j = 0; j < states.size(); ++j) {
      // The state's own backend: an offloaded unit's is in host memory.
      FSDP_RETURN_IF_ERROR(states[j].data.backend->CopyFromHost(states[j].data.Slice(0, n),
                                                                st.states[u][j].data()));
    }
    rt.optimizer(u).set_step(st.meta.optimizer_step);
  }
  if (options.load_optimizer_state) {
    rt.set_steps(st.meta.step);
    rt.set_loss_scale_state({st.meta.loss_scale, static_cast<int>(st.meta.loss_scale_good_steps),
                             st.meta.skipped_steps});
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace checkpoint

namespace checkpoint {
namespace {

absl::StatusOr<LoadedCheckpoint> Load(ShardingRuntime& rt, const std::string& dir,
                                      const LoadOptions& options, bool files_verified) {
  absl::StatusOr<Staged> staged = Stage(rt, dir, options, files_verified);
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(rt.world(), staged.status()));
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(rt.world(), Apply(rt, *staged, options)));
  LoadedCheckpoint out;
  const CheckpointMetadata& m = staged->meta;
  if (m.data_loader)
    out.state.data = DataPosition{m.data_loader->first, m.data_loader->second};
  out.state.values.insert(m.values.begin(), m.values.end());
  out.state.rank_state = std::move(staged->rank_state);
  out.rank_state_restored = staged->rank_state_restored;
  out.step = rt.steps();
  out.saved_world_size = m.world_size;
  out.saved_strategy = m.strategy;
  out.model_recorded = !m.model.empty();
  out.model_changes = staged->model_changes;
  return out;
}

// The subdirectories of `parent` with a valid COMMIT marker, newest first (the highest step,
// ties broken by the greater name); those that hold checkpoint files but no valid marker go to
// `skipped` (sorted by path). Temporary and replaced copies are never candidates.
absl::StatusOr<std::vector<std::string>> CommittedCheckpoints(
    const std::string& parent, std::vector<SkippedCheckpoint>* skipped) {
  if (skipped != nullptr) skipped->clear();
  std::error_code ec;
  std::filesystem::directory_iterator it(parent, ec);
  if (ec) return absl::NotFoundError(absl::StrCat(parent, ": cannot list: ", ec.message()));
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& e : it) {
    const std::string name = e.path().filename().string();
    // Saves in progress or crashed, and old copies being replaced, are never resumed from.
    if (IsCheckpointTemporaryName(name) || IsReplacedCheckpointName(name) ||
        !e.is_directory(ec)) {
      continue;
    }
    const std::string path = e.path().string();
    absl::StatusOr<CommitRecord> commit = ReadVerifiedCommit(path);
    if (!commit.ok()) {
      // Report what looks like a checkpoint; other directories are none of our business.
      if (skipped != nullptr && LooksLikeCheckpoint(path)) {
        skipped->push_back({path, commit.status()});
      }
      continue;
    }
    found.emplace_back(commit->step, path);
  }
  if (skipped != nullptr) SortByPath(*skipped);
  std::sort(found.begin(), found.end(), std::greater<>());
  std::vector<std::string> out;
  for (auto& [step, path] : found) out.push_back(std::move(path));
  return out;
}

absl::Status NoCompleteCheckpoint(const std::string& parent) {
  return absl::NotFoundError(absl::StrCat(parent, ": no complete checkpoint (none with a valid ",
                                          kCommitFile, " marker)"));
}

}  // namespace
}  // namespace checkpoint

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(ShardingRuntime& rt, const std::string& dir,
                                                const LoadOptions& options) {
  return checkpoint::Load(rt, dir, options, /*files_verified=*/false);
}

absl::Status VerifyCheckpoint(Communicator& world, const std::string& dir) {
  return AgreeOnStatus(world, checkpoint::VerifyFiles(dir, world.rank(), world.size()));
}

absl::StatusOr<ResumedCheckpoint> ResumeFromLatestCheckpoint(ShardingRuntime& rt,
                                                             const std::string& parent,
                                                             const ResumeOptions& options) {
  using namespace checkpoint;  // NOLINT
  ResumedCheckpoint out;
  // Every rank lists the directory itself; they must find the same candidates.
  absl::StatusOr<std::vector<std::string>> candidates = CommittedCheckpoints(parent, &out.skipped);
  if (absl::IsNotFound(candidates.status())) candidates = std::vector<std::string>();
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(rt.world(), candidates.status()));
  std::string listed;
  for (const std::string& c : *candidates) absl::StrAppend(&listed, c, "\n");
  FSDP_RETURN_IF_ERROR(CheckSameSettings(
      rt.world(), {{"checkpoints", listed}},
      absl::StrCat("resuming from ", parent, ": the ranks see different checkpoints")));
  for (const std::string& dir : *candidates) {
    const absl::Status verified = VerifyCheckpoint(rt.world(), dir);
    if (!verified.ok()) {
      // Passed over only when a later save of that name may replace it: it holds checkpoint
      // files alone (a FIFO or a directory in place of one is not ours to remove).
      if (absl::IsDataLoss(verified) && !HoldsOnlyCheckpointFiles(dir)) {
        const std::vector<std::string> odd = CheckpointFilesOfOtherKinds(dir);
        return absl::DataLossError(absl::StrCat(
            verified.message(), " (", dir, " holds ",
            odd.empty() ? std::string("files a checkpoint does not have")
                        : absl::StrCat("entries a save never writes: ", absl::StrJoin(odd, ", ")),
            "; not resuming past it: remove or move them)"));
      }
      if (!absl::IsDataLoss(verified) || !options.fallback) {
        return absl::Status(verified.code(),
                            absl::StrCat(verified.message(),
                                         absl::IsDataLoss(verified)
                                             ? " (the checkpoint is damaged; "
                                               "ResumeOptions::fallback resumes from the "
                                               "previous intact one)"
                                             : ""));
      }
      out.skipped.push_back({dir, verified});
      continue;
    }
    FSDP_ASSIGN_OR_RETURN(out.loaded, Load(rt, dir, options.load, /*files_verified=*/true));
    out.path = dir;
    break;
  }
  SortByPath(out.skipped);
  return out;
}

absl::StatusOr<int64_t> CheckpointStep(const std::string& dir) {
  FSDP_ASSIGN_OR_RETURN(checkpoint::CommitRecord commit, checkpoint::ReadVerifiedCommit(dir));
  return commit.step;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& parent,
                                             std::vector<SkippedCheckpoint>* skipped) {
  FSDP_ASSIGN_OR_RETURN(std::vector<std::string> committed,
                        checkpoint::CommittedCheckpoints(parent, skipped));
  if (committed.empty()) return checkpoint::NoCompleteCheckpoint(parent);
  return committed.front();
}

absl::StatusOr<std::vector<CheckpointCleanup>> CleanUpCheckpointDirectory(
    const std::string& parent) {
  using namespace checkpoint;  // NOLINT
  std::vector<CheckpointCleanup> done;
  std::error_code ec;
  if (!std::filesystem::is_directory(parent, ec)) return done;
  // Under the lock no save is in flight in `parent`: every temporary directory is dead.
  FSDP_ASSIGN_OR_RETURN(CheckpointDirLock lock, CheckpointDirLock::Acquire(parent));
  std::vector<std::string> temporaries, replaced;
  std::filesystem::directory_iterator it(parent, ec);
  if (ec) return absl::InternalError(absl::StrCat(parent, ": cannot list: ", ec.message()));
  for (const auto& e : it) {
    const std::string name = e.path().filename().string();
    if (IsCheckpointTemporaryName(name)) temporaries.push_back(e.path().string());
    if (IsReplacedCheckpointName(name)) replaced.push_back(e.path().string());
  }
  std::sort(temporaries.begin(), temporaries.end());
  std::sort(replaced.begin(), replaced.end());
  auto complete = [](const std::string& dir) {
    return HoldsOnlyCheckpointFiles(dir) && ReadVerifiedCommit(dir).ok();
  };
  // NAME.old-<suffix> is the copy a save of NAME was replacing; NAME.tmp-<suffix> the new one.
  for (const std::string& old : replaced) {
    // Not something a save made (an old copy a crash left half removed may be empty).
    const bool empty_dir = !std::filesystem::is_symlink(old, ec) &&
                           std::filesystem::is_directory(old, ec) &&
                           std::filesystem::is_empty(old, ec);
    if (!HoldsOnlyCheckpointFiles(old) && !empty_dir) continue;
    const size_t at = old.rfind(".old-");
    const std::string target = old.substr(0, at);
    const std::string name = BaseName(target);
    const std::string fresh = absl::StrCat(target, ".tmp-", old.substr(at + 5));
    if (complete(target)) {
      FSDP_RETURN_IF_ERROR(RemoveTree(old));
      done.push_back({old, absl::StrCat("removed: the old copy of ", name,
                                        ", which a finished save replaced")});
    } else if (!PathExists(target) && PathExists(fresh) && complete(fresh)) {
      FSDP_RETURN_IF_ERROR(RenameDurably(fresh, target));
      FSDP_RETURN_IF_ERROR(RemoveTree(old));
      done.push_back({fresh, absl::StrCat("renamed to ", name, ": the save replacing ", name,
                                          " had finished when it stopped")});
      done.push_back({old, absl::StrCat("removed: the old copy of ", name,
                                        ", which that save replaced")});
    } else if (!PathExists(target) && complete(old)) {
      FSDP_RETURN_IF_ERROR(RenameDurably(old, target));
      done.push_back({old, absl::StrCat("restored as ", name, ": the complete copy that a save "
                                        "was replacing when it stopped")});
    } else if (!PathExists(target)) {
      FSDP_RETURN_IF_ERROR(RemoveTree(old));
      done.push_back({old, absl::StrCat("removed: a damaged copy of ", name,
                                        " that a save was replacing")});
    }
  }
  for (const std::string& path : temporaries) {
    if (!PathExists(path)) continue;  // renamed above
    FSDP_RETURN_IF_ERROR(RemoveTree(path));
    done.push_back({path, "removed: the temporary directory of a save that did not finish"});
  }
  std::sort(done.begin(), done.end(),
            [](const CheckpointCleanup& a, const CheckpointCleanup& b) { return a.path < b.path; });
  return done;
}

absl::StatusOr<std::vector<std::string>> RemoveCheckpointTemporaries(const std::string& parent) {
  FSDP_ASSIGN_OR_RETURN(std::vector<CheckpointCleanup> done, CleanUpCheckpointDirectory(parent));
  std::vector<std::string> paths;
  for (const CheckpointCleanup& c : done) paths.push_back(c.path);
  return paths;
}

}  // namespace fsdp
