// The 2-D device mesh of HYBRID_SHARD: world rank r sits at (replicate index r / shard,
// shard index r % shard). Ranks with the same replicate index form a shard group (FULL_SHARD
// inside it, e.g. one host); ranks with the same shard index form a replicate group (the
// gradient shards are all-reduced across it).
#pragma once

#include <memory>

#include "fsdp/communicator.h"

namespace fsdp {

class DeviceMesh {
 public:
  // Collective over `world`: every rank calls it with the same shape. `world` must outlive
  // the mesh. Errors: a dimension < 1, replicate * shard != world.size(), ranks that disagree
  // on the shape, or a failed world.
  static absl::StatusOr<DeviceMesh> Create(Communicator& world, int replicate, int shard);

  int replicate_size() const { return replicate_; }
  int shard_size() const { return shard_; }
  int replicate_index() const { return world_->rank() / shard_; }
  int shard_index() const { return world_->rank() % shard_; }

  Communicator& world() const { return *world_; }
  // size shard_size(), rank shard_index(); named "<world>/shard<replicate_index>".
  Communicator& shard_group() const { return *shard_group_; }
  // size replicate_size(), rank replicate_index(); named "<world>/replicate<shard_index>".
  Communicator& replicate_group() const { return *replicate_group_; }

 private:
  DeviceMesh() = default;
  Communicator* world_ = nullptr;
  int replicate_ = 1, shard_ = 1;
  std::unique_ptr<Communicator> shard_group_, replicate_group_;
};

}  // namespace fsdp
