// The data plane's public calls (fsdp/data_plane.h): the argument check every backend's plane
// shares, then the backend's Enqueue*.
#include "fsdp/data_plane.h"

#include <limits>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace fsdp {

absl::Status DataPlane::Check(CollectiveKind kind, const View& send, const View& recv,
                              ReduceOp op) const {
  const bool reduces = kind == CollectiveKind::kReduceScatter || kind == CollectiveKind::kAllReduce;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(
        kind_, " data plane '", name(), "' ", std::string(CollectiveName(kind)),
        reduces ? absl::StrCat("(", std::string(ReduceOpName(op)), ")") : std::string(),
        " on rank ", rank(), ": ", why));
  };
  if (static_cast<unsigned>(send.dtype) > static_cast<unsigned>(DType::kU8) ||
      static_cast<unsigned>(recv.dtype) > static_cast<unsigned>(DType::kU8)) {
    return bad("unknown dtype");
  }
  if (reduces && static_cast<unsigned>(op) > static_cast<unsigned>(ReduceOp::kMax)) {
    return bad(absl::StrCat("unknown reduce op ", static_cast<int>(op)));
  }
  for (const auto& [v, label] : {std::pair<const View*, const char*>{&send, "send"},
                                 std::pair<const View*, const char*>{&recv, "recv"}}) {
    if (v->count < 0) return bad(absl::StrCat("the ", label, " view has count ", v->count, " (< 0)"));
    if (v->count == 0) continue;
    if (v->count > std::numeric_limits<int64_t>::max() / 64) {
      return bad(absl::StrCat("the ", label, " view's count ", v->count, " is too large"));
    }
    if (v->backend != backend_) {
      return bad(absl::StrCat("the ", label, " view is not memory of this rank's ", kind_,
                              " backend; pass views of buffers made by the backend the data "
                              "plane was created with"));
    }
    if (v->offset < 0 || v->allocation.storage == nullptr ||
        v->offset + v->bytes() > static_cast<int64_t>(v->allocation.bytes)) {
      return bad(absl::StrCat("the ", label, " view (offset ", v->offset, ", ", v->bytes(),
                              " bytes) does not fit in its allocation of ", v->allocation.bytes,
                              " bytes"));
    }
  }
  if (send.dtype != recv.dtype) {
    return bad(absl::StrCat("send is ", std::string(DTypeName(send.dtype)), " but recv is ",
                            std::string(DTypeName(recv.dtype))));
  }
  if (reduces && !IsFloat16Or32(send.dtype)) {
    return bad(absl::StrCat("reductions take f32, bf16 or f16, not ",
                            std::string(DTypeName(send.dtype)),
                            "; all_gather and all_to_all move any dtype"));
  }
  const int64_t n = size();
  switch (kind) {
    case CollectiveKind::kAllGather:
      if (recv.count != send.count * n) {
        return bad(absl::StrCat("recv holds ", recv.count, " elements but must hold group size ",
                                n, " x send ", send.count, " = ", send.count * n));
      }
      break;
    case CollectiveKind::kReduceScatter:
      if (send.count % n != 0) {
        return bad(absl::StrCat("send holds ", send.count,
                                " elements, not a multiple of the group size ", n,
                                "; the caller pads it (PaddedCount)"));
      }
      if (recv.count * n != send.count) {
        return bad(absl::StrCat("recv holds ", recv.count, " elements but must hold send ",
                                send.count, " / group size ", n, " = ", send.count / n));
      }
      break;
    case CollectiveKind::kAllToAll:
      if (send.count % n != 0) {
        return bad(absl::StrCat("send holds ", send.count,
                                " elements, not a multiple of the group size ", n,
                                " (one equal chunk per rank); the caller pads it (PaddedCount)"));
      }
      if (send.count > 0 && send.backend == recv.backend &&
          send.allocation.storage == recv.allocation.storage &&
          send.offset < recv.offset + recv.bytes() && recv.offset < send.offset + send.bytes()) {
        return bad("send and recv overlap; all_to_all is not in place: give it separate buffers");
      }
      [[fallthrough]];
    default:
      if (recv.count != send.count) {
        return bad(absl::StrCat("send holds ", send.count, " elements but recv holds ",
                                recv.count));
      }
      break;
  }
  return absl::OkStatus();
}

absl::StatusOr<Event> DataPlane::AllGather(View send, View recv, Stream after) {
  if (absl::Status why = Check(CollectiveKind::kAllGather, send, recv, ReduceOp::kSum); !why.ok()) {
    return Rejected(CollectiveKind::kAllGather, send, recv, ReduceOp::kSum, after, std::move(why));
  }
  return EnqueueAllGather(send, recv, after);
}

absl::StatusOr<Event> DataPlane::ReduceScatter(View send, View recv, ReduceOp op, Stream after) {
  if (absl::Status why = Check(CollectiveKind::kReduceScatter, send, recv, op); !why.ok()) {
    return Rejected(CollectiveKind::kReduceScatter, send, recv, op, after, std::move(why));
  }
  return EnqueueReduceScatter(send, recv, op, after);
}

absl::StatusOr<Event> DataPlane::AllToAll(View send, View recv, Stream after) {
  if (absl::Status why = Check(CollectiveKind::kAllToAll, send, recv, ReduceOp::kSum); !why.ok()) {
    return Rejected(CollectiveKind::kAllToAll, send, recv, ReduceOp::kSum, after, std::move(why));
  }
  return EnqueueAllToAll(send, recv, after);
}

absl::StatusOr<Event> DataPlane::AllReduce(View send, View recv, ReduceOp op, Stream after) {
  if (absl::Status why = Check(CollectiveKind::kAllReduce, send, recv, op); !why.ok()) {
    return Rejected(CollectiveKind::kAllReduce, send, recv, op, after, std::move(why));
  }
  return EnqueueAllReduce(send, recv, op, after);
}

}  // namespace fsdp
