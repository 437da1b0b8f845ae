// libfsdp's one JSON reader and writer: the checkpoint metadata, the safetensors header, the
// timeline's Chrome trace, the benchmark's JSON lines. The reader takes hostile input (it is
// fuzzed): it checks UTF-8, bounds nesting depth,
// rejects duplicate object keys, trailing junk and lone surrogates, and never recurses
// deeper than the depth limit. Integers are kept exact as int64.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/status.h"

namespace fsdp::json {

class Value {
 public:
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };

  Kind kind() const { return kind_; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_string() const { return kind_ == Kind::kString; }
  // A number written without fraction or exponent that fits in int64.
  bool is_int() const { return kind_ == Kind::kNumber && is_int_; }

  bool boolean() const { return bool_; }
  int64_t int_value() const { return int_; }
  double number() const { return number_; }
  const std::string& str() const { return str_; }
  // Arrays: the elements. Objects: the values, in file order, with their keys().
  const std::vector<Value>& items() const { return items_; }
  const std::vector<std::string>& keys() const { return keys_; }
  // The value of `key` in an object, or nullptr.
  const Value* Find(std::string_view key) const;

 private:
  friend class Parser;
  Kind kind_ = Kind::kNull;
  bool bool_ = false;
  bool is_int_ = false;
  int64_t int_ = 0;
  double number_ = 0;
  std::string str_;
  std::vector<std::string> keys_;
  std::vector<Value> items_;
};

struct ParseLimits {
  int max_depth = 32;
};

// Parses exactly one JSON value surrounded by optional whitespace. Errors say what is wrong
// and at which byte offset.
absl::StatusOr<Value> Parse(std::string_view text, ParseLimits limits = {});

// Builds compact JSON text; the caller keeps the calls balanced.
class Writer {
 public:
  Writer& BeginObject();
  Writer& EndObject();
  Writer& BeginArray();
  Writer& EndArray();
  Writer& Key(std::string_view key);
  Writer& String(std::string_view s);
  Writer& Int(int64_t v);
  Writer& Bool(bool v);
  const std::string& text() const { return out_; }

 private:
  void Separate();
  std::string out_;
  std::vector<bool> first_;  // per open container: nothing written in it yet
  bool after_key_ = false;
};

// `s` as a quoted JSON string: quotes, backslashes and control characters escaped, and any
// byte that is not part of valid UTF-8 written as U+FFFD, so that the output always parses.
std::string Quote(std::string_view s);
// The same, appended to `out`.
void AppendQuoted(std::string& out, std::string_view s);

}  // namespace fsdp::json
