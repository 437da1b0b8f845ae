// The timeline tracer: per-rank spans of compute and communication (name, lane, begin/end,
// a few key/value args), written as Chrome trace JSON that Perfetto (ui.perfetto.dev) and
// chrome://tracing open with one process per rank and one lane per stream. docs/timeline.md
// has the long form.
//
// Off by default; with it off, the instrumentation costs one relaxed atomic load. Turn it on
// with Tracer::Global().Enable(), or for a whole program with FSDP_TRACE=<path> in the
// environment (enabled at startup, written at exit).
//
//   SetTraceRank(world.rank());                       // once per rank thread
//   {
//     TraceSpan span("forward", kComputeStream, {{"unit", "h.3"}, {"bytes", 4096}});
//     ... work ...
//   }                                                 // recorded here
//   Tracer::Global().WriteChromeTrace("/tmp/step.json");
//
// Recording takes no global lock: each thread appends to its own buffer (registered with the
// tracer on the thread's first span), and Snapshot()/WriteChromeTrace() merge the buffers. The
// tracer holds at most capacity() spans; further spans are dropped and counted (dropped()).
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <concepts>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/status.h"

namespace fsdp {

// The streams (lanes) that libfsdp itself records on. Any short name is allowed.
inline constexpr std::string_view kComputeStream = "compute";  // forward, backward, optimizer
inline constexpr std::string_view kCommStream = "comm";        // collectives, as they run
inline constexpr std::string_view kWaitStream = "wait";  // compute thread blocked on a collective
// The sharding runtime's asynchronous gathers and reductions, from issue to completion, with
// the unit they move ("unit") and whether the gather was a prefetch ("prefetch" 1).
inline constexpr std::string_view kInflightStream = "inflight";
// An asynchronous device's own streams (backends/sim): when its ops and collectives ran, as
// opposed to when the host issued them ("compute" on such a device).
inline constexpr std::string_view kDeviceComputeStream = "device compute";
inline constexpr std::string_view kDeviceCommStream = "device comm";

// One key/value annotation of a span: a string or an integer.
struct TraceArg {
  TraceArg(std::string_view k, std::string_view v) : key(k), str(v) {}
  TraceArg(std::string_view k, const char* v) : key(k), str(v) {}
  template <std::integral T>
    requires(!std::same_as<T, bool>)
  TraceArg(std::string_view k, T v) : key(k), num(static_cast<int64_t>(v)), is_num(true) {}

  std::string key;
  std::string str;  // when !is_num
  int64_t num = 0;  // when is_num
  bool is_num = false;
};

// One recorded interval. Times are nanoseconds of the steady clock since the tracer started
// (Tracer::NowNs()).
struct Span {
  std::string name;    // "forward", "all_gather", ...
  std::string stream;  // the lane within the rank: "compute", "comm", "wait", ...
  int rank = -1;       // -1: the recording thread had no trace rank
  int64_t begin_ns = 0;
  int64_t end_ns = 0;
  std::vector<TraceArg> args;

  int64_t duration_ns() const { return end_ns - begin_ns; }
  // The arg named `key`, or nullptr.
  const TraceArg* FindArg(std::string_view key) const;
};

// The rank that spans recorded on this thread belong to (a thread-local; -1 until set). The
// local communicator's progress threads carry their world rank; rank threads set their own.
void SetTraceRank(int rank);
int TraceRank();

class Tracer {
 public:
  static constexpr size_t kDefaultCapacity = size_t{1} << 20;  // spans, ~150 bytes each

  // The process-wide tracer (never destroyed, so threads may record until the very end).
  static Tracer& Global();

  void Enable() { enabled_.store(true, std::memory_order_relaxed); }
  void Disable() { enabled_.store(false, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }

  // Nanoseconds since the tracer started, and a steady_clock time converted to that scale.
  int64_t NowNs() const { return ToTraceNs(std::chrono::steady_clock::now()); }
  int64_t ToTraceNs(std::chrono::steady_clock::time_point t) const {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(t - origin_).count();
  }

  // Appends `span` to this thread's buffer; nothing when disabled; dropped (and counted) when
  // the tracer already holds capacity() spans.
  void Record(Span span);

  void SetCapacity(size_t max_spans) { capacity_.store(max_spans, std::memory_order_relaxed); }
  size_t capacity() const { return capacity_.load(std::memory_order_relaxed); }
  size_t size() const { return held_.load(std::memory_order_relaxed); }
  int64_t dropped() const { return dropped_.load(std::memory_order_relaxed); }

  // Every span held, from all threads, ordered by (rank, begin_ns). Safe while others record.
  std::vector<Span> Snapshot() const;
  // Forgets every span held and resets dropped(); the clock keeps its origin.
  void Clear();

  // Writes Snapshot() as Chrome trace JSON (ChromeTraceJson below) to `path`.
  absl::Status WriteChromeTrace(const std::string& path) const;

 private:
  struct Registry;
  Tracer();
  void EnableFromEnvironment();

  std::atomic<bool> enabled_{false};
  std::atomic<size_t> capacity_{kDefaultCapacity};
  std::atomic<size_t> held_{0};
  std::atomic<int64_t> dropped_{0};
  const std::chrono::steady_clock::time_point origin_;
  Registry* const registry_;  // the per-thread buffers
};

// Records the span from construction to destruction (or End()) on the calling thread's trace
// rank, if the tracer was enabled at construction. The args are built by the caller even when
// the tracer is off: pass costly ones through AddArg behind `if (span.active())`.
class TraceSpan {
 public:
  TraceSpan(std::string_view name, std::string_view stream,
            std::initializer_list<TraceArg> args = {})
      : active_(Tracer::Global().enabled()) {
    if (active_) Begin(name, stream, args);
  }
  ~TraceSpan() {
    if (active_) End();
  }
  TraceSpan(const TraceSpan&) = delete;
  TraceSpan& operator=(const TraceSpan&) = delete;

  bool active() const { return active_; }
  void AddArg(TraceArg arg) {
    if (active_) span_.args.push_back(std::move(arg));
  }
  // Records the span now; later calls (and the destructor) do nothing.
  void End();

 private:
  void Begin(std::string_view name, std::string_view stream, std::initializer_list<TraceArg> args);
  bool active_;
  Span span_;
};

// ---- Chrome trace JSON ----------------------------------------------------------------------
// {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}: one "X" event per span
// (ts and dur in microseconds, pid = rank, tid = a lane of that rank, cat = stream, args), and
// "M" events naming each process ("rank 3") and lane ("compute", "comm"). Spans of one stream
// that overlap without nesting (two collectives in flight at once) go to extra lanes "comm 2",
// ... since a trace viewer draws only nested slices on one lane. Unranked spans (rank -1) go to
// the process "no rank" (pid kUnrankedPid).
inline constexpr int kUnrankedPid = 1 << 30;
std::string ChromeTraceJson(std::span<const Span> spans, int64_t dropped = 0);

// ---- Analysis (benchmarks, tests) -----------------------------------------------------------
// `rank` selects one rank's spans; kAnyRank selects all. Empty `stream` matches every stream.
inline constexpr int kAnyRank = INT_MIN;
inline constexpr int64_t kTimeMin = INT64_MIN;
inline constexpr int64_t kTimeMax = INT64_MAX;

// Sum of the durations of the matching spans whose name starts with `name_prefix`
// (overlapping spans count twice).
int64_t SumDurationNs(std::span<const Span> spans, int rank, std::string_view stream,
                      std::string_view name_prefix = "");
// Time covered by the matching spans inside [window_begin_ns, window_end_ns): spans are
// clipped to the window and overlapping ones merged. E.g. communication busy time of a step.
int64_t UnionNs(std::span<const Span> spans, int rank, std::string_view stream,
                int64_t window_begin_ns = kTimeMin, int64_t window_end_ns = kTimeMax);
// Exposed communication: the time the rank's compute thread spent blocked on collectives,
// i.e. UnionNs of its `exposed_stream` ("wait") spans in the window. The sharding runtime
// records a "wait" span each time the compute thread waits for a collective, so this is the
// communication that compute did not hide.
int64_t ExposedNs(std::span<const Span> spans, int rank, std::string_view exposed_stream = kWaitStream,
                  int64_t window_begin_ns = kTimeMin, int64_t window_end_ns = kTimeMax);

}  // namespace fsdp
