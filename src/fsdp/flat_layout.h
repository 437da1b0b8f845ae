// FlatLayout: where each tensor of a unit lives in the unit's flat buffer, how the buffer is
// padded so that every rank of the shard group holds the same number of elements, and which
// element ranges of a rank's shard belong to which tensor (for weight decay, frozen tensors
// and initialisation of a shard without materialising the unit).
#pragma once

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
