// Shard file header and COMMIT marker codecs.
#include "src/checkpoint/shard_file.h"

#include <charconv>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/checkpoint/crc32c.h"

namespace fsdp::checkpoint {
namespace {

constexpr char kMagic[8] = {'F', 'S', 'D', 'P', 'S', 'H', 'R', 'D'};
constexpr std::string_view kCommitMagic = "fsdp-checkpoint-commit 1\n";

void Put32(std::string& s, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
void Put64(std::string& s, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) s[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
}
uint32_t Get32(std::string_view s, size_t at) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}
uint64_t Get64(std::string_view s, size_t at) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(s[at + i]);
  return v;
}

// Parses a decimal uint64 that is the whole of `s`.
bool ParseU64(std::string_view s, uint64_t* out) {
  if (s.empty() || s.size() > 20) return false;
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

}  // namespace

std::string ShardFileName(int rank, int world_size) {
  return absl::StrFormat("shard-%05d-of-%05d.bin", rank, world_size);
}

std::string CrcHex(uint32_t crc) { return absl::StrFormat("0x%08x", crc); }

bool ParseCrcHex(std::string_view s, uint32_t* crc) {
  if (s.size() != 10 || s[0] != '0' || s[1] != 'x') return false;
  uint32_t v = 0;
  for (char c : s.substr(2)) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= static_cast<uint32_t>(c - 'a' + 10);
    } else {
      return false;
    }
  }
  *crc = v;
  return true;
}

std::string EncodeShardHeader(const ShardHeader& h) {
  std::string s(kShardHeaderBytes, '\0');
  std::memcpy(s.data(), kMagic, 8);
  Put32(s, 8, kFormatVersion);
  Put32(s, 12, h.rank);
  Put32(s, 16, h.world_size);
  Put64(s, 24, h.tensor_bytes);
  Put64(s, 32, h.rank_state_bytes);
  Put32(s, 40, h.payload_crc32c);
  Put32(s, 60, Crc32c(s.data(), 60));
  return s;
}

absl::StatusOr<ShardHeader> DecodeShardHeader(std::string_view b, std::string_view file) {
  auto bad = [&](std::string_view what) {
    return absl::DataLossError(absl::StrCat(std::string(file), ": ", std::string(what)));
  };
  if (b.size() < kShardHeaderBytes) {
    return bad(absl::StrCat("truncated: ", b.size(), " bytes, shorter than the ", kShardHeaderBytes,
                            "-byte shard header"));
  }
  if (std::memcmp(b.data(), kMagic, 8) != 0) return bad("not a libfsdp shard file (bad magic)");
  if (Get32(b, 60) != Crc32c(b.data(), 60)) return bad("shard header checksum mismatch");
  if (Get32(b, 8) != kFormatVersion) {
    return bad(absl::StrCat("shard format version ", Get32(b, 8), " is not supported (want ",
                            kFormatVersion, ")"));
  }
  ShardHeader h;
  h.rank = Get32(b, 12);
  h.world_size = Get32(b, 16);
  h.tensor_bytes = Get64(b, 24);
  h.rank_state_bytes = Get64(b, 32);
  h.payload_crc32c = Get32(b, 40);
  if (h.tensor_bytes > (uint64_t{1} << 60) || h.rank_state_bytes > (uint64_t{1} << 60)) {
    return bad("shard header sizes are out of range");
  }
  return h;
}

std::string EncodeCommit(const CommitRecord& c) {
  std::string body = absl::StrCat(std::string(kCommitMagic), "step ", c.step, "\n", kMetadataFile,
                                  " ", c.metadata_bytes, " ", CrcHex(c.metadata_crc32c), "\n");
  return absl::StrCat(body, "crc32c ", CrcHex(Crc32c(body)), "\n");
}

absl::StatusOr<CommitRecord> DecodeCommit(std::string_view text) {
  auto bad = [](std::string_view what) {
    return absl::DataLossError(absl::StrCat(kCommitFile, ": ", std::string(what)));
  };
  if (text.size() > 4096) return bad("too large to be a commit marker");
  if (text.substr(0, kCommitMagic.size()) != kCommitMagic)
    return bad("not a libfsdp commit marker");
  const size_t last = text.rfind("crc32c ");
  if (last == std::string_view::npos || text.empty() || text.back() != '\n') {
    return bad("truncated");
  }
  uint32_t crc = 0;
  if (!ParseCrcHex(text.substr(last + 7, text.size() - last - 8), &crc)) {
    return bad("malformed checksum line");
  }
  const std::string_view body = text.substr(0, last);
  if (Crc32c(body) != crc) return bad("checksum mismatch");
  // body: magic, "step N", "metadata.json BYTES CRC".
  std::string_view rest = body.substr(kCommitMagic.size());
  CommitRecord c;
  uint64_t step = 0;
  const size_t nl = rest.find('\n');
  if (rest.substr(0, 5) != "step " || nl == std::string_view::npos ||
      !ParseU64(rest.substr(5, nl - 5), &step) || step > (uint64_t{1} << 62)) {
    return bad("malformed step line");
  }
  c.step = static_cast<int64_t>(step);
  rest = rest.substr(nl + 1);
  const std::string prefix = absl::StrCat(kMetadataFile, " ");
  const size_t sp = rest.rfind(' ');
  if (rest.substr(0, prefix.size()) != prefix || rest.empty() || rest.back() != '\n' ||
      sp == std::string_view::npos || sp < prefix.size() ||
      !ParseU64(rest.substr(prefix.size(), sp - prefix.size()), &c.metadata_bytes) ||
      !ParseCrcHex(rest.substr(sp + 1, rest.size() - sp - 2), &c.metadata_crc32c)) {
    return bad("malformed metadata line");
  }
  return c;
}

}  // namespace fsdp::checkpoint
