// The one "comm" span that every transport records per collective on the timeline tracer
// (fsdp/trace.h), so that local and mpi runs show the same lanes and args.
#pragma once

#include <algorithm>
#include <string>

#include "fsdp/communicator.h"
#include "fsdp/trace.h"

namespace fsdp::internal {

// The bytes of a collective as nccl-tests count its size: the larger of the send and receive
// buffers (all_gather: the gathered output; reduce_scatter and all_to_all: the full input).
inline int64_t CollectiveBytes(const CollectiveCall& call, int group_size) {
  const int64_t bytes =
      std::max<int64_t>(0, call.count) * static_cast<int64_t>(DTypeSize(call.dtype));
  switch (call.kind) {
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll: return bytes * group_size;
    case CollectiveKind::kAllReduce:
    case CollectiveKind::kBroadcast: return bytes;
    case CollectiveKind::kBarrier:
    case CollectiveKind::kSplit: return 0;
  }
  return 0;
}

// Records `call` (sequence `seq` of `group`) as it ran from begin_ns to end_ns on the calling
// thread's trace rank. peer_wait_ns: how long of that it waited for the other ranks to arrive
// (-1 when the transport cannot tell). Call only when the tracer is enabled.
inline void RecordCollectiveSpan(const CollectiveCall& call, const std::string& group,
                                 int group_size, int64_t seq, int64_t begin_ns, int64_t end_ns,
                                 int64_t peer_wait_ns, const absl::Status& status) {
  Span span;
  span.name = std::string(CollectiveName(call.kind));
  span.stream = std::string(kCommStream);
  span.rank = TraceRank();
  span.begin_ns = begin_ns;
  span.end_ns = end_ns;
  span.args = {{"group", group}, {"seq", seq}, {"bytes", CollectiveBytes(call, group_size)},
               {"dtype", DTypeName(call.dtype)}, {"ranks", group_size}};
  if (peer_wait_ns >= 0) span.args.emplace_back("peer_wait_ns", peer_wait_ns);
  if (!status.ok()) span.args.emplace_back("error", absl::StatusCodeToString(status.code()));
  Tracer::Global().Record(std::move(span));
}

}  // namespace fsdp::internal
