// The command line of libfsdp's programs (train_gpt, fsdp_plan, fsdp_bench,
// collectives_bench): absl::flags with the exit codes the programs document, 2 for bad usage
// and 0 for --help. Header-only; the program links absl::flags_parse and absl::flags_usage.
#pragma once

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"

namespace fsdp::cli {

inline constexpr int kExitUsage = 2;

inline std::atomic<int>& ExitCodeWhileParsing() {
  static std::atomic<int> code{-1};
  return code;
}

// absl::ParseCommandLine ends the process with exit(1) both on a malformed command line (an
// unknown flag, "--steps=abc") and after --help. While it runs, this atexit handler turns
// that into 2 for bad usage and 0 for the help and version flags.
inline void ExitWithParsingCode() {
  const int code = ExitCodeWhileParsing().load();
  if (code >= 0) {
    std::fflush(nullptr);
    std::_Exit(code);
  }
}

// absl::ParseCommandLine with those exit codes; returns the positional arguments (argv[0]
// first).
inline std::vector<char*> ParseCommandLine(int argc, char** argv) {
  bool help = false;
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    std::string_view a = argv[i];
    if (!a.starts_with('-')) continue;  // a value, e.g. of --prompt
    while (!a.empty() && a.front() == '-') a.remove_prefix(1);
    help = help || a.starts_with("help") || a == "version" || a == "only_check_args";
  }
  ExitCodeWhileParsing() = help ? 0 : kExitUsage;
  static const bool registered = (std::atexit(ExitWithParsingCode), true);
  (void)registered;
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  ExitCodeWhileParsing() = -1;
  return rest;
}

// Before ParseCommandLine, for programs whose every error is one line of their own: prints
// `help` and exits 0 for --help (-h, --helpfull); calls `bad_usage` (which must not return)
// with one line for a flag this program does not have, a flag without its value, or a switch
// given a value other than 0/1 (true/false). Values are checked by the program afterwards.
// Returns the names of the flags given (without dashes; a negated switch under its own name).
template <typename BadUsage>
std::set<std::string> CheckFlagsBeforeParsing(int argc, char** argv, std::string_view help,
                                              BadUsage bad_usage) {
  std::set<std::string> given;
  for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i) {
    std::string_view a = argv[i];
    if (a == "-h" || a == "--help" || a == "-help" || a == "--helpfull") {
      std::fwrite(help.data(), 1, help.size(), stdout);
      std::exit(0);
    }
    if (!a.starts_with('-')) continue;  // a positional argument (the program refuses it)
    std::string name(a);  // std::string: absl's string_view is not std's in every build
    while (!name.empty() && name.front() == '-') name.erase(0, 1);
    const size_t eq = name.find('=');
    const bool has_value = eq != std::string::npos;
    const std::string value = has_value ? name.substr(eq + 1) : "";
    if (has_value) name.resize(eq);
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    const absl::CommandLineFlag* negated =
        name.starts_with("no") ? absl::FindCommandLineFlag(name.substr(2)) : nullptr;
    if (flag == nullptr && (negated == nullptr || !negated->IsOfType<bool>())) {
      bad_usage(absl::StrCat("unknown flag '--", name, "'"));
    }
    given.insert(flag != nullptr ? name : name.substr(2));
    const bool is_bool = flag == nullptr || flag->IsOfType<bool>();
    if (is_bool && has_value && value != "0" && value != "1" && value != "true" &&
        value != "false") {
      bad_usage(absl::StrCat("--", name, "=", value, ": allowed: 0 or 1"));
    }
    if (!is_bool && !has_value) {
      if (i + 1 >= argc) bad_usage(absl::StrCat("--", name, ": needs a value"));
      ++i;  // its value
    }
  }
  return given;
}

}  // namespace fsdp::cli
