// The safetensors file format (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON header
//   {"__metadata__": {"k": "v"}, "name": {"dtype": "F32", "shape": [2, 3],
//                                         "data_offsets": [begin, end]}, ...}
// (offsets relative to the data section, which starts at byte 8 + N), then the raw data.
// This file parses and validates a header (hostile input: fuzzed) and builds one. No I/O.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/dtype.h"
#include "fsdp/status.h"

namespace fsdp::checkpoint {

// The reference implementation's limit on the header size.
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0, end = 0;  // byte range in the data section
};

struct SafetensorsHeader {
  uint64_t data_start = 0;                 // 8 + N: where the data section starts in the file
  std::vector<SafetensorsTensor> tensors;  // in header order
  std::vector<std::pair<std::string, std::string>> metadata;
  const SafetensorsTensor* Find(std::string_view name) const;
};

// The header length of a file of `file_size` bytes from its first 8 bytes: errors when the
// length is zero, above the limit or runs past the end of the file.
absl::StatusOr<uint64_t> ParseSafetensorsLength(std::string_view first8, uint64_t file_size);

// Parses the N header bytes of a file of `file_size` bytes and checks every tensor: known
// dtype (F32, BF16, F16), non-negative dimensions whose product does not overflow and
// matches the byte size, offsets that tile the data section exactly (no overlap, no gap).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view header,
                                                         uint64_t file_size);

// Both steps over a whole file in memory (the fuzz target's entry point).
absl::StatusOr<SafetensorsHeader> ParseSafetensorsFile(std::string_view file);

// A Hugging Face index (model.safetensors.index.json): the weight_map, tensor name -> file, in
// the text's order, and metadata.total_size when present.
struct SafetensorsIndex {
  std::optional<int64_t> total_size;
  std::vector<std::pair<std::string, std::string>> weight_map;
};

// Whether `name` names a file of one directory: not empty, ".", "..", and without '/' or NUL.
bool IsPlainFileName(std::string_view name);

// Parses and checks an index: a JSON object with a non-empty "weight_map" object whose values
// are file names of the index's own directory (no '/', not "." or ".."), and an optional
// "metadata" object whose "total_size", when present, is a byte count >= 0. Other keys are
// ignored (transformers writes "total_parameters").
absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view text);

// The safetensors name of a dtype ("F32", "BF16", "F16").
std::string_view SafetensorsDTypeName(DType t);

// The 8 + N header bytes of a file holding `tensors` (their begin/end are assigned here,
// contiguous in the given order); the JSON is padded with spaces to a multiple of 8 bytes.
std::string BuildSafetensorsHeader(
    std::vector<SafetensorsTensor>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata);

}  // namespace fsdp::checkpoint
