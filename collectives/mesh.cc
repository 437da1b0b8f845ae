// DeviceMesh: the shard and replicate groups of HYBRID_SHARD, made with two splits.
#include "fsdp/mesh.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "collectives/shm_channel.h"

namespace fsdp {

int HostLayout::uniform_ranks_per_host() const {
  const int n = static_cast<int>(host_of.size());
  if (num_hosts < 1 || n % num_hosts != 0) return 0;
  const int per = n / num_hosts;
  for (int r = 0; r < n; ++r) {
    if (host_of[r] != r / per) return 0;
  }
  return per;
}

std::string HostLayout::Describe() const {
  if (const int per = uniform_ranks_per_host(); per > 0) {
    return absl::StrFormat("%d host%s x %d rank%s", num_hosts, num_hosts == 1 ? "" : "s", per,
                           per == 1 ? "" : "s");
  }
  std::vector<std::string> parts;
  for (int h = 0; h < num_hosts; ++h) {
    std::vector<int> ranks;
    for (size_t r = 0; r < host_of.size(); ++r) {
      if (host_of[r] == h) ranks.push_back(static_cast<int>(r));
    }
    parts.push_back(absl::StrFormat("host %d: ranks [%s]", h, absl::StrJoin(ranks, ", ")));
  }
  return absl::StrJoin(parts, "; ");
}

absl::StatusOr<HostLayout> DiscoverHostLayout(Communicator& world) {
  const CommOptions& o = world.options();
  int64_t mine = static_cast<int64_t>(internal::ThisHostId());
  if (world.backend() == "local" && o.ranks_per_host > 0) mine = world.rank() / o.ranks_per_host;
  std::vector<int64_t> ids(world.size());
  FSDP_RETURN_IF_ERROR(world.AllGather(&mine, ids.data(), 1, DType::kI64));
  HostLayout layout;
  layout.host_of.resize(ids.size());
  std::map<int64_t, int> index;
  for (size_t r = 0; r < ids.size(); ++r) {
    auto [it, added] = index.emplace(ids[r], static_cast<int>(index.size()));
    layout.host_of[r] = it->second;
  }
  layout.num_hosts = static_cast<int>(index.size());
  return layout;
}

absl::StatusOr<DeviceMesh> DeviceMesh::Create(Communicator& world, int replicate, int shard) {
  // First make sure every rank asked for the same shape: every rank takes part, even one
  // whose shape is wrong, so that the others get an error at once rather than a deadline, and
  // every rank names every shape asked for.
  const int64_t mine[2] = {replicate, shard};
  std::vector<int64_t> shapes(2 * static_cast<size_t>(world.size()));
  FSDP_RETURN_IF_ERROR(world.AllGather(mine, shapes.data(), 2, DType::kI64));
  std::vector<std::pair<std::string, std::vector<int>>> asked;  // in order of first rank
  for (int r = 0; r < world.size(); ++r) {
    const std::string shape = absl::StrFormat("%d x %d", shapes[2 * r], shapes[2 * r + 1]);
    auto it = std::find_if(asked.begin(), asked.end(), [&](auto& a) { return a.first == shape; });
    if (it == asked.end()) asked.push_back({shape, {r}}); else it->second.push_back(r);
  }
  if (asked.size() > 1) {
    std::vector<std::string> parts;
    for (const auto& [shape, ranks] : asked) {  // at most 8 ranks of each, in a big world
      const size_t shown = std::min<size_t>(ranks.size(), 8);
      const std::string more =
          ranks.size() > shown ? absl::StrFormat(", ... %d more", ranks.size() - shown) : "";
      parts.push_back(absl::StrFormat("%s on ranks [%s%s]", shape,
                                      absl::StrJoin(ranks.begin(), ranks.begin() + shown, ", "),
                                      more));
    }
    return absl::InvalidArgumentError(absl::StrFormat(
        "DeviceMesh: the ranks of group '%s' asked for different shapes (replicate x shard): "
        "%s; every rank must ask for the same shape",
        world.name(), absl::StrJoin(parts, "; ")));
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
