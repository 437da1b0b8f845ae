// The outputs of a benchmark grid: JSON lines, CSV, and SVG plots written directly
// (fsdp/bench.h).
#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "fsdp/bench_report.h"
#include "src/core/json.h"

namespace fsdp {
namespace {

// One output column: its name and its value, as JSON writes it (strings quoted, non-finite
// numbers null) and as CSV writes it (non-finite numbers empty).
struct Field {
  std::string key;
  std::string json;
  std::string csv;
};

std::string Num(double v) {
  if (!std::isfinite(v)) return "";
  return absl::StrFormat("%.6g", v);
}

// A CSV field (RFC 4180): quoted when it holds a comma, a quote or a line break, with each
// quote doubled.
std::string CsvField(const std::string& v) {
  if (v.find_first_of(",\"\r\n") == std::string::npos) return v;
  std::string out = "\"";
  for (char c : v) {
    if (c == '"') out += '"';
    out += c;
  }
  return out + "\"";
}

std::vector<Field> Fields(const BenchResult& r) {
  std::vector<Field> f;
  auto str = [&](const char* k, const std::string& v) {
    f.push_back({k, json::Quote(v), CsvField(v)});
  };
  auto num = [&](const char* k, double v) {
    const std::string s = Num(v);
    f.push_back({k, s.empty() ? "null" : s, s});
  };
  auto i64 = [&](const char* k, int64_t v) {
    f.push_back({k, absl::StrCat(v), absl::StrCat(v)});
  };
  str("model", r.model);
  str("strategy", r.strategy);
  i64("world_size", r.world_size);
  i64("hybrid_shard_size", r.hybrid_shard_size);
  i64("threads_per_rank", r.threads_per_rank);
  i64("batch_size", r.batch_size);
  i64("seq_len", r.seq_len);
  str("param_dtype", std::string(DTypeName(r.param_dtype)));
  str("reduce_dtype", std::string(DTypeName(r.reduce_dtype)));
  str("all_gather", std::string(WireFormatName(r.all_gather)));
  str("reduction", std::string(WireFormatName(r.reduction)));
  i64("quant_block", r.quant_block);
  i64("secondary_shard_size", r.secondary_shard_size);
  i64("checkpoint_every", r.checkpoint_every);
  i64("prefetch", r.prefetch);
  i64("pass", r.pass);
  i64("warmup_steps", r.warmup_steps);
  i64("steps", r.steps);
  num("link_gbps", r.link_gbps);
  num("link_latency_us", r.link_latency_us);
  i64("ranks_per_host", r.ranks_per_host);
  num("inter_gbps", r.inter_gbps);
  num("inter_latency_us", r.inter_latency_us);
  i64("num_parameters", r.num_parameters);
  i64("tokens_per_step", r.tokens_per_step);
  num("tokens_per_s", r.tokens_per_s);
  num("step_median_s", r.step_median_s);
  num("step_min_s", r.step_min_s);
  num("step_p10_s", r.step_p10_s);
  num("step_p90_s", r.step_p90_s);
  num("step_max_s", r.step_max_s);
  num("model_flops_per_step", r.model_flops_per_step);
  num("achieved_tflops", r.achieved_tflops);
  num("peak_gflops_per_core", r.peak_gflops_per_core);
  str("peak_kind", r.peak_kind);
  i64("cores_used", r.cores_used);
  num("mfu", r.mfu);
  num("step_mean_s", r.step_mean_s);
  num("compute_s", r.compute_s);
  num("exposed_comm_s", r.exposed_comm_s);
  num("optimizer_s", r.optimizer_s);
  num("other_s", r.other_s);
  num("exposed_comm_fraction", r.exposed_comm_fraction);
  num("exposed_start_s", r.exposed_start_s);
  num("exposed_forward_s", r.exposed_forward_s);
  num("exposed_head_s", r.exposed_head_s);
  num("exposed_backward_s", r.exposed_backward_s);
  num("exposed_tail_s", r.exposed_tail_s);
  num("exposed_optimizer_s", r.exposed_optimizer_s);
  num("comm_bytes_per_rank", r.comm_bytes_per_rank);
  num("bus_bytes_per_rank", r.bus_bytes_per_rank);
  num("comm_s", r.comm_s);
  i64("collectives_per_step", r.collectives_per_step);
  const MemoryReport& m = r.memory;
  i64("mem_param_shard_bytes", m.param_shard_bytes);
  i64("mem_grad_shard_bytes", m.grad_shard_bytes);
  i64("mem_optimizer_bytes", m.optimizer_bytes);
  i64("mem_gathered_param_peak_bytes", m.gathered_param_peak_bytes);
  i64("mem_grad_buffer_peak_bytes", m.grad_buffer_peak_bytes);
  i64("mem_activation_peak_bytes", m.activation_peak_bytes);
  i64("mem_secondary_param_peak_bytes", m.secondary_param_peak_bytes);
  i64("mem_peak_bytes", m.peak_bytes);
  num("host_syncs_per_step", r.host_syncs_per_step);
  num("final_loss", r.final_loss);
  num("scaling_efficiency", r.scaling_efficiency);
  num("baseline_tokens_per_s", r.baseline_tokens_per_s);
  return f;
}

// ---- SVG ---------------------------------------------------------------------------------------

std::string Esc(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '<') out += "&lt;";
    else if (c == '>') out += "&gt;";
    else if (c == '&') out += "&amp;";
    else if (c == '"') out += "&quot;";
    else out.push_back(c);
  }
  return out;
}

constexpr const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

// A label for a run's series: the strategy, plus every setting (other than the world size)
// that differs between the runs of the grid.
std::string SeriesLabel(const BenchResult& r, const std::vector<BenchResult>& all) {
  auto varies = [&](auto get) {
    std::set<std::string> seen;
    for (const BenchResult& o : all) seen.insert(get(o));
    return seen.size() > 1;
  };
  std::vector<std::pair<bool, std::string>> parts = {
      {varies([](const BenchResult& o) { return o.model; }), r.model},
      {true, r.strategy},
      {varies([](const BenchResult& o) { return std::string(DTypeName(o.param_dtype)); }),
       std::string(DTypeName(r.param_dtype))},
      {varies([](const BenchResult& o) { return absl::StrCat(o.checkpoint_every); }),
       absl::StrCat("ckpt ", r.checkpoint_every)},
      {varies([](const BenchResult& o) { return absl::StrCat(o.prefetch); }),
       r.prefetch == 0   ? std::string("no prefetch")
       : r.prefetch == 1 ? std::string("prefetch")
                         : absl::StrCat("prefetch ", r.prefetch)},
      {varies([](const BenchResult& o) {
         return absl::StrCat(o.link_gbps, "/", o.inter_gbps, "/", o.link_latency_us, "/",
                             o.inter_latency_us);
       }),
       absl::StrCat("link ", Num(r.link_gbps), "/", Num(r.inter_gbps), " GB/s")},
  };
  std::vector<std::string> out;
  for (auto& [use, text] : parts) {
    if (use) out.push_back(text);
  }
  return absl::StrJoin(out, " ");
}

double NiceMax(double v) {
  if (!(v > 0)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(v)));
  for (double m : {1.0, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0}) {
    if (m * p >= v) return m * p;
  }
  return 10 * p;
}

std::string Header(int w, int h, const std::string& title) {
  return absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
      "<text x=\"%d\" y=\"20\" text-anchor=\"middle\" font-size=\"15\">%s</text>\n",
      w, h, w, h, w / 2, Esc(title));
}

// Five horizontal grid lines with their values on the y axis, from 0 to ymax.
template <class YPos>
void YGrid(std::string& s, double ymax, int left, int pw, const YPos& ypos) {
  for (int i = 0; i <= 5; ++i) {
    const double v = ymax * i / 5;
    absl::StrAppendFormat(&s,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#ddd\"/>\n"
                          "<text x=\"%d\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n",
                          left, ypos(v), left + pw, ypos(v), left - 6, ypos(v) + 4, Num(v));
  }
}

// A line chart of y(r) against the world size, one line per series.
std::string LineChart(const std::vector<BenchResult>& results, const std::string& title,
                      const std::string& y_label, double (*y)(const BenchResult&),
                      double reference, int mark_world = 0, double mark_value = 0) {
  const int W = 760, H = 440, left = 70, right = 230, top = 40, bottom = 60;
  const int pw = W - left - right, ph = H - top - bottom;
  std::set<int> worlds;
  std::map<std::string, std::vector<std::pair<int, double>>> series;
  std::vector<std::string> order;
  double ymax = reference;
  for (const BenchResult& r : results) {
    const double v = y(r);
    if (!std::isfinite(v)) continue;
    worlds.insert(r.world_size);
    const std::string label = SeriesLabel(r, results);
    if (!series.count(label)) order.push_back(label);
    series[label].emplace_back(r.world_size, v);
    ymax = std::max(ymax, v);
  }
  ymax = NiceMax(ymax * 1.05);
  if (mark_world > 0 && mark_value > 0) worlds.insert(mark_world);
  std::vector<int> xs(worlds.begin(), worlds.end());
  auto xpos = [&](int world) {
    const size_t i = std::lower_bound(xs.begin(), xs.end(), world) - xs.begin();
    return xs.size() <= 1 ? left + pw / 2.0
                          : left + pw * static_cast<double>(i) / static_cast<double>(xs.size() - 1);
  };
  auto ypos = [&](double v) { return top + ph * (1 - v / ymax); };
  std::string s = Header(W, H, title);
  // Axes, grid and ticks.
  YGrid(s, ymax, left, pw, ypos);
  absl::StrAppendFormat(&s,
                        "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n"
                        "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
                        left, top, left, top + ph, left, top + ph, left + pw, top + ph);
  for (int x : xs) {
    absl::StrAppendFormat(&s, "<text x=\"%.1f\" y=\"%d\" text-anchor=\"middle\">%d</text>\n",
                          xpos(x), top + ph + 18, x);
  }
  absl::StrAppendFormat(&s,
                        "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">world size (ranks)"
                        "</text>\n",
                        left + pw / 2, H - 15);
  absl::StrAppendFormat(&s,
                        "<text x=\"16\" y=\"%d\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 16 %d)\">%s</text>\n",
                        top + ph / 2, top + ph / 2, Esc(y_label));
  if (reference > 0) {
    absl::StrAppendFormat(&s,
                          "<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" stroke=\"#888\" "
                          "stroke-dasharray=\"4 3\"/>\n",
                          left, ypos(reference), left + pw, ypos(reference));
  }
  for (size_t k = 0; k < order.size(); ++k) {
    auto pts = series[order[k]];
    std::sort(pts.begin(), pts.end());
    const char* color = kColors[k % std::size(kColors)];
    std::vector<std::string> coords;
    for (auto& [x, v] : pts) coords.push_back(absl::StrFormat("%.1f,%.1f", xpos(x), ypos(v)));
    absl::StrAppendFormat(&s,
                          "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" "
                          "points=\"%s\"/>\n",
                          color, absl::StrJoin(coords, " "));
    for (auto& [x, v] : pts) {
      absl::StrAppendFormat(&s,
                            "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"%s\"><title>%s, %d "
                            "ranks: %s</title></circle>\n",
                            xpos(x), ypos(v), color, Esc(order[k]), x, Num(v));
    }
    const int ly = top + 10 + 18 * static_cast<int>(k);
    absl::StrAppendFormat(&s,
                          "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>\n"
                          "<text x=\"%d\" y=\"%d\">%s</text>\n",
                          left + pw + 15, ly - 10, color, left + pw + 32, ly, Esc(order[k]));
  }
  if (mark_world > 0 && mark_value > 0) {
    const double mx = xpos(mark_world), my = ypos(mark_value);
    absl::StrAppendFormat(&s,
                          "<rect x=\"%.1f\" y=\"%.1f\" width=\"9\" height=\"9\" fill=\"black\">"
                          "<title>published: %s at %d ranks</title></rect>\n"
                          "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" font-size=\"11\">"
                          "published %s</text>\n",
                          mx - 4.5, my - 4.5, Num(mark_value), mark_world, mx - 8, my + 4,
                          Num(mark_value));
  }
  s += "</svg>\n";
  return s;
}

}  // namespace

std::string BenchResultJson(const BenchResult& r) {
  std::vector<std::string> parts;
  for (const Field& f : Fields(r)) parts.push_back(absl::StrCat("\"", f.key, "\":", f.json));
  return absl::StrCat("{", absl::StrJoin(parts, ","), "}");
}

std::string BenchCsvHeader() {
  std::vector<std::string> keys;
  for (const Field& f : Fields(BenchResult{})) keys.push_back(f.key);
  return absl::StrJoin(keys, ",");
}

std::string BenchCsvRow(const BenchResult& r) {
  std::vector<std::string> values;
  for (const Field& f : Fields(r)) values.push_back(f.csv);
  return absl::StrJoin(values, ",");
}

std::string ThroughputSvg(const std::vector<BenchResult>& results) {
  return LineChart(results, "Throughput against world size", "tokens/s",
                   [](const BenchResult& r) { return r.tokens_per_s; }, 0);
}

std::string EfficiencySvg(const std::vector<BenchResult>& results) {
  return LineChart(results,
                   "Weak-scaling efficiency: tokens/s at N / (N x tokens/s at 1 rank)",
                   "scaling efficiency",
                   [](const BenchResult& r) { return r.scaling_efficiency; }, 1.0);
}

std::string ScalingEfficiencySvg(const std::vector<BenchResult>& results,
                                 const std::string& title, int mark_world, double mark_value) {
  return LineChart(results, title, "scaling efficiency",
                   [](const BenchResult& r) { return r.scaling_efficiency; }, 1.0, mark_world,
                   mark_value);
}

std::string StepSplitSvg(const std::vector<BenchResult>& results) {
  const int n = static_cast<int>(results.size());
  // Room for the run labels, written at 45 degrees under the bars.
  size_t longest = 0;
  for (const BenchResult& r : results) {
    longest = std::max(longest, SeriesLabel(r, results).size() + 4);
  }
  const int label = static_cast<int>(static_cast<double>(longest) * 4.8);
  const int bar = 34, gap = 22, top = 40, ph = 300, right = 200;
  const int left = std::max(70, label - 10), bottom = std::max(60, label + 30);
  const int pw = std::max(200, n * (bar + gap) + gap);
  const int W = left + pw + right, H = top + ph + bottom;
  double ymax = 0;
  for (const BenchResult& r : results) ymax = std::max(ymax, r.step_mean_s * 1e3);
  ymax = NiceMax(ymax * 1.05);
  auto ypos = [&](double ms) { return top + ph * (1 - ms / ymax); };
  std::string s = Header(W, H, "Step split per run (mean over ranks and steps)");
  YGrid(s, ymax, left, pw, ypos);
  absl::StrAppendFormat(&s,
                        "<text x=\"16\" y=\"%d\" text-anchor=\"middle\" "
                        "transform=\"rotate(-90 16 %d)\">ms per step</text>\n",
                        top + ph / 2, top + ph / 2);
  const char* names[] = {"compute", "exposed communication", "optimizer", "other"};
  const char* colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#bbbbbb"};
  for (int i = 0; i < n; ++i) {
    const BenchResult& r = results[i];
    const double parts[] = {r.compute_s, r.exposed_comm_s, r.optimizer_s,
                            std::max(0.0, r.other_s)};
    const int x = left + gap + i * (bar + gap);
    double base = 0;
    for (int k = 0; k < 4; ++k) {
      const double ms = parts[k] * 1e3;
      absl::StrAppendFormat(&s,
                            "<rect x=\"%d\" y=\"%.1f\" width=\"%d\" height=\"%.1f\" fill=\"%s\">"
                            "<title>%s: %.2f ms</title></rect>\n",
                            x, ypos(base + ms), bar, ypos(base) - ypos(base + ms), colors[k],
                            names[k], ms);
      base += ms;
    }
    const std::string label = absl::StrCat(r.world_size, "r ", SeriesLabel(r, results));
    const int lx = x + bar / 2, ly = top + ph + 12;
    absl::StrAppendFormat(&s,
                          "<text x=\"%d\" y=\"%d\" text-anchor=\"end\" font-size=\"11\" "
                          "transform=\"rotate(-45 %d %d)\">%s</text>\n",
                          lx, ly, lx, ly, Esc(label));
  }
  absl::StrAppendFormat(&s, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"black\"/>\n",
                        left, top + ph, left + pw, top + ph);
  for (int k = 0; k < 4; ++k) {
    const int ly = top + 10 + 18 * k;
    absl::StrAppendFormat(&s,
                          "<rect x=\"%d\" y=\"%d\" width=\"12\" height=\"12\" fill=\"%s\"/>\n"
                          "<text x=\"%d\" y=\"%d\">%s</text>\n",
                          left + pw + 15, ly - 10, colors[k], left + pw + 32, ly, names[k]);
  }
  s += "</svg>\n";
  return s;
}

}  // namespace fsdp
