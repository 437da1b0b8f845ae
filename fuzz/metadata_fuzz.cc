// libFuzzer target: the sharded checkpoint's readers on arbitrary bytes: metadata.json (and
// the JSON reader under it), the COMMIT marker and the shard file header. Accepted metadata
// must keep every piece inside its shard file.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "src/checkpoint/metadata.h"
#include "src/checkpoint/shard_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  fsdp::checkpoint::DecodeCommit(text).IgnoreError();
  fsdp::checkpoint::DecodeShardHeader(text, "fuzz").IgnoreError();
  auto meta = fsdp::checkpoint::ParseMetadata(text);
  if (!meta.ok()) return 0;
  for (const auto& t : meta->tensors) {
    for (const auto& p : t.param) {
      if (p.offset + static_cast<uint64_t>(p.end - p.begin) * 4 > meta->files[p.file].bytes) {
        std::abort();
      }
    }
  }
  return 0;
}
