// Reports of the scaling harness's results (fsdp/bench.h): JSON lines, CSV and SVG plots, as
// fsdp_bench writes them. Not part of the core library: link the CMake target fsdp::report.
#pragma once

#include <string>
#include <vector>

#include "fsdp/bench.h"

namespace fsdp {

// The result as one JSON object (one line, no newline), CSV header and row (same columns).
std::string BenchResultJson(const BenchResult& r);
std::string BenchCsvHeader();
std::string BenchCsvRow(const BenchResult& r);

// SVG plots of a grid (standalone SVG 1.1 documents): tokens/s and scaling efficiency against
// world size, one line per strategy (and per other varying setting); the step split of each run
// as stacked bars.
std::string ThroughputSvg(const std::vector<BenchResult>& results);
std::string EfficiencySvg(const std::vector<BenchResult>& results);
std::string StepSplitSvg(const std::vector<BenchResult>& results);
// EfficiencySvg with a title of the caller's (e.g. projected runs, whose efficiency is against
// another baseline than one rank), and, when mark_world > 0, a black square at (mark_world,
// mark_value) labelled "published" (a figure to compare with).
std::string ScalingEfficiencySvg(const std::vector<BenchResult>& results,
                                 const std::string& title, int mark_world = 0,
                                 double mark_value = 0);

}  // namespace fsdp
