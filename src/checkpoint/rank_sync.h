// Collectives the checkpoint code needs beyond the float data path: agreeing on success
// (every rank returns the same status), and moving strings and 64-bit integers between ranks
// (encoded exactly in f32: bytes one per float, integers as 16-bit chunks).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "fsdp/communicator.h"

namespace fsdp::checkpoint {

// Collective: OK on every rank when every rank passed OK; otherwise, on every rank, the
// error of the lowest failing rank, prefixed with "rank R: " (message cut to 2000 bytes).
absl::Status AgreeOnStatus(Communicator& comm, const absl::Status& local);

// Collective: `s` of rank `root` (at most max_bytes) on every rank.
absl::StatusOr<std::string> BroadcastString(Communicator& comm, const std::string& s, int root,
                                            size_t max_bytes);

// Collective: every rank passes the same number of values; returns all ranks' values,
// rank by rank.
absl::StatusOr<std::vector<uint64_t>> AllGatherU64(Communicator& comm,
                                                   const std::vector<uint64_t>& mine);

}  // namespace fsdp::checkpoint
