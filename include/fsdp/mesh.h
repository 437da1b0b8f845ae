// The 2-D device mesh of HYBRID_SHARD: world rank r sits at (replicate index r / shard,
// shard index r % shard). Ranks with the same replicate index form a shard group (FULL_SHARD
// inside it, e.g. one host); ranks with the same shard index form a replicate group (the
// gradient shards are all-reduced across it).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp {

// Where the ranks of a group run.
struct HostLayout {
  int num_hosts = 1;
  std::vector<int> host_of;  // per rank; hosts are numbered in the order of their lowest rank
  // The ranks per host when every host holds the same number of consecutive ranks (host h:
  // ranks h*R .. h*R+R-1, as mpirun's --map-by slot places them), else 0.
  int uniform_ranks_per_host() const;
  // "2 hosts x 2 ranks", or each host's ranks when they are not such blocks.
  std::string Describe() const;
};

// Collective over `world`: which ranks share a host. Ranks of the mpi communicator share a
// host when they share the hostname and the kernel's boot id; ranks of the local communicator
// are threads of one process, so one host, unless CommOptions::ranks_per_host simulates hosts
// (world rank r on host r / ranks_per_host).
absl::StatusOr<HostLayout> DiscoverHostLayout(Communicator& world);

class DeviceMesh {
 public:
  // Collective over `world`: every rank calls it with the same shape. `world` must outlive
  // the mesh. Errors, the same on every rank and at once (never a deadline): a dimension < 1,
  // replicate * shard != world.size(), ranks that disagree on the shape (each shape asked for
  // is named with its ranks), or a failed world.
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
