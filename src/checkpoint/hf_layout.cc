// The Hugging Face layout of a model as safetensors (what `transformers`' save_pretrained
// writes and from_pretrained reads): a directory holding model.safetensors, or, when the
// tensors exceed the largest file, model-0000K-of-0000N.safetensors and
// model.safetensors.index.json {"metadata": {"total_parameters": N, "total_size": BYTES},
// "weight_map": {NAME: FILE}}.
// ExportSafetensorsDirectory writes it the way ExportSafetensors writes one file (units
// gathered one at a time, rank 0 writing each tensor at its offset) into a temporary directory
// renamed into place; ImportSafetensors reads an index or such a directory, after checking the
// index against the files (hostile input: every name and size is checked before use).
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fsdp/checkpoint.h"
#include "src/checkpoint/file_io.h"
#include "src/checkpoint/rank_sync.h"
#include "src/checkpoint/safetensors_io.h"
#include "src/core/json.h"

namespace fsdp {
namespace checkpoint {
namespace {

constexpr char kIndexSuffix[] = ".safetensors.index.json";
constexpr uint64_t kMaxIndexBytes = 64 << 20;

// One file of a directory export: its tensors (indices into the export's order) and header.
struct PlannedFile {
  std::string name;
  std::vector<size_t> tensors;
  std::vector<SafetensorsTensor> header_tensors;  // offsets assigned by the header
  std::string header;
};

// Tensors into files in order, as transformers splits a state dict: a tensor that would take
// the current file past `max_bytes` starts the next file; one larger than `max_bytes` has a file
// of its own. One file is "model.safetensors"; more are "model-0000K-of-0000N.safetensors".
std::vector<PlannedFile> PlanFiles(const std::vector<SafetensorsTensor>& tensors,
                                   uint64_t max_bytes,
                                   const std::vector<std::pair<std::string, std::string>>& meta) {
  std::vector<PlannedFile> files(1);
  uint64_t in_file = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = static_cast<uint64_t>(tensors[i].numel) * DTypeSize(tensors[i].dtype);
    if (!files.back().tensors.empty() && (in_file + bytes > max_bytes || bytes > max_bytes)) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().tensors.push_back(i);
    files.back().header_tensors.push_back(tensors[i]);
    in_file += bytes;
  }
  const size_t n = files.size();
  for (size_t k = 0; k < n; ++k) {
    files[k].name = n == 1 ? "model.safetensors"
                           : absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, n);
    files[k].header = BuildSafetensorsHeader(files[k].header_tensors, meta);
  }
  return files;
}

std::string IndexJson(const std::vector<SafetensorsTensor>& tensors,
                      const std::vector<PlannedFile>& files) {
  std::map<std::string, std::string> weight_map;  // sorted by name, as transformers writes it
  uint64_t total = 0;
  int64_t parameters = 0;
  for (const PlannedFile& f : files) {
    for (size_t i : f.tensors) {
      weight_map[tensors[i].name] = f.name;
      total += static_cast<uint64_t>(tensors[i].numel) * DTypeSize(tensors[i].dtype);
      parameters += tensors[i].numel;
    }
  }
  json::Writer w;
  w.BeginObject().Key("metadata").BeginObject().Key("total_parameters").Int(parameters);
  w.Key("total_size").Int(static_cast<int64_t>(total)).EndObject();
  w.Key("weight_map").BeginObject();
  for (const auto& [name, file] : weight_map) w.Key(name).String(file);
  w.EndObject().EndObject();
  return w.text() + "\n";
}

// What an export directory may hold: the files an export writes (and nothing else), so that
// replacing one never removes anything of the user's.
bool IsExportEntry(const std::filesystem::directory_entry& e,
                   const std::map<std::string, std::string>& extra_files) {
  std::error_code ec;
  if (!e.is_regular_file(ec) || e.is_symlink(ec)) return false;
  const std::string name = e.path().filename().string();
  return absl::EndsWith(name, ".safetensors") || absl::EndsWith(name, kIndexSuffix) ||
         extra_files.count(name) > 0 || name == "config.json";
}

// OK when `dir` may be written: it does not exist, or it is an earlier export (a directory of
// export files only, with model.safetensors or an index). FailedPrecondition otherwise.
absl::Status CheckExportDirectory(const std::string& dir,
                                  const std::map<std::string, std::string>& extra_files) {
  std::error_code ec;
  const auto st = std::filesystem::symlink_status(dir, ec);
  if (ec || st.type() == std::filesystem::file_type::not_found) return absl::OkStatus();
  if (st.type() != std::filesystem::file_type::directory) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, ": not a directory: an export to a directory replaces only an earlier export"));
  }
  bool model = false;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!IsExportEntry(e, extra_files)) {
      return absl::FailedPreconditionError(absl::StrCat(
          dir, " holds ", name, ", which an export does not write: it is not replaced. Export "
          "to a new directory, or remove it"));
    }
    model |= name == "model.safetensors" || absl::EndsWith(name, kIndexSuffix);
  }
  if (ec) return absl::FailedPreconditionError(absl::StrCat(dir, ": cannot list: ", ec.message()));
  const bool empty = std::filesystem::is_empty(dir, ec);
  if (!model && !empty) {
    return absl::FailedPreconditionError(absl::StrCat(
        dir, " holds no model.safetensors or index: it is not an earlier export and is not "
        "replaced"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ImportSource> OpenIndex(const std::string& index) {
  auto bad = [&](const std::string& what) {
    return absl::DataLossError(absl::StrCat(index, ": ", what));
  };
  FSDP_ASSIGN_OR_RETURN(std::string text, ReadWholeFile(index, kMaxIndexBytes));
  absl::StatusOr<SafetensorsIndex> parsed = ParseSafetensorsIndex(text);
  if (!parsed.ok()) return bad(std::string(parsed.status().message()));
  const std::optional<int64_t> total_size = parsed->total_size;
  const std::string dir = ParentOf(index);
  ImportSource src;
  src.what = index;
  src.in_what = "the index's weight_map";
  std::map<std::string, const ImportFile*> opened;
  std::map<std::string, std::string> file_of;  // tensor -> file, from the weight_map
  for (const auto& [name, file] : parsed->weight_map) {
    file_of[name] = file;
    if (opened.count(file)) continue;
    absl::StatusOr<std::unique_ptr<ImportFile>> f = OpenImportFile(absl::StrCat(dir, "/", file));
    if (!f.ok()) {
      return bad(absl::StrCat("the weight_map puts tensor '", name, "' in ", file, ": ",
                              std::string(f.status().message())));
    }
    opened[file] = f->get();
    src.files.push_back(*std::move(f));
  }
  if (src.files.empty()) return bad("the weight_map is empty");
  // Every tensor of every file in the weight_map under that file, and in no other file.
  uint64_t bytes = 0;
  for (const auto& file : src.files) {
    const std::string base = BaseName(file->path);
    for (const SafetensorsTensor& t : file->header.tensors) {
      bytes += t.end - t.begin;
      auto [it, inserted] = src.tensors.emplace(t.name, std::make_pair(file.get(), &t));
      if (!inserted) {
        return bad(absl::StrCat("tensor '", t.name, "' is in both ", BaseName(it->second.first->path),
                                " and ", base, " (shards overlap)"));
      }
      auto mapped = file_of.find(t.name);
      if (mapped == file_of.end()) {
        return bad(absl::StrCat(base, " holds tensor '", t.name, "', which the weight_map lacks"));
      }
      if (mapped->second != base) {
        return bad(absl::StrCat("tensor '", t.name, "' is in ", base, " but the weight_map puts "
                                "it in ", mapped->second));
      }
    }
  }
  for (const auto& [name, file] : file_of) {
    if (!src.tensors.count(name)) {
      return bad(absl::StrCat("the weight_map puts tensor '", name, "' in ", file,
                              ", which does not hold it"));
    }
  }
  if (total_size.has_value() && static_cast<uint64_t>(*total_size) != bytes) {
    return bad(absl::StrCat("\"total_size\" is ", *total_size, " bytes but the tensors of its ",
                            src.files.size(), " files take ", bytes));
  }
  src.metadata = src.files.front()->header.metadata;
  return src;
}

}  // namespace

bool IsHuggingFaceImportPath(const std::string& path) {
  std::error_code ec;
  return absl::EndsWith(path, ".index.json") || std::filesystem::is_directory(path, ec);
}

absl::StatusOr<ImportSource> OpenHuggingFaceImport(const std::string& path) {
  if (absl::EndsWith(path, ".index.json")) return OpenIndex(path);
  std::vector<std::string> indexes, files;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(path, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::EndsWith(name, ".index.json")) indexes.push_back(name);
    if (absl::EndsWith(name, ".safetensors")) files.push_back(name);
  }
  if (ec) return absl::NotFoundError(absl::StrCat(path, ": cannot list: ", ec.message()));
  std::sort(indexes.begin(), indexes.end());
  std::sort(files.begin(), files.end());
  if (indexes.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds more than one index (", absl::StrJoin(indexes, ", "),
        "): give the index file to import"));
  }
  if (indexes.size() == 1) return OpenIndex(absl::StrCat(path, "/", indexes[0]));
  const bool single = files.size() == 1 ||
                      std::find(files.begin(), files.end(), "model.safetensors") != files.end();
  if (!single) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " holds no model.safetensors.index.json and ",
        files.empty() ? std::string("no safetensors file")
                      : absl::StrCat(files.size(), " safetensors files but no model.safetensors"),
        ": give a directory written by save_pretrained or ExportSafetensorsDirectory, or a "
        "file"));
  }
  const std::string name = files.size() == 1 ? files[0] : "model.safetensors";
  return OpenSingleFileImport(absl::StrCat(path, "/", name));
}

}  // namespace checkpoint

absl::Status CheckExportDirectoryWritable(const std::string& dir,
                                          const std::vector<std::string>& extra_files) {
  using namespace checkpoint;  // NOLINT
  std::map<std::string, std::string> extra;
  for (const std::string& name : extra_files) extra[name];
  FSDP_RETURN_IF_ERROR(CheckExportDirectory(dir, extra));
  // The export is written beside `dir` (DIR.tmp-<pid>) and renamed: its parent must take it.
  const std::string parent = ParentOf(dir);
  std::error_code ec;
  if (!std::filesystem::is_directory(parent, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": its parent directory ", parent, " does not exist"));
  }
  const std::string probe = absl::StrCat(dir, ".tmp-", ::getpid(), "-probe");
  if (absl::Status made = MakeDirectory(probe); !made.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, ": cannot create a directory beside it (", made.message(), ")"));
  }
  return RemoveTree(probe);
}

absl::StatusOr<SafetensorsExportReport> ExportSafetensorsDirectory(
    ShardingRuntime& rt, const std::string& dir, const SafetensorsExportOptions& options) {
  using namespace checkpoint;  // NOLINT: this file's own helpers
  Communicator& world = rt.world();
  const bool root = world.rank() == 0;
  std::vector<SafetensorsTensor> tensors = ExportTensors(rt, options.dtype);
  const std::vector<PlannedFile> plan =
      PlanFiles(tensors, options.max_file_bytes, ExportMetadata(rt, options));
  SafetensorsExportReport report;
  report.files = static_cast<int>(plan.size());
  report.host_bytes_per_rank = ExportHostBytes(rt, options.dtype);
  for (const SafetensorsTensor& t : tensors) {
    report.total_size += static_cast<uint64_t>(t.numel) * DTypeSize(options.dtype);
  }
  absl::Status local;
  if (options.max_file_bytes == 0) {
    local = absl::InvalidArgumentError("SafetensorsExportOptions::max_file_bytes: 0; allowed: "
                                       "1 byte or more (5000000000 as transformers writes)");
  } else if (options.max_host_bytes > 0 && report.host_bytes_per_rank > options.max_host_bytes) {
    local = absl::ResourceExhaustedError(absl::StrCat(
        "exporting to ", dir, " needs ", report.host_bytes_per_rank, " bytes of host memory on a "
        "rank (the largest unit gathered in f32 and its largest tensor encoded), more than "
        "SafetensorsExportOptions::max_host_bytes = ", options.max_host_bytes,
        ": wrap the model in smaller units, or allow more"));
  }
  for (const auto& [name, contents] : options.extra_files) {
    if (local.ok() && (!IsPlainFileName(name) || absl::EndsWith(name, ".safetensors") ||
                       absl::EndsWith(name, kIndexSuffix))) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "SafetensorsExportOptions::extra_files: '", name, "' is not a file name beside the "
          "model's files"));
    }
  }
  // Rank 0 writes every file into DIR.tmp-<pid>, renamed to DIR at the end.
  const std::string tmp = absl::StrCat(dir, ".tmp-", ::getpid());
  std::vector<std::optional<OutFile>> out(plan.size());
  std::vector<std::pair<size_t, uint64_t>> where(tensors.size());  // file, offset in it
  if (root && local.ok()) {
    local = CheckExportDirectory(dir, options.extra_files);
    if (local.ok() && PathExists(tmp)) local = RemoveTree(tmp);  // a dead export with our pid
    if (local.ok()) local = MakeDirectory(tmp);
    for (size_t k = 0; k < plan.size() && local.ok(); ++k) {
      absl::StatusOr<OutFile> f = OutFile::Create(absl::StrCat(tmp, "/", plan[k].name));
      local = f.status();
      if (!f.ok()) break;
      out[k].emplace(*std::move(f));
      local = out[k]->WriteAt(0, plan[k].header.data(), plan[k].header.size());
      for (size_t j = 0; j < plan[k].tensors.size(); ++j) {
        where[plan[k].tensors[j]] = {k, plan[k].header.size() + plan[k].header_tensors[j].begin};
      }
    }
  }
  if (absl::Status early = AgreeOnStatus(world, local); !early.ok()) {
    out.clear();
    if (root && PathExists(tmp)) RemoveTree(tmp).IgnoreError();
    return early;
  }
  local = GatherForExport(rt, dir, options, local, [&](size_t i, const std::string& bytes) {
    return out[where[i].first]->WriteAt(where[i].second, bytes.data(), bytes.size());
  });
  if (root) {
    for (size_t k = 0; k < out.size() && local.ok(); ++k) local = out[k]->SyncAndClose();
    if (local.ok() && plan.size() > 1) {
      local = WriteFileDurably(absl::StrCat(tmp, "/model", kIndexSuffix), IndexJson(tensors, plan));
    }
    for (const auto& [name, contents] : options.extra_files) {
      if (local.ok()) local = WriteFileDurably(absl::StrCat(tmp, "/", name), contents);
    }
    if (local.ok()) local = SyncDirectory(tmp);
  }
  absl::Status agreed = AgreeOnStatus(world, local);
  if (root && agreed.ok()) {
    // Again: what is at `dir` may have changed while the model was written. An earlier export
    // is renamed aside, the new one renamed in, then the old one removed.
    local = CheckExportDirectory(dir, options.extra_files);
    const std::string old = absl::StrCat(dir, ".old-", ::getpid());
    const bool replace = local.ok() && PathExists(dir);
    if (replace) local = RenameDurably(dir, old);
    if (local.ok()) {
      local = RenameDurably(tmp, dir);
      if (!local.ok() && replace) RenameDurably(old, dir).IgnoreError();  // the old one back
    }
    if (replace && local.ok()) local = RemoveTree(old);
  }
  if (root && (!agreed.ok() || !local.ok())) {
    out.clear();
    if (PathExists(tmp)) RemoveTree(tmp).IgnoreError();
  }
  FSDP_RETURN_IF_ERROR(agreed);
  FSDP_RETURN_IF_ERROR(AgreeOnStatus(world, local));
  return report;
}

}  // namespace fsdp
