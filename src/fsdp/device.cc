// The runtime's device executor (runtime_impl.h): every buffer the runtime allocates, counted
// in its memory book, and every wait of a stream on an event. Below gather.cc and reduce.cc,
// which call down into it; the hooks (sharding_runtime.cc) sit above them all.
#include <string>

#include "absl/strings/str_cat.h"
#include "fsdp/trace.h"
#include "src/fsdp/runtime_impl.h"

namespace fsdp {

using internal::Accounted;
using internal::Unit;

absl::StatusOr<Accounted> ShardingRuntime::Impl::Alloc(internal::Gauge& category,
                                                       absl::string_view what, const Unit* unit,
                                                       int64_t numel, DType dtype) {
  const size_t bytes = static_cast<size_t>(numel) * DTypeSize(dtype);
  absl::StatusOr<Buffer> b = Buffer::Create(backend, bytes);
  if (!b.ok()) {
    return absl::Status(b.status().code(),
                        absl::StrCat("allocating ", what,
                                     unit != nullptr ? absl::StrCat(" of unit '", unit->name, "'")
                                                     : std::string(),
                                     " (", bytes, " bytes): ", b.status().message()));
  }
  return Accounted(*std::move(b), &book, &category);
}

absl::Status ShardingRuntime::Impl::StreamWait(Stream s, const Event& e, absl::string_view name,
                                               const std::string& unit) {
  if (backend->is_host() && !e.Done()) {
    TraceSpan span(std::string_view(name.data(), name.size()), kWaitStream, {{"unit", unit}});
    return backend->Wait(s, e);
  }
  return backend->Wait(s, e);
}

}  // namespace fsdp
