// The fixed binary header of a shard file and the COMMIT marker of a sharded checkpoint
// (docs/checkpoints.md "Format"). Encoding and checked decoding only; no I/O.
//
// shard-RRRRR-of-NNNNN.bin = 64-byte header | tensor data (raw little-endian f32, at the
// offsets the metadata records) | this rank's own state bytes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "fsdp/status.h"

namespace fsdp::checkpoint {

inline constexpr uint64_t kShardHeaderBytes = 64;
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr char kMetadataFile[] = "metadata.json";
inline constexpr char kCommitFile[] = "COMMIT";

struct ShardHeader {
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint64_t tensor_bytes = 0;      // bytes [64, 64 + tensor_bytes)
  uint64_t rank_state_bytes = 0;  // right after the tensor data
  uint32_t payload_crc32c = 0;    // CRC32C of everything after the header
  uint64_t file_bytes() const { return kShardHeaderBytes + tensor_bytes + rank_state_bytes; }
};

// "shard-00003-of-00008.bin".
std::string ShardFileName(int rank, int world_size);

std::string EncodeShardHeader(const ShardHeader& h);
// Checks magic, version and the header's own checksum; `file` names the file in errors.
absl::StatusOr<ShardHeader> DecodeShardHeader(std::string_view bytes, std::string_view file);

// The COMMIT marker, written last: the step and the size and CRC32C of metadata.json, then a
// line with the CRC32C of the lines before it.
struct CommitRecord {
  int64_t step = 0;
  uint64_t metadata_bytes = 0;
  uint32_t metadata_crc32c = 0;
};
std::string EncodeCommit(const CommitRecord& c);
absl::StatusOr<CommitRecord> DecodeCommit(std::string_view text);

// "0x1a2b3c4d" and back.
std::string CrcHex(uint32_t crc);
bool ParseCrcHex(std::string_view s, uint32_t* crc);

}  // namespace fsdp::checkpoint
