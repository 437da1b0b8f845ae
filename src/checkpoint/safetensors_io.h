// The pieces the safetensors export and import share between one file (safetensors_io.cc) and
// the Hugging Face directory layout (hf_layout.cc): the tensors and metadata an export writes,
// the unit-by-unit gather that feeds it, and the import's staging from tensors located in one
// or more files.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint.h"
#include "src/checkpoint/file_io.h"
#include "src/checkpoint/safetensors_format.h"

namespace fsdp::checkpoint {

// The registered tensors in export order (units in order, each unit's tensors in order), in
// `dtype`, without offsets.
std::vector<SafetensorsTensor> ExportTensors(ShardingRuntime& rt, DType dtype);
// The "__metadata__" of an export: options.metadata, the model description
// (kSafetensorsModelKeyPrefix), and "format": "pt" unless given.
std::vector<std::pair<std::string, std::string>> ExportMetadata(
    ShardingRuntime& rt, const SafetensorsExportOptions& options);
// The host bytes an export holds at its peak on a rank: the largest unit gathered in f32 plus
// the largest of its tensors encoded in `dtype`.
uint64_t ExportHostBytes(ShardingRuntime& rt, DType dtype);

// Gathers the units one at a time in the shard group of replicate index 0 and calls
// write(i, encoded bytes) on rank 0 for each tensor i of ExportTensors order, after checking
// it is finite (unless options.allow_nonfinite). Every rank of that group gathers every unit
// even after an error (the collectives stay matched); returns the first error, starting from
// `local`. `what` names the export in messages.
absl::Status GatherForExport(ShardingRuntime& rt, const std::string& what,
                             const SafetensorsExportOptions& options, absl::Status local,
                             const std::function<absl::Status(size_t, const std::string&)>& write);

// One file an import reads, its header parsed.
struct ImportFile {
  std::string path;
  InFile file;
  SafetensorsHeader header;
};
// Opens `path` and parses its header (DataLoss naming the file when the header is bad).
absl::StatusOr<std::unique_ptr<ImportFile>> OpenImportFile(const std::string& path);

// What an import reads from: every tensor by name, in its file.
struct ImportSource {
  std::string what;     // for messages: the file, or the index
  std::string in_what;  // "the file", "the index's weight_map"
  std::vector<std::unique_ptr<ImportFile>> files;
  std::map<std::string, std::pair<const ImportFile*, const SafetensorsTensor*>> tensors;
  std::vector<std::pair<std::string, std::string>> metadata;  // the model keys are read here
};
// One safetensors file as an import's source, its tensors by name.
absl::StatusOr<ImportSource> OpenSingleFileImport(const std::string& path);
// The Hugging Face layout: `path` an index (*.index.json) or a directory (its one index, or
// its one safetensors file), checked against its files (hf_layout.cc).
absl::StatusOr<ImportSource> OpenHuggingFaceImport(const std::string& path);
// Whether ImportSafetensors reads `path` as the Hugging Face layout.
bool IsHuggingFaceImportPath(const std::string& path);

}  // namespace fsdp::checkpoint
