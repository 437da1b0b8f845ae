// Host values between the ranks of a group over the data-plane communicator, in exact f32
// encodings: strings (one byte per float) and 64-bit integers (four 16-bit pieces). Used by
// the pre-flight agreement (fsdp/agreement.h), the sharding runtime's unit check and the
// checkpoint coordination.
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
