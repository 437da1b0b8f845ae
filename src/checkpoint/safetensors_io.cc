// ExportSafetensors / ImportSafetensors over a sharding runtime. Export gathers one unit at a
// time (only the shard group of replicate index 0 gathers; rank 0 writes at each tensor's
// offset, converting to the file's dtype). Import has every rank read the header and then
// only the bytes of the tensor pieces in its own shards.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>
#include <unordered_map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "fsdp/checkpoint.h"
#include "fsdp/files.h"
#include "src/checkpoint/file_io.h"
#include "src/checkpoint/finite.h"
#include "src/checkpoint/metadata.h"
#include "src/checkpoint/rank_sync.h"
#include "src/checkpoint/safetensors_format.h"
#include "src/checkpoint/safetensors_io.h"
#include "src/checkpoint/shard_plan.h"

namespace fsdp {
namespace checkpoint {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

// `n` floats as `dtype` bytes.
std::string Encode(const float* x, int64_t n, DType dtype) {
  std::string out(static_cast<size_t>(n) * DTypeSize(dtype), '\0');
  if (dtype == DType::kF32) {
    std::memcpy(out.data(), x, out.size());
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = dtype == DType::kBF16 ? FloatToBf16(x[i]) : FloatToF16(x[i]);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

void Decode(const char* bytes, int64_t n, DType dtype, float* out) {
  if (dtype == DType::kF32) {
    std::memcpy(out, bytes, static_cast<size_t>(n) * 4);
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes + 2 * i, 2);
    out[i] = dtype == DType::kBF16 ? Bf16ToFloat(h) : F16ToFloat(h);
  }
}

// Rank 0 of an export: the file being written.
struct ExportFile {
  std::string tmp;
  std::optional<OutFile> file;
  std::optional<HeldFileLock> lock;  // marks `tmp` as alive until it is renamed
  uint64_t data_start = 0;
};

// PATH.tmp-<digits>: the temporary file of an export to PATH.
bool IsExportTemporaryOf(std::string_view name, std::string_view base) {
  if (name.size() <= base.size() + 5 || name.substr(0, base.size()) != base ||
      name.substr(base.size(), 5) != ".tmp-") {
    return false;
  }
  const std::string_view pid = name.substr(base.size() + 5);
  return std::all_of(pid.begin(), pid.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// A temporary export file that no live export holds: a regular file (empty, or begun as a
// safetensors file) whose lock can be taken.
bool IsDeadExportTemporary(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (st.st_size > 0) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW);
    if (fd < 0) return false;
    char head[16] = {};
    const ssize_t n = ::pread(fd, head, sizeof(head), 0);
    ::close(fd);
    if (n < 10 || !kSafetensorsFile.recognise(std::string_view(head, static_cast<size_t>(n)),
                                              static_cast<uint64_t>(st.st_size))) {
      return false;
    }
  }
  return HeldFileLock::Take(path).ok();
}

absl::StatusOr<SafetensorsHeader> ReadHeader(const InFile& f) {
  char prefix[8] = {};
  if (f.size() >= 8) FSDP_RETURN_IF_ERROR(f.ReadAt(0, prefix, 8));
  FSDP_ASSIGN_OR_RETURN(uint64_t n, ParseSafetensorsLength(std::string_view(prefix, 8), f.size()));
  std::string header(n, '\0');
  FSDP_RETURN_IF_ERROR(f.ReadAt(8, header.data(), n));
  return ParseSafetensorsHeader(header, f.size());
}

// Reads this rank's shard of every unit from `src` (the staging buffers, padding zero).
absl::StatusOr<std::vector<std::vector<float>>> StageImport(
    ShardingRuntime& rt, const ImportSource& src, const SafetensorsImportOptions& options) {
  const std::string& path = src.what;
  std::vector<std::pair<std::string, std::string>> recorded;
  for (const auto& [k, v] : src.metadata) {
    if (absl::StartsWith(k, kSafetensorsModelKeyPrefix)) {
      recorded.emplace_back(k.substr(std::string_view(kSafetensorsModelKeyPrefix).size()), v);
    }
  }
  const std::vector<std::string> changes =
      ModelDifferences(recorded, rt.model_description(), "the file");
  auto find = [&](const std::string& name) -> const SafetensorsTensor* {
    auto it = src.tensors.find(name);
    return it == src.tensors.end() ? nullptr : it->second.second;
  };
  // Names and shapes first (the error names the tensor), then the architecture.
  for (int u = 0; u < rt.num_units(); ++u) {
    for (const TensorSlot& t : rt.unit_tensors(u)) {
      const SafetensorsTensor* in = find(t.name);
      std::string wrong;
      if (in == nullptr) {
        wrong = absl::StrCat(path, ": tensor '", t.name, "' of this model is not in ",
                             src.in_what);
      } else if (in->shape != t.shape) {
        wrong = absl::StrCat(path, ": tensor '", t.name, "' has shape ", ShapeString(in->shape),
                             " in the file but ", ShapeString(t.shape), " in this model");
      }
      if (wrong.empty()) continue;
      if (!changes.empty()) {
        absl::StrAppend(&wrong, " (the configurations differ: ", absl::StrJoin(changes, "; "),
                        ")");
      }
      return absl::FailedPreconditionError(wrong);
    }
  }
  if (!changes.empty() && !options.allow_model_change) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds another model: ", absl::StrJoin(changes, "; "),
        ". Use the file's configuration, or SafetensorsImportOptions::allow_model_change to "
        "import it anyway"));
  }
  size_t matched = 0;
  const int k = rt.shard_group().rank();
  std::vector<std::vector<float>> staged(rt.num_units());
  std::string bytes;
  for (int u = 0; u < rt.num_units(); ++u) {
    const std::vector<TensorSlot>& slots = rt.unit_tensors(u);
    matched += slots.size();
    const int64_t sn = rt.unit_shard_numel(u);
    staged[u].assign(sn, 0.0f);
    for (const ShardPiece& p : ShardSlotPieces(slots, sn, k)) {
      const auto& [file, t] = src.tensors.at(slots[p.tensor].name);
      const size_t es = DTypeSize(t->dtype);
      const int64_t n = p.tensor_end - p.tensor_begin;
      bytes.resize(static_cast<size_t>(n) * es);
      FSDP_RETURN_IF_ERROR(file->file.ReadAt(
          file->header.data_start + t->begin + p.tensor_begin * es, bytes.data(), bytes.size()));
      Decode(bytes.data(), n, t->dtype, staged[u].data() + p.shard_offset);
      if (!options.allow_nonfinite) {
        FSDP_RETURN_IF_ERROR(CheckFinite(
            staged[u].data() + p.shard_offset, n,
            absl::StrCat(file->path, ": tensor '", t->name, "'"),
            "not importing it. SafetensorsImportOptions::allow_nonfinite imports it anyway"));
      }
    }
  }
  if (matched != src.tensors.size() && !options.ignore_extra_tensors) {
    for (const auto& [name, where] : src.tensors) {
      bool found = false;
      for (int u = 0; u < rt.num_units() && !found; ++u) {
        for (const TensorSlot& s : rt.unit_tensors(u)) found |= s.name == name;
      }
      if (!found) {
        return absl::FailedPreconditionError(absl::StrCat(
            path, ": the file holds tensor '", name,
            "' that this model does not have (SafetensorsImportOptions::ignore_extra_tensors)"));
      }
    }
  }
  return staged;
}

}  // namespace

std::vector<SafetensorsTensor> ExportTensors(ShardingRuntime& rt, DType dtype) {
  std::vector<SafetensorsTensor> tensors;
  for (int u = 0; u < rt.num_units(); ++u) {
    for (const TensorSlot& t : rt.unit_tensors(u)) {
      tensors.push_back({t.name, dtype, t.shape, t.numel, 0, 0});
    }
  }
  return tensors;
}

std::vector<std::pair<std::string, std::string>> ExportMetadata(
    ShardingRuntime& rt, const SafetensorsExportOptions& options) {
  std::map<std::string, std::string> all = options.metadata;
  for (const auto& [k, v] : rt.model_description()) {
    all.emplace(absl::StrCat(kSafetensorsModelKeyPrefix, k), v);
  }
  std::vector<std::pair<std::string, std::string>> meta(all.begin(), all.end());
  if (!options.metadata.count("format")) meta.emplace_back("format", "pt");
  return meta;
}

uint64_t ExportHostBytes(ShardingRuntime& rt, DType dtype) {
  uint64_t most = 0;
  for (int u = 0; u < rt.num_units(); ++u) {
    int64_t largest = 0;
    for (const TensorSlot& t : rt.unit_tensors(u)) largest = std::max(largest, t.numel);
    most = std::max(most, static_cast<uint64_t>(rt.unit_numel(u)) * 4 +
                              static_cast<uint64_t>(largest) * DTypeSize(dtype));
  }
  return most;
}

absl::Status GatherForExport(ShardingRuntime& rt, const std::string& what,
                             const SafetensorsExportOptions& options, absl::Status local,
                             const std::function<absl::Status(size_t, const std::string&)>& write) {
  if (rt.replicate_group().rank() != 0) return local;
  const bool root = rt.world().rank() == 0;
  size_t next = 0;
  for (int u = 0; u < rt.num_units(); ++u) {
    std::vector<float> whole(rt.unit_numel(u));
    absl::Status g = rt.GatherUnit(u, whole.data());
    if (!g.ok()) {
      if (local.ok()) local = g;
      break;  // the group has failed: later gathers would fail too
    }
    for (const TensorSlot& t : rt.unit_tensors(u)) {
      const size_t i = next++;
      if (!local.ok()) continue;
      if (!options.allow_nonfinite) {
        local = CheckFinite(whole.data() + t.offset, t.numel,
                            absl::StrCat("tensor '", t.name, "'"),
                            absl::StrCat("not exporting ", what,
                                         ". SafetensorsExportOptions::allow_nonfinite exports "
                                         "it anyway"));
        if (!local.ok()) continue;
      }
      if (!root) continue;
      local = write(i, Encode(whole.data() + t.offset, t.numel, options.dtype));
    }
  }
  return local;
}

absl::StatusOr<ImportSource> OpenSingleFileImport(const std::string& path) {
  FSDP_ASSIGN_OR_RETURN(std::unique_ptr<ImportFile> file, OpenImportFile(path));
  ImportSource src{path, "the file", {}, {}, file->header.metadata};
  for (const SafetensorsTensor& t : file->header.tensors) src.tensors[t.name] = {file.get(), &t};
  src.files.push_back(std::move(file));
  return src;
}

absl::StatusOr<std::unique_ptr<ImportFile>> OpenImportFile(const std::string& path) {
  FSDP_ASSIGN_OR_RETURN(InFile f, InFile::Open(path));
  absl::StatusOr<SafetensorsHeader> header = ReadHeader(f);
  if (!header.ok()) {
    return absl::DataLossError(absl::StrCat(path, ": ", std::string(header.status().message())));
  }
  return std::make_unique<ImportFile>(ImportFile{path, std::move(f), *std::move(header)});
}

}  // namespace checkpoint

absl::Status ExportSafetensors(ShardingRuntime& rt, const std::string& path,
                               const SafetensorsExportOptions& options) {
  using namespace checkpoint;  // NOLINT: this file's own helpers
  Communicator& world = rt.world();
  const bool root = world.rank() == 0;
  std::vector<SafetensorsTensor> tensors = ExportTensors(rt, options.dtype);
  const std::vector<std::pair<std::string, std::string>> meta = ExportMetadata(rt, options);
  const std::string header = BuildSafetensorsHeader(tensors, meta);

  absl::Status local;
  ExportFile out;
  if (root) {
    // Only a new file or a safetensors file is ever replaced (never /dev/null, a corpus, ...).
    local = CheckOutputPath(path, kSafetensorsFile, {}, "export to");
    out.tmp = absl::StrCat(path, ".tmp-", ::getpid());
    if (local.ok() && PathExists(out.tmp) && IsDeadExportTemporary(out.tmp)) {
      ::unlink(out.tmp.c_str());  // left by a dead process that had our pid
    }
    if (local.ok()) {
      auto f = OutFile::Create(out.tmp);
      local = f.status();
      if (f.ok()) out.file.emplace(std::move(*f));
    }
    if (local.ok()) {
      auto l = HeldFileLock::Take(out.tmp);
      local = l.status();
      if (l.ok()) out.lock.emplace(std::move(*l));
    }
    if (local.ok()) local = out.file->WriteAt(0, header.data(), header.size());
    out.data_start = header.size();
  }
  // Gather unit by unit in the shard group of replicate index 0; rank 0 writes.
  local = GatherForExport(rt, path, options, local, [&](size_t i, const std::string& bytes) {
    return out.file->WriteAt(out.data_start + tensors[i].begin, bytes.data(), bytes.size());
  });
  if (root && local.ok()) local = out.file->SyncAndClose();
  absl::Status agreed = AgreeOnStatus(world, local);
  if (root && agreed.ok()) {
    // Again: what is at `path` may have changed while the model was written.
    local = CheckOutputPath(path, kSafetensorsFile, {}, "export to");
    if (local.ok()) local = RenameDurably(out.tmp, path);
  }
  if (root && (!agreed.ok() || !local.ok()) && out.file.has_value()) {
    out.file.reset();
    ::unlink(out.tmp.c_str());
  }
  out.lock.reset();
  FSDP_RETURN_IF_ERROR(agreed);
  return AgreeOnStatus(world, local);
}

absl::StatusOr<std::vector<std::string>> RemoveDeadExportTemporaries(const std::string& path) {
  using namespace checkpoint;  // NOLINT
  std::vector<std::string> removed;
  const std::string dir = ParentOf(path), base = BaseName(path);
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) return removed;  // no directory: nothing left behind
  for (const auto& e : it) {
    const std::string name = e.path().filename().string();
    if (!IsExportTemporaryOf(name, base)) continue;
    // Named as the export is: "m.safetensors.tmp-123" for "m.safetensors", not "./m...".
    const std::string p = path.find('/') == std::string::npos ? name : e.path().string();
    if (!IsDeadExportTemporary(p)) continue;
    if (::unlink(p.c_str()) != 0) {
      return absl::InternalError(absl::StrCat(p, ": cannot remove: ", std::strerror(errno)));
    }
    removed.push_back(p);
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

absl::Status ImportSafetensors(ShardingRuntime& rt, const std::string& path,
                               const SafetensorsImportOptions& options) {
  using namespace checkpoint;  // NOLINT
  const absl::StatusOr<ImportSource> src =
      IsHuggingFaceImportPath(path) ? OpenHuggingFaceImport(path) : OpenSingleFileImport(path);
  absl::StatusOr<std::vector<std::vector<float>>> staged =
      src.ok() ? StageImport(rt, *src, options)
               : absl::StatusOr<std::vector<std::vector<float>>>(src.status());
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(rt.world(), staged.status()));
  absl::Status local;
  for (int u = 0; u < rt.num_units() && local.ok(); ++u) {
    const View params = rt.param_shard(u);  // (offload all: in host memory)
    local = params.backend->CopyFromHost(
        params.Slice(0, static_cast<int64_t>((*staged)[u].size())), (*staged)[u].data());
  }
  return AgreeOnStatus(rt.world(), local);
}

}  // namespace fsdp
