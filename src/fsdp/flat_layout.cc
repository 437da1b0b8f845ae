// FlatLayout: offsets, padding and shard pieces of a unit's flat buffer.
#include "src/fsdp/flat_layout.h"

#include <algorithm>

namespace fsdp::internal {

FlatLayout FlatLayout::Build(std::vector<FlatTensor> tensors, int shard_size) {
  FlatLayout l;
  l.shard_size = shard_size;
  int64_t offset = 0;
  for (FlatTensor& t : tensors) {
    t.offset = offset;
    offset += t.numel;
  }
  l.tensors = std::move(tensors);
  l.numel = offset;
  l.shard_numel = (offset + shard_size - 1) / shard_size;
  l.padded_numel = l.shard_numel * shard_size;
  return l;
}

std::vector<ShardPiece> FlatLayout::Pieces(int shard_rank) const {
  return ShardPieces(tensors, shard_numel, shard_rank);
}

std::vector<DecayRange> FlatLayout::ShardDecayRanges(int shard_rank) const {
  std::vector<DecayRange> ranges;
  for (const ShardPiece& p : Pieces(shard_rank)) {
    const FlatTensor& t = tensors[p.tensor];
    if (!t.requires_grad) continue;
    const int64_t b = p.shard_offset, e = p.shard_offset + (p.tensor_end - p.tensor_begin);
    if (!ranges.empty() && ranges.back().end == b &&
        ranges.back().weight_decay == t.weight_decay) {
      ranges.back().end = e;
    } else {
      ranges.push_back({b, e, t.weight_decay});
    }
  }
  return ranges;
}

uint64_t FlatLayout::Fingerprint() const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (const FlatTensor& t : tensors) {
    for (char c : t.name) mix(static_cast<unsigned char>(c));
    mix(t.shape.size());
    for (int64_t d : t.shape) mix(static_cast<uint64_t>(d));
    mix((t.requires_grad ? 1 : 0) | (t.weight_decay ? 2 : 0));
  }
  return h;
}

}  // namespace fsdp::internal
