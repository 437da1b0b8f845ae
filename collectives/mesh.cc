// DeviceMesh: the shard and replicate groups of HYBRID_SHARD, made with two splits.
#include "fsdp/mesh.h"

#include "absl/strings/str_format.h"

namespace fsdp {

absl::StatusOr<DeviceMesh> DeviceMesh::Create(Communicator& world, int replicate, int shard) {
  // First make sure every rank asked for the same shape (every rank takes part, even one
  // whose shape is wrong, so that the others get an error rather than a deadline).
  float shape[4] = {static_cast<float>(replicate), static_cast<float>(shard),
                    -static_cast<float>(replicate), -static_cast<float>(shard)};
  FSDP_RETURN_IF_ERROR(world.AllReduce(shape, shape, 4, DType::kF32, ReduceOp::kMax));
  if (shape[0] != -shape[2] || shape[1] != -shape[3]) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "DeviceMesh: the ranks of group '%s' asked for different shapes (replicate from %g to %g, "
        "shard from %g to %g); rank %d asked for %d x %d",
        world.name(), -shape[2], shape[0], -shape[3], shape[1], world.rank(), replicate, shard));
  }
  if (replicate < 1 || shard < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "DeviceMesh: dimensions must be >= 1, got replicate %d x shard %d", replicate, shard));
  }
  if (world.size() % shard != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "DeviceMesh: shard size %d does not divide the size %d of group '%s'", shard,
        world.size(), world.name()));
  }
  if (static_cast<int64_t>(replicate) * shard != world.size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "DeviceMesh: replicate %d x shard %d = %d ranks, but group '%s' has %d", replicate, shard,
        static_cast<int64_t>(replicate) * shard, world.name(), world.size()));
  }
  DeviceMesh mesh;
  mesh.world_ = &world;
  mesh.replicate_ = replicate;
  mesh.shard_ = shard;
  const int r = world.rank();
  FSDP_ASSIGN_OR_RETURN(mesh.shard_group_, world.Split(r / shard, r % shard, "shard"));
  FSDP_ASSIGN_OR_RETURN(mesh.replicate_group_, world.Split(r % shard, r / shard, "replicate"));
  return mesh;
}

}  // namespace fsdp
