// libFuzzer target: the safetensors reader (header length, JSON header, dtype, shape and
// offset validation) on arbitrary bytes taken as a whole file. It must never crash, hang or
// read out of bounds; every accepted header must describe tensors inside the file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "src/checkpoint/safetensors_format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  auto header = fsdp::checkpoint::ParseSafetensorsFile(file);
  if (!header.ok()) return 0;
  for (const auto& t : header->tensors) {
    if (t.begin > t.end || header->data_start + t.end > size) std::abort();
  }
  return 0;
}
