// The timeline tracer (fsdp/trace.h): off by default, spans from many threads and ranks, the
// Chrome trace JSON (parsed back with a small JSON reader), escaping, lanes for overlapping
// spans, the capacity limit, the analysis helpers, the "comm" spans of a LocalWorld run,
// FSDP_TRACE (in a child process), concurrency (run under TSan by CI) and the cost per span.
#include "fsdp/trace.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "fsdp/local_world.h"
#include "gtest/gtest.h"

namespace fsdp {
namespace {

const bool kEnabledAtStartup = Tracer::Global().enabled();

// ---- a small strict JSON reader, to check that the output parses -----------------------------
struct Json {
  enum Kind { kNull, kBool, kNum, kStr, kArr, kObj } kind = kNull;
  bool b = false;
  double num = 0;
  std::string str;
  std::vector<Json> arr;
  std::vector<std::pair<std::string, Json>> obj;
  const Json* Get(std::string_view key) const {
    for (const auto& [k, v] : obj) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

class JsonReader {
 public:
  explicit JsonReader(std::string_view s) : s_(s) {}
  bool Parse(Json* out) {
    bool ok = Value(out, 0);
    Ws();
    return ok && i_ == s_.size();
  }

 private:
  void Ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\r' || s_[i_] == '\t')) ++i_;
  }
  bool Lit(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) return false;
    i_ += w.size();
    return true;
  }
  bool Value(Json* v, int depth) {
    if (depth > 64) return false;
    Ws();
    if (i_ >= s_.size()) return false;
    const char c = s_[i_];
    if (c == '{') return Object(v, depth);
    if (c == '[') return Array(v, depth);
    if (c == '"') return (v->kind = Json::kStr, String(&v->str));
    if (Lit("true")) return (v->kind = Json::kBool, v->b = true, true);
    if (Lit("false")) return (v->kind = Json::kBool, true);
    if (Lit("null")) return true;
    return Number(v);
  }
  bool Object(Json* v, int depth) {
    v->kind = Json::kObj;
    ++i_;
    Ws();
    if (Lit("}")) return true;
    for (;;) {
      Ws();
      std::string key;
      if (i_ >= s_.size() || s_[i_] != '"' || !String(&key)) return false;
      Ws();
      if (!Lit(":")) return false;
      Json val;
      if (!Value(&val, depth + 1)) return false;
      v->obj.emplace_back(std::move(key), std::move(val));
      Ws();
      if (Lit("}")) return true;
      if (!Lit(",")) return false;
    }
  }
  bool Array(Json* v, int depth) {
    v->kind = Json::kArr;
    ++i_;
    Ws();
    if (Lit("]")) return true;
    for (;;) {
      Json val;
      if (!Value(&val, depth + 1)) return false;
      v->arr.push_back(std::move(val));
      Ws();
      if (Lit("]")) return true;
      if (!Lit(",")) return false;
    }
  }
  bool Hex4(uint32_t* cp) {
    if (i_ + 4 > s_.size()) return false;
    *cp = 0;
    for (int k = 0; k < 4; ++k) {
      const char h = s_[i_++];
      const int d = h >= '0' && h <= '9' ? h - '0' : h >= 'a' && h <= 'f' ? h - 'a' + 10
                  : h >= 'A' && h <= 'F' ? h - 'A' + 10 : -1;
      if (d < 0) return false;
      *cp = *cp * 16 + d;
    }
    return true;
  }
  bool String(std::string* out) {
    ++i_;
    while (i_ < s_.size()) {
      const unsigned char c = static_cast<unsigned char>(s_[i_++]);
      if (c == '"') return true;
      if (c < 0x20) return false;  // raw control characters are not allowed
      if (c != '\\') {
        *out += static_cast<char>(c);
        continue;
      }
      if (i_ >= s_.size()) return false;
      const char e = s_[i_++];
      switch (e) {
        case '"': *out += '"'; break;
        case '\\': *out += '\\'; break;
        case '/': *out += '/'; break;
        case 'b': *out += '\b'; break;
        case 'f': *out += '\f'; break;
        case 'n': *out += '\n'; break;
        case 'r': *out += '\r'; break;
        case 't': *out += '\t'; break;
        case 'u': {
          uint32_t cp;
          if (!Hex4(&cp) || (cp >= 0xd800 && cp <= 0xdfff)) return false;  // no surrogates here
          if (cp < 0x80) {
            *out += static_cast<char>(cp);
          } else if (cp < 0x800) {
            *out += static_cast<char>(0xc0 | (cp >> 6));
            *out += static_cast<char>(0x80 | (cp & 0x3f));
          } else {
            *out += static_cast<char>(0xe0 | (cp >> 12));
            *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
            *out += static_cast<char>(0x80 | (cp & 0x3f));
          }
          break;
        }
        default: return false;
      }
    }
    return false;
  }
  bool Number(Json* v) {
    const size_t start = i_;
    if (i_ < s_.size() && s_[i_] == '-') ++i_;
    while (i_ < s_.size() && (isdigit(static_cast<unsigned char>(s_[i_])) || s_[i_] == '.' ||
                              s_[i_] == 'e' || s_[i_] == 'E' || s_[i_] == '+' || s_[i_] == '-')) {
      ++i_;
    }
    if (i_ == start) return false;
    const std::string text(s_.substr(start, i_ - start));
    char* end = nullptr;
    v->kind = Json::kNum;
    v->num = std::strtod(text.c_str(), &end);
    return end == text.c_str() + text.size();
  }
  std::string_view s_;
  size_t i_ = 0;
};

// The parsed trace: its X events, and the names of each pid and (pid, tid).
struct ParsedTrace {
  std::vector<const Json*> events;  // ph == "X"
  std::map<int, std::string> process_names;
  std::map<std::pair<int, int>, std::string> thread_names;
  std::string dropped;
  Json root;
};

void ParseTrace(const std::string& text, ParsedTrace* t) {
  ASSERT_TRUE(JsonReader(text).Parse(&t->root)) << "not valid JSON:\n" << text;
  ASSERT_EQ(t->root.kind, Json::kObj);
  const Json* events = t->root.Get("traceEvents");
  ASSERT_NE(events, nullptr);
  ASSERT_EQ(events->kind, Json::kArr);
  ASSERT_NE(t->root.Get("displayTimeUnit"), nullptr);
  EXPECT_EQ(t->root.Get("displayTimeUnit")->str, "ms");
  if (const Json* other = t->root.Get("otherData")) t->dropped = other->Get("dropped_spans")->str;
  for (const Json& e : events->arr) {
    ASSERT_EQ(e.kind, Json::kObj);
    for (const char* key : {"name", "ph", "pid", "tid"}) ASSERT_NE(e.Get(key), nullptr) << key;
    const std::string& ph = e.Get("ph")->str;
    const int pid = static_cast<int>(e.Get("pid")->num), tid = static_cast<int>(e.Get("tid")->num);
    if (ph == "X") {
      for (const char* key : {"ts", "dur", "cat", "args"}) ASSERT_NE(e.Get(key), nullptr) << key;
      EXPECT_EQ(e.Get("ts")->kind, Json::kNum);
      EXPECT_GE(e.Get("dur")->num, 0);
      t->events.push_back(&e);
    } else {
      ASSERT_EQ(ph, "M");
      const std::string& what = e.Get("name")->str;
      if (what == "process_name") t->process_names[pid] = e.Get("args")->Get("name")->str;
      if (what == "thread_name") t->thread_names[{pid, tid}] = e.Get("args")->Get("name")->str;
    }
  }
}

// Each test starts and ends with the tracer off and empty.
class TraceTest : public ::testing::Test {
 protected:
  void SetUp() override { Reset(); }
  void TearDown() override { Reset(); }
  static void Reset() {
    Tracer::Global().Disable();
    Tracer::Global().Clear();
    Tracer::Global().SetCapacity(Tracer::kDefaultCapacity);
    SetTraceRank(-1);
  }
};

Span MakeSpan(int rank, std::string stream, std::string name, int64_t b, int64_t e) {
  Span s;
  s.rank = rank;
  s.stream = std::move(stream);
  s.name = std::move(name);
  s.begin_ns = b;
  s.end_ns = e;
  return s;
}

TEST_F(TraceTest, OffByDefaultRecordsNothing) {
  if (std::getenv("FSDP_TRACE") == nullptr) {
    EXPECT_FALSE(kEnabledAtStartup);
  }
  Tracer& t = Tracer::Global();
  {
    TraceSpan span("forward", kComputeStream, {{"unit", "h.0"}});
    EXPECT_FALSE(span.active());
    span.AddArg({"bytes", 12});
  }
  t.Record(MakeSpan(0, "comm", "x", 0, 1));
  EXPECT_EQ(t.size(), 0u);
  EXPECT_TRUE(t.Snapshot().empty());
}

TEST_F(TraceTest, SpanRecordsRankStreamArgsAndTimes) {
  Tracer& t = Tracer::Global();
  t.Enable();
  SetTraceRank(3);
  const int64_t before = t.NowNs();
  {
    TraceSpan span("forward", kComputeStream, {{"unit", "transformer.h.3"}, {"bytes", 4096}});
    ASSERT_TRUE(span.active());
    span.AddArg({"micro", 2});
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  const int64_t after = t.NowNs();
  auto spans = t.Snapshot();
  ASSERT_EQ(spans.size(), 1u);
  const Span& s = spans[0];
  EXPECT_EQ(s.name, "forward");
  EXPECT_EQ(s.stream, "compute");
  EXPECT_EQ(s.rank, 3);
  EXPECT_LE(before, s.begin_ns);
  EXPECT_LE(s.end_ns, after);
  EXPECT_GE(s.duration_ns(), 2'000'000);
  ASSERT_NE(s.FindArg("unit"), nullptr);
  EXPECT_EQ(s.FindArg("unit")->str, "transformer.h.3");
  EXPECT_TRUE(s.FindArg("bytes")->is_num);
  EXPECT_EQ(s.FindArg("bytes")->num, 4096);
  EXPECT_EQ(s.FindArg("micro")->num, 2);
  // End() records once.
  {
    TraceSpan span("b", kComputeStream);
    span.End();
    span.End();
  }
  EXPECT_EQ(t.Snapshot().size(), 2u);
}

TEST_F(TraceTest, SpansOfManyThreadsAndRanksBecomeProcessesAndLanes) {
  Tracer& t = Tracer::Global();
  t.Enable();
  constexpr int kRanks = 4, kPerThread = 50;
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([r] {
      SetTraceRank(r);
      for (int i = 0; i < kPerThread; ++i) {
        TraceSpan a("forward", kComputeStream, {{"i", i}});
        TraceSpan b("all_gather", kCommStream);  // nested inside a: not the same lane anyway
      }
    });
  }
  for (auto& th : threads) th.join();  // exited threads keep their spans
  const auto spans = t.Snapshot();
  ASSERT_EQ(spans.size(), size_t{2 * kRanks * kPerThread});
  ParsedTrace p;
  ASSERT_NO_FATAL_FAILURE(ParseTrace(ChromeTraceJson(spans), &p));
  ASSERT_EQ(p.events.size(), spans.size());
  for (int r = 0; r < kRanks; ++r) EXPECT_EQ(p.process_names[r], absl::StrCat("rank ", r));
  std::map<std::pair<int, std::string>, int> count;  // (pid, lane name) -> events
  for (const Json* e : p.events) {
    const int pid = static_cast<int>(e->Get("pid")->num), tid = static_cast<int>(e->Get("tid")->num);
    const std::string lane = p.thread_names.at({pid, tid});
    EXPECT_EQ(lane, e->Get("cat")->str);
    EXPECT_EQ(lane, e->Get("name")->str == "forward" ? "compute" : "comm");
    ++count[{pid, lane}];
  }
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_EQ((count[{r, "compute"}]), kPerThread);
    EXPECT_EQ((count[{r, "comm"}]), kPerThread);
  }
}

TEST_F(TraceTest, OverlappingSpansOfOneStreamGetExtraLanesNestedOnesDoNot) {
  std::vector<Span> spans = {
      MakeSpan(0, "comm", "all_gather", 0, 100), MakeSpan(0, "comm", "reduce_scatter", 50, 150),
      MakeSpan(0, "comm", "inner", 10, 20),  // nests in all_gather: lane 1
      MakeSpan(0, "comm", "later", 150, 200),  // after both: lane 1
      MakeSpan(-1, "misc", "unranked", 0, 1)};
  ParsedTrace p;
  ASSERT_NO_FATAL_FAILURE(ParseTrace(ChromeTraceJson(spans), &p));
  std::map<std::string, std::string> lane_of;
  for (const Json* e : p.events) {
    const int pid = static_cast<int>(e->Get("pid")->num), tid = static_cast<int>(e->Get("tid")->num);
    lane_of[e->Get("name")->str] = p.thread_names.at({pid, tid});
  }
  EXPECT_EQ(lane_of["all_gather"], "comm");
  EXPECT_EQ(lane_of["inner"], "comm");
  EXPECT_EQ(lane_of["later"], "comm");
  EXPECT_EQ(lane_of["reduce_scatter"], "comm 2");
  EXPECT_EQ(lane_of["unranked"], "misc");
  EXPECT_EQ(p.process_names[kUnrankedPid], "no rank");
  // Microseconds with three decimals.
  for (const Json* e : p.events) {
    if (e->Get("name")->str == "reduce_scatter") {
      EXPECT_DOUBLE_EQ(e->Get("ts")->num, 0.05);
      EXPECT_DOUBLE_EQ(e->Get("dur")->num, 0.1);
    }
  }
}

TEST_F(TraceTest, StringsAreEscaped) {
  const std::string nasty = "a \"quoted\" \\ back\nnew\tline\r\x01\x1f/ é ✓";
  Span s = MakeSpan(0, "com\"m", nasty, 0, 10);
  s.args = {{"k\"ey", nasty}, {"n", -7}};
  Span bad = MakeSpan(1, "compute", std::string("bad\xff\xc3", 5), 0, 10);
  const std::string json = ChromeTraceJson(std::vector<Span>{s, bad});
  ParsedTrace p;
  ASSERT_NO_FATAL_FAILURE(ParseTrace(json, &p));
  ASSERT_EQ(p.events.size(), 2u);
  const Json* e = p.events[0];
  EXPECT_EQ(e->Get("name")->str, nasty);
  EXPECT_EQ(e->Get("cat")->str, "com\"m");
  EXPECT_EQ(e->Get("args")->Get("k\"ey")->str, nasty);
  EXPECT_EQ(e->Get("args")->Get("n")->num, -7);
  EXPECT_EQ(p.events[1]->Get("name")->str, "bad\xef\xbf\xbd\xef\xbf\xbd");  // two U+FFFD
}

TEST_F(TraceTest, CapacityDropsAndCounts) {
  Tracer& t = Tracer::Global();
  t.Enable();
  t.SetCapacity(10);
  for (int i = 0; i < 25; ++i) TraceSpan span("s", kComputeStream);
  EXPECT_EQ(t.size(), 10u);
  EXPECT_EQ(t.dropped(), 15);
  EXPECT_EQ(t.Snapshot().size(), 10u);
  ParsedTrace p;
  ASSERT_NO_FATAL_FAILURE(ParseTrace(ChromeTraceJson(t.Snapshot(), t.dropped()), &p));
  EXPECT_EQ(p.dropped, "15");
  t.Clear();
  EXPECT_EQ(t.size(), 0u);
  EXPECT_EQ(t.dropped(), 0);
  for (int i = 0; i < 3; ++i) TraceSpan span("s", kComputeStream);
  EXPECT_EQ(t.size(), 3u);
}

TEST_F(TraceTest, AnalysisHelpers) {
  const std::vector<Span> spans = {
      MakeSpan(0, "compute", "forward.h0", 0, 100),
      MakeSpan(0, "compute", "forward.h1", 100, 250),
      MakeSpan(0, "compute", "backward.h1", 300, 400),
      MakeSpan(0, "comm", "all_gather", 50, 150),
      MakeSpan(0, "comm", "all_gather", 120, 200),  // overlaps the previous one
      MakeSpan(0, "comm", "reduce_scatter", 400, 500),
      MakeSpan(0, "wait", "wait all_gather", 250, 300),
      MakeSpan(0, "wait", "wait reduce_scatter", 500, 520),
      MakeSpan(1, "wait", "wait all_gather", 0, 1000),
  };
  EXPECT_EQ(SumDurationNs(spans, 0, "compute"), 350);
  EXPECT_EQ(SumDurationNs(spans, 0, "compute", "forward"), 250);
  EXPECT_EQ(SumDurationNs(spans, 0, "comm"), 100 + 80 + 100);
  EXPECT_EQ(SumDurationNs(spans, kAnyRank, "wait"), 50 + 20 + 1000);
  EXPECT_EQ(SumDurationNs(spans, 0, ""), 350 + 280 + 70);
  EXPECT_EQ(UnionNs(spans, 0, "comm"), 150 + 100);
  EXPECT_EQ(UnionNs(spans, 0, "comm", 100, 450), 100 + 50);
  EXPECT_EQ(UnionNs(spans, 0, "comm", 600, 700), 0);
  EXPECT_EQ(UnionNs(spans, kAnyRank, "wait"), 1000);
  EXPECT_EQ(ExposedNs(spans, 0), 70);
  EXPECT_EQ(ExposedNs(spans, 0, kWaitStream, 0, 260), 10);
  EXPECT_EQ(ExposedNs(spans, 1), 1000);
  EXPECT_EQ(ExposedNs(spans, 2), 0);
  EXPECT_EQ(ExposedNs(spans, 0, "comm"), 250);
}

TEST_F(TraceTest, LocalWorldCollectivesRecordCommSpansPerRank) {
  Tracer::Global().Enable();
  constexpr int kRanks = 4;
  constexpr int64_t kCount = 256;
  ASSERT_TRUE(LocalWorld::Run(kRanks, {}, [&](Communicator& comm) -> absl::Status {
                EXPECT_EQ(TraceRank(), comm.rank());  // Run's threads carry their rank
                std::vector<float> send(kCount * kRanks, 1.0f), recv(kCount * kRanks);
                FSDP_RETURN_IF_ERROR(comm.AllGather(send.data(), recv.data(), kCount, DType::kF32));
                FSDP_RETURN_IF_ERROR(
                    comm.ReduceScatter(send.data(), recv.data(), kCount, DType::kF32, ReduceOp::kSum));
                FSDP_RETURN_IF_ERROR(
                    comm.AllReduce(send.data(), recv.data(), kCount, DType::kF32, ReduceOp::kSum));
                FSDP_RETURN_IF_ERROR(comm.Barrier());
                // A split group records on the world rank, named by its group.
                FSDP_ASSIGN_OR_RETURN(auto half, comm.Split(comm.rank() % 2, comm.rank()));
                return half->AllReduce(send.data(), recv.data(), kCount, DType::kF32, ReduceOp::kSum);
              }).ok());
  const auto spans = Tracer::Global().Snapshot();
  const std::vector<std::string> kinds = {"all_gather", "reduce_scatter", "all_reduce", "barrier",
                                          "split", "all_reduce"};
  const std::vector<int64_t> bytes = {kCount * kRanks * 4, kCount * kRanks * 4, kCount * 4, 0, 0,
                                      kCount * 4};
  for (int r = 0; r < kRanks; ++r) {
    std::vector<const Span*> mine;
    for (const Span& s : spans) {
      if (s.rank == r && s.stream == "comm") mine.push_back(&s);
    }
    ASSERT_EQ(mine.size(), kinds.size()) << "rank " << r;
    for (size_t i = 0; i < kinds.size(); ++i) {
      const Span& s = *mine[i];
      EXPECT_EQ(s.name, kinds[i]);
      for (const char* key : {"bytes", "dtype", "peer_wait_ns", "group", "seq", "ranks"}) {
        ASSERT_NE(s.FindArg(key), nullptr) << s.name << " has no " << key;
      }
      EXPECT_EQ(s.FindArg("bytes")->num, bytes[i]) << s.name;
      EXPECT_EQ(s.FindArg("dtype")->str, "f32");
      EXPECT_GE(s.FindArg("peer_wait_ns")->num, 0);
      EXPECT_LE(s.FindArg("peer_wait_ns")->num, s.duration_ns());
      EXPECT_EQ(s.FindArg("error"), nullptr);
      const bool in_split = i == kinds.size() - 1;
      EXPECT_EQ(s.FindArg("group")->str, in_split ? absl::StrCat("world/split", r % 2) : "world");
      EXPECT_EQ(s.FindArg("seq")->num, in_split ? 0 : static_cast<int64_t>(i));
      EXPECT_EQ(s.FindArg("ranks")->num, in_split ? 2 : kRanks);
    }
  }
  EXPECT_GT(UnionNs(spans, 0, kCommStream), 0);
}

TEST_F(TraceTest, FailedCollectiveRecordsItsError) {
  Tracer::Global().Enable();
  const absl::Status s = LocalWorld::Run(2, {}, [](Communicator& comm) {
    float x = 0;
    // Rank 1 passes a negative count: both ranks get InvalidArgument.
    return comm.AllReduce(&x, &x, comm.rank() == 1 ? -1 : 1, DType::kF32, ReduceOp::kSum);
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  const auto spans = Tracer::Global().Snapshot();
  ASSERT_EQ(spans.size(), 2u);
  for (const Span& sp : spans) {
    ASSERT_NE(sp.FindArg("error"), nullptr);
    EXPECT_EQ(sp.FindArg("error")->str, "INVALID_ARGUMENT");
  }
}

TEST_F(TraceTest, RecordingSnapshotClearAndToggleConcurrently) {
  Tracer& t = Tracer::Global();
  t.Enable();
  t.SetCapacity(5000);
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([r, &stop] {
      while (!stop.load()) {
        std::thread child([r] {  // short-lived threads: their buffers retire
          SetTraceRank(r);
          for (int i = 0; i < 100; ++i) TraceSpan span("s", kComputeStream, {{"i", i}});
        });
        child.join();
      }
    });
  }
  for (int i = 0; i < 200; ++i) {
    const auto spans = t.Snapshot();
    EXPECT_LE(spans.size(), 5000u);
    if (i % 10 == 0) (void)ChromeTraceJson(spans, t.dropped());
    if (i % 7 == 0) t.Clear();
    if (i % 13 == 0) t.Disable(); else t.Enable();
  }
  stop = true;
  for (auto& th : threads) th.join();
  t.Clear();
  EXPECT_EQ(t.size(), 0u);  // the count stays exact through racing Clears
}

TEST_F(TraceTest, WriteChromeTraceWritesAFileAndReportsErrors) {
  Tracer& t = Tracer::Global();
  t.Enable();
  SetTraceRank(0);
  { TraceSpan span("forward", kComputeStream); }
  const std::string path = (std::filesystem::temp_directory_path() /
                            absl::StrCat("fsdp_trace_test_", getpid(), ".json")).string();
  ASSERT_TRUE(t.WriteChromeTrace(path).ok());
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  ParsedTrace p;
  ASSERT_NO_FATAL_FAILURE(ParseTrace(text.str(), &p));
  EXPECT_EQ(p.events.size(), 1u);
  ASSERT_TRUE(t.WriteChromeTrace(path).ok());  // an earlier trace is replaced
  std::filesystem::remove(path);
  const absl::Status bad = t.WriteChromeTrace("/nonexistent-dir/x/trace.json");
  EXPECT_EQ(bad.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(bad.message().find("nonexistent-dir"), std::string_view::npos);
  // A file of another kind is never written over (fsdp/files.h).
  std::ofstream(path) << "notes";
  const absl::Status other = t.WriteChromeTrace(path);
  EXPECT_EQ(other.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(other.message().find("is not a Chrome trace"), std::string_view::npos) << other;
  std::ifstream kept(path);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(kept), {}), "notes");
  std::filesystem::remove(path);
}

// The body of EnvironmentEnablesAndWritesAtExit's child process, which runs it with
// --gtest_also_run_disabled_tests: DISABLED_ keeps it out of a normal run (it needs the
// environment the parent sets up).
TEST(TraceEnvChild, DISABLED_RecordsWhenEnabledByEnvironment) {
  if (std::getenv("FSDP_TRACE_TEST_CHILD") == nullptr) {
    GTEST_SKIP() << "runs only in the child process of TraceEnv.EnvironmentEnablesAndWritesAtExit";
  }
  ASSERT_TRUE(Tracer::Global().enabled());
  EXPECT_TRUE(kEnabledAtStartup);
  SetTraceRank(7);
  for (int i = 0; i < 5; ++i) TraceSpan span("from_env", kComputeStream);
}

TEST(TraceEnv, EnvironmentEnablesAndWritesAtExit) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string pattern = (dir / absl::StrCat("fsdp_env_trace_", getpid(), ".%r.json")).string();
  const std::string expect = (dir / absl::StrCat("fsdp_env_trace_", getpid(), ".5.json")).string();
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  const std::string cmd = absl::StrCat(
      "env -u OMPI_COMM_WORLD_RANK -u PMI_RANK FSDP_TRACE_TEST_CHILD=1 RANK=5 FSDP_TRACE='", pattern,
      "' FSDP_TRACE_CAPACITY=3 '", self,
      "' --gtest_also_run_disabled_tests "
      "--gtest_filter=TraceEnvChild.DISABLED_RecordsWhenEnabledByEnvironment > /dev/null 2>&1");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(expect);
  ASSERT_TRUE(in.good()) << "no file " << expect;
  std::stringstream text;
  text << in.rdbuf();
  ParsedTrace p;
  ASSERT_NO_FATAL_FAILURE(ParseTrace(text.str(), &p));
  ASSERT_EQ(p.events.size(), 3u);  // FSDP_TRACE_CAPACITY=3
  EXPECT_EQ(p.dropped, "2");
  EXPECT_EQ(p.events[0]->Get("name")->str, "from_env");
  EXPECT_EQ(p.events[0]->Get("pid")->num, 7);
  EXPECT_EQ(p.process_names[7], "rank 7");
  std::filesystem::remove(expect);
}

// Not a timing assertion: prints what a span costs, off and on.
TEST_F(TraceTest, CostPerSpan) {
  Tracer& t = Tracer::Global();
  SetTraceRank(0);
  auto ns_per = [](int n, auto&& body) {
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) body(i);
    return std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() / n;
  };
  constexpr int kOff = 2'000'000, kOn = 50'000;
  const double off_plain = ns_per(kOff, [](int) { TraceSpan span("forward", kComputeStream); });
  const double off_args = ns_per(kOff, [](int i) {
    TraceSpan span("forward", kComputeStream, {{"unit", "h.3"}, {"bytes", i}});
  });
  t.Enable();
  t.SetCapacity(size_t{4} * kOn);
  const double on_plain = ns_per(kOn, [](int) { TraceSpan span("forward", kComputeStream); });
  const double on_args = ns_per(kOn, [](int i) {
    TraceSpan span("forward", kComputeStream, {{"unit", "h.3"}, {"bytes", i}});
  });
  const auto start = std::chrono::steady_clock::now();
  const std::string json = ChromeTraceJson(t.Snapshot());
  const double write_ns =
      std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count() /
      (2 * kOn);
  std::printf("[ cost ] TraceSpan off: %.1f ns (no args), %.1f ns (2 args); on: %.1f ns (no args), "
              "%.1f ns (2 args); JSON: %.1f ns/span\n",
              off_plain, off_args, on_plain, on_args, write_ns);
  EXPECT_EQ(t.size(), size_t{2} * kOn);
  EXPECT_FALSE(json.empty());
}

}  // namespace
}  // namespace fsdp
