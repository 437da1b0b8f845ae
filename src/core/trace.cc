// The timeline tracer (fsdp/trace.h): per-thread span buffers, the Chrome trace JSON writer
// with its lane assignment, the analysis helpers, and FSDP_TRACE (enable at startup, write at
// exit).
#include "fsdp/trace.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <system_error>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "fsdp/files.h"
#include "src/core/json.h"

namespace fsdp {
namespace {

thread_local int tls_trace_rank = -1;

// One thread's spans. The owner appends under `mu` (uncontended but for Snapshot and Clear),
// into fixed-size chunks, so that spans are never moved once recorded.
struct ThreadBuffer {
  static constexpr size_t kChunk = 1024;
  std::mutex mu;
  std::vector<std::vector<Span>> chunks;
  size_t size = 0;
  std::atomic<bool> retired{false};  // the thread has exited: dropped at the next Clear()

  void Append(Span&& span) {
    if (chunks.empty() || chunks.back().size() == kChunk) {
      chunks.emplace_back();
      chunks.back().reserve(kChunk);
    }
    chunks.back().push_back(std::move(span));
    ++size;
  }
};

// The thread's handle on its buffer; the registry shares ownership, so the spans of a thread
// that has exited stay until Clear().
struct ThreadSlot {
  std::shared_ptr<ThreadBuffer> buffer;
  ~ThreadSlot() {
    if (buffer) buffer->retired.store(true, std::memory_order_release);
  }
};
thread_local ThreadSlot tls_slot;

}  // namespace

struct Tracer::Registry {
  std::mutex mu;
  std::vector<std::shared_ptr<ThreadBuffer>> buffers;
  std::string exit_path;  // FSDP_TRACE
};

const TraceArg* Span::FindArg(std::string_view key) const {
  for (const TraceArg& a : args) {
    if (a.key == key) return &a;
  }
  return nullptr;
}

void SetTraceRank(int rank) { tls_trace_rank = rank; }
int TraceRank() { return tls_trace_rank; }

Tracer::Tracer() : origin_(std::chrono::steady_clock::now()), registry_(new Registry) {}

Tracer& Tracer::Global() {
  static Tracer* const tracer = [] {
    auto* t = new Tracer();  // never deleted: threads may record while the process exits
    t->EnableFromEnvironment();
    return t;
  }();
  return *tracer;
}

void Tracer::Record(Span span) {
  if (!enabled()) return;
  if (held_.fetch_add(1, std::memory_order_relaxed) >= capacity()) {
    held_.fetch_sub(1, std::memory_order_relaxed);
    dropped_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  if (tls_slot.buffer == nullptr) {
    tls_slot.buffer = std::make_shared<ThreadBuffer>();
    std::lock_guard<std::mutex> lock(registry_->mu);
    registry_->buffers.push_back(tls_slot.buffer);
  }
  ThreadBuffer& b = *tls_slot.buffer;
  std::lock_guard<std::mutex> lock(b.mu);
  b.Append(std::move(span));
}

std::vector<Span> Tracer::Snapshot() const {
  std::vector<Span> all;
  {
    std::lock_guard<std::mutex> lock(registry_->mu);
    for (const auto& b : registry_->buffers) {
      std::lock_guard<std::mutex> block(b->mu);
      for (const auto& chunk : b->chunks) all.insert(all.end(), chunk.begin(), chunk.end());
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Span& a, const Span& b) {
    return std::tie(a.rank, a.begin_ns) < std::tie(b.rank, b.begin_ns);
  });
  return all;
}

void Tracer::Clear() {
  size_t removed = 0;
  {
    std::lock_guard<std::mutex> lock(registry_->mu);
    for (const auto& b : registry_->buffers) {
      std::lock_guard<std::mutex> block(b->mu);
      removed += b->size;
      b->size = 0;
      b->chunks.clear();
    }
    // A thread may have appended (and then exited) after its buffer was emptied above: count
    // what a retired buffer still holds before dropping it, or held_ would never fall back.
    std::erase_if(registry_->buffers, [&removed](const auto& b) {
      if (!b->retired.load(std::memory_order_acquire)) return false;
      std::lock_guard<std::mutex> block(b->mu);
      removed += b->size;
      return true;
    });
  }
  // Subtract what was removed (not store 0): a Record racing with Clear stays counted.
  held_.fetch_sub(removed, std::memory_order_relaxed);
  dropped_.store(0, std::memory_order_relaxed);
}

absl::Status Tracer::WriteChromeTrace(const std::string& path) const {
  // A new file or an earlier trace only (fsdp/files.h), written whole and renamed into place.
  const absl::Status s =
      WriteOutputFile(path, ChromeTraceJson(Snapshot(), dropped()), kChromeTraceFile);
  if (!s.ok()) return absl::Status(s.code(), absl::StrCat("WriteChromeTrace: ", s.message()));
  return absl::OkStatus();
}

// ---- FSDP_TRACE -----------------------------------------------------------------------------

namespace {

// FSDP_TRACE's path with %r replaced by the process's rank (from the launcher's environment,
// else the process id) and %p by the process id, so that each MPI process writes its own file.
std::string ExpandTracePath(std::string path) {
  std::string rank = std::to_string(getpid());
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      rank = v;
      break;
    }
  }
  for (auto [key, value] : {std::pair<std::string, std::string>{"%r", rank},
                            std::pair<std::string, std::string>{"%p", std::to_string(getpid())}}) {
    for (size_t at = path.find(key); at != std::string::npos; at = path.find(key, at + value.size())) {
      path.replace(at, key.size(), value);
    }
  }
  return path;
}

void WriteTraceAtExit() {
  Tracer& t = Tracer::Global();
  const std::string path = ExpandTracePath(std::getenv("FSDP_TRACE") ? std::getenv("FSDP_TRACE") : "");
  if (path.empty()) return;
  const absl::Status s = t.WriteChromeTrace(path);
  if (s.ok()) {
    std::fprintf(stderr, "libfsdp: wrote the timeline (%zu spans, %lld dropped) to %s\n", t.size(),
                 static_cast<long long>(t.dropped()), path.c_str());
  } else {
    std::fprintf(stderr, "libfsdp: FSDP_TRACE: %s\n", std::string(s.message()).c_str());
  }
}

// Links the environment check into every program that links the tracer, so that spans are
// recorded from startup, not from the first span.
[[maybe_unused]] const bool kTracerAtStartup = (Tracer::Global(), true);

}  // namespace

void Tracer::EnableFromEnvironment() {
  const char* path = std::getenv("FSDP_TRACE");
  if (path == nullptr || *path == '\0') return;
  if (const char* cap = std::getenv("FSDP_TRACE_CAPACITY"); cap != nullptr) {
    char* end = nullptr;
    const unsigned long long n = std::strtoull(cap, &end, 10);
    if (end != cap && *end == '\0') SetCapacity(n);
  }
  Enable();
  std::atexit(WriteTraceAtExit);
}

// ---- TraceSpan ------------------------------------------------------------------------------

void TraceSpan::Begin(std::string_view name, std::string_view stream,
                      std::initializer_list<TraceArg> args) {
  span_.name = std::string(name);
  span_.stream = std::string(stream);
  span_.rank = TraceRank();
  span_.args.assign(args.begin(), args.end());
  span_.begin_ns = Tracer::Global().NowNs();
}

void TraceSpan::End() {
  if (!active_) return;
  active_ = false;
  span_.end_ns = Tracer::Global().NowNs();
  Tracer::Global().Record(std::move(span_));
}

// ---- Chrome trace JSON ----------------------------------------------------------------------

namespace {

void AppendJsonString(std::string& out, std::string_view s) { json::AppendQuoted(out, s); }

// Nanoseconds as microseconds with three decimals (exact).
std::string Micros(int64_t ns) {
  const uint64_t mag = ns < 0 ? 0 - static_cast<uint64_t>(ns) : static_cast<uint64_t>(ns);
  return absl::StrFormat("%s%d.%03d", ns < 0 ? "-" : "", mag / 1000, mag % 1000);
}

// Streams in display order: libfsdp's own first, then the others by name.
int StreamOrder(std::string_view s) {
  if (s == kComputeStream) return 0;
  if (s == kWaitStream) return 1;
  if (s == kCommStream) return 2;
  return 3;
}

struct Lane {
  std::vector<int64_t> open_ends;  // ends of the spans open at the current time, innermost last
};

}  // namespace

std::string ChromeTraceJson(std::span<const Span> spans, int64_t dropped) {
  // (pid, stream) -> indices of its spans.
  std::map<int, std::map<std::pair<int, std::string>, std::vector<size_t>>> by_rank;
  for (size_t i = 0; i < spans.size(); ++i) {
    const int pid = spans[i].rank >= 0 ? spans[i].rank : kUnrankedPid;
    by_rank[pid][{StreamOrder(spans[i].stream), spans[i].stream}].push_back(i);
  }
  std::string out = "{\"traceEvents\":[\n";
  bool first = true;
  auto begin_event = [&] {
    if (!first) out += ",\n";
    first = false;
  };
  auto metadata = [&](const char* what, int pid, int tid, std::string_view key, auto value) {
    begin_event();
    absl::StrAppendFormat(&out, R"({"name":"%s","ph":"M","pid":%d,"tid":%d,"args":{"%s":)", what,
                          pid, tid, std::string(key));
    if constexpr (std::is_integral_v<decltype(value)>) {
      absl::StrAppend(&out, value);
    } else {
      AppendJsonString(out, value);
    }
    out += "}}";
  };
  for (auto& [pid, streams] : by_rank) {
    metadata("process_name", pid, 0, "name",
             pid == kUnrankedPid ? std::string("no rank") : absl::StrCat("rank ", pid));
    metadata("process_sort_index", pid, 0, "sort_index", pid);
    int next_tid = 1;
    for (auto& [key, indices] : streams) {
      const std::string& stream = key.second;
      // Longest first among equal begins, so that an enclosing span is placed before its children.
      std::stable_sort(indices.begin(), indices.end(), [&](size_t a, size_t b) {
        return std::make_pair(spans[a].begin_ns, -spans[a].end_ns) <
               std::make_pair(spans[b].begin_ns, -spans[b].end_ns);
      });
      std::vector<Lane> lanes;
      const int base_tid = next_tid;
      for (size_t i : indices) {
        const Span& s = spans[i];
        const int64_t end = std::max(s.begin_ns, s.end_ns);
        size_t lane = 0;
        for (; lane < lanes.size(); ++lane) {
          auto& open = lanes[lane].open_ends;
          while (!open.empty() && open.back() <= s.begin_ns) open.pop_back();
          if (open.empty() || open.back() >= end) break;  // free, or nests inside the innermost
        }
        if (lane == lanes.size()) lanes.emplace_back();
        lanes[lane].open_ends.push_back(end);
        begin_event();
        out += "{\"name\":";
        AppendJsonString(out, s.name);
        out += ",\"cat\":";
        AppendJsonString(out, stream);
        absl::StrAppend(&out, ",\"ph\":\"X\",\"ts\":", Micros(s.begin_ns), ",\"dur\":",
                        Micros(end - s.begin_ns), ",\"pid\":", pid,
                        ",\"tid\":", base_tid + static_cast<int>(lane), ",\"args\":{");
        for (size_t a = 0; a < s.args.size(); ++a) {
          if (a > 0) out += ',';
          AppendJsonString(out, s.args[a].key);
          out += ':';
          if (s.args[a].is_num) {
            absl::StrAppend(&out, s.args[a].num);
          } else {
            AppendJsonString(out, s.args[a].str);
          }
        }
        out += "}}";
      }
      for (size_t lane = 0; lane < lanes.size(); ++lane) {
        const int tid = base_tid + static_cast<int>(lane);
        metadata("thread_name", pid, tid, "name",
                 lane == 0 ? stream : absl::StrCat(stream, " ", lane + 1));
        metadata("thread_sort_index", pid, tid, "sort_index", tid);
      }
      next_tid += static_cast<int>(lanes.size());
    }
  }
  absl::StrAppend(&out, "\n],\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"libfsdp\","
                        "\"dropped_spans\":\"",
                  dropped, "\"}}\n");
  return out;
}

// ---- Analysis -------------------------------------------------------------------------------

namespace {

bool Matches(const Span& s, int rank, std::string_view stream) {
  return (rank == kAnyRank || s.rank == rank) && (stream.empty() || s.stream == stream);
}

}  // namespace

int64_t SumDurationNs(std::span<const Span> spans, int rank, std::string_view stream,
                      std::string_view name_prefix) {
  int64_t total = 0;
  for (const Span& s : spans) {
    if (Matches(s, rank, stream) && std::string_view(s.name).starts_with(name_prefix)) {
      total += std::max<int64_t>(0, s.duration_ns());
    }
  }
  return total;
}

int64_t UnionNs(std::span<const Span> spans, int rank, std::string_view stream,
                int64_t window_begin_ns, int64_t window_end_ns) {
  std::vector<std::pair<int64_t, int64_t>> parts;
  for (const Span& s : spans) {
    if (!Matches(s, rank, stream)) continue;
    const int64_t b = std::max(s.begin_ns, window_begin_ns);
    const int64_t e = std::min(s.end_ns, window_end_ns);
    if (b < e) parts.emplace_back(b, e);
  }
  std::sort(parts.begin(), parts.end());
  int64_t total = 0, cur_b = 0, cur_e = 0;
  bool open = false;
  for (const auto& [b, e] : parts) {
    if (open && b <= cur_e) {
      cur_e = std::max(cur_e, e);
      continue;
    }
    if (open) total += cur_e - cur_b;
    cur_b = b;
    cur_e = e;
    open = true;
  }
  if (open) total += cur_e - cur_b;
  return total;
}

int64_t ExposedNs(std::span<const Span> spans, int rank, std::string_view exposed_stream,
                  int64_t window_begin_ns, int64_t window_end_ns) {
  return UnionNs(spans, rank, exposed_stream, window_begin_ns, window_end_ns);
}

}  // namespace fsdp
