// The unit record's helpers: state names, deferred frees, the in-flight timeline lane.
#include "src/fsdp/unit.h"

#include "fsdp/trace.h"

namespace fsdp::internal {

absl::string_view StateName(UnitState s) {
  switch (s) {
    case UnitState::kIdle: return "idle";
    case UnitState::kForward: return "in forward (after PreForward)";
    case UnitState::kForwardDone: return "after PostForward";
    case UnitState::kBackward: return "in backward (after PreBackward)";
    case UnitState::kBackwardDone: return "after PostBackward";
  }
  return "?";
}

bool PendingFrees::Entry::Done() const {
  return std::all_of(events.begin(), events.end(), [](const Event& e) { return e.Done(); });
}

void PendingFrees::Add(Accounted buffer, std::vector<Event> events) {
  if (!buffer.allocated()) return;
  std::erase_if(events, [](const Event& e) { return e.Done(); });
  if (events.empty()) return;  // nothing uses it any more: `buffer` is freed here
  entries_.push_back({std::move(buffer), std::move(events)});
}

void PendingFrees::Collect() {
  std::erase_if(entries_, [](const Entry& e) { return e.Done(); });
}

int PendingFrees::Count(const Gauge* gauge) const {
  return static_cast<int>(std::count_if(entries_.begin(), entries_.end(), [&](const Entry& e) {
    return e.buffer.gauge() == gauge;
  }));
}

int PendingFrees::WaitUntilAtMost(const Gauge* gauge, int keep) {
  int waited = 0;
  Collect();
  while (Count(gauge) > keep) {
    for (Entry& e : entries_) {
      if (e.buffer.gauge() != gauge) continue;
      for (const Event& ev : e.events) ev.Wait().IgnoreError();  // its error surfaces elsewhere
      ++waited;
      break;
    }
    Collect();
  }
  return waited;
}

void PendingFrees::Drain() {
  for (Entry& e : entries_) {
    for (const Event& ev : e.events) ev.Wait().IgnoreError();
  }
  entries_.clear();
}

void RecordInflight(const Event& done, absl::string_view name, int64_t issued_ns,
                    const std::string& unit, bool prefetched) {
  Tracer& tracer = Tracer::Global();
  if (!tracer.enabled() || issued_ns == 0) return;
  const auto at = done.completed_at();
  Span span;
  span.name = std::string(name);
  span.stream = std::string(kInflightStream);
  span.rank = TraceRank();
  span.begin_ns = issued_ns;
  span.end_ns = at ? tracer.ToTraceNs(*at) : tracer.NowNs();
  span.args = {{"unit", unit}, {"prefetch", prefetched ? 1 : 0}};
  tracer.Record(std::move(span));
}

int64_t NowIfTracing() {
  Tracer& tracer = Tracer::Global();
  return tracer.enabled() ? tracer.NowNs() : 0;
}

}  // namespace fsdp::internal
