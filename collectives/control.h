// The control plane: host values between the ranks of a group over its host communicator, as
// bytes (u8) and 64-bit integers (i64), never through the data plane's device buffers. Used by
// the pre-flight agreement (fsdp/agreement.h), the sharding runtime's unit check, the sim data
// plane's rendezvous and the checkpoint coordination.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp::internal {

// Collective: `s` of rank `root` (at most max_bytes; longer is an error on every rank) on
// every rank.
absl::StatusOr<std::string> BroadcastString(Communicator& comm, const std::string& s, int root,
                                            size_t max_bytes);

// Collective: every rank passes the same number of values; returns all ranks' values,
// rank by rank.
absl::StatusOr<std::vector<uint64_t>> AllGatherU64(Communicator& comm,
                                                   const std::vector<uint64_t>& mine);

}  // namespace fsdp::internal
