// libFuzzer target: the safetensors reader (header length, JSON header, dtype, shape and
// offset validation) on arbitrary bytes taken as a whole file, and the same bytes as a Hugging
// Face index (model.safetensors.index.json). It must never crash, hang or read out of bounds;
// every accepted header must describe tensors inside the file, and every accepted index maps
// each tensor to a plain file name.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "src/checkpoint/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  auto index = fsdp::checkpoint::ParseSafetensorsIndex(file);
  if (index.ok()) {
    if (index->weight_map.empty() || (index->total_size && *index->total_size < 0)) std::abort();
    for (const auto& [name, f] : index->weight_map) {
      if (f.empty() || f == "." || f == ".." || f.find('/') != std::string::npos) std::abort();
    }
  }
  auto header = fsdp::checkpoint::ParseSafetensorsFile(file);
  if (!header.ok()) return 0;
  for (const auto& t : header->tensors) {
    if (t.begin > t.end || header->data_start + t.end > size) std::abort();
  }
  return 0;
}
