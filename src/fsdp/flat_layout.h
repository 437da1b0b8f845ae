// FlatLayout: where each tensor of a unit lives in the unit's flat buffer, how the buffer is
// padded so that every rank of the shard group holds the same number of elements, and which
// element ranges of a rank's shard belong to which tensor (for weight decay, frozen tensors
// and initialisation of a shard without materialising the unit).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/optim.h"

namespace fsdp::internal {

struct FlatTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in the unit's flat buffer
  bool requires_grad = true;
  bool weight_decay = false;
};

// The part of one tensor that falls inside a shard.
struct ShardPiece {
  int tensor = 0;            // index into FlatLayout::tensors
  int64_t tensor_begin = 0;  // element range [tensor_begin, tensor_end) of the tensor
  int64_t tensor_end = 0;
  int64_t shard_offset = 0;  // where tensor_begin sits in the shard
};

// The pieces of `tensors` (anything with element `offset` and `numel` in a unit's padded flat
// buffer: FlatTensor, TensorSlot) inside shard `shard_rank`, which is elements
// [shard_rank * shard_numel, (shard_rank + 1) * shard_numel) of the buffer, in shard order.
// The one definition of what a shard holds: the runtime's optimizer ranges and initialisation
// and the checkpoints' files all use it.
template <typename Tensors>
std::vector<ShardPiece> ShardPieces(const Tensors& tensors, int64_t shard_numel, int shard_rank) {
  std::vector<ShardPiece> pieces;
  const int64_t lo = shard_rank * shard_numel, hi = lo + shard_numel;
  for (int i = 0; i < static_cast<int>(tensors.size()); ++i) {
    const int64_t b = std::max(lo, tensors[i].offset);
    const int64_t e = std::min(hi, tensors[i].offset + tensors[i].numel);
    if (b >= e) continue;
    pieces.push_back({i, b - tensors[i].offset, e - tensors[i].offset, b - lo});
  }
  std::sort(pieces.begin(), pieces.end(), [](const ShardPiece& a, const ShardPiece& b) {
    return a.shard_offset < b.shard_offset;
  });
  return pieces;
}

struct FlatLayout {
  std::vector<FlatTensor> tensors;
  int64_t numel = 0;         // sum of tensor numels
  int64_t padded_numel = 0;  // numel rounded up to a multiple of the shard group size
  int64_t shard_numel = 0;   // padded_numel / shard group size
  int shard_size = 1;

  // tensors' offsets are assigned in order; padding goes at the end.
  static FlatLayout Build(std::vector<FlatTensor> tensors, int shard_size);

  int64_t shard_begin(int shard_rank) const { return shard_rank * shard_numel; }
  // Tensor pieces inside the shard of `shard_rank`, in shard order (padding excluded).
  std::vector<ShardPiece> Pieces(int shard_rank) const;
  // Optimizer ranges of a shard: trainable tensors only (frozen ones and padding are left
  // out, so the optimizer never touches them), with their weight-decay flags.
  std::vector<DecayRange> ShardDecayRanges(int shard_rank) const;
  // 64-bit fingerprint of names, shapes and flags: equal on every rank or the ranks disagree.
  uint64_t Fingerprint() const;
};

}  // namespace fsdp::internal
