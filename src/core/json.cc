// The JSON reader (recursive descent with a depth bound) and writer of json.h.
#include "src/core/json.h"

#include <algorithm>
#include <charconv>
#include <numeric>

#include "absl/strings/str_cat.h"

namespace fsdp::json {

const Value* Value::Find(std::string_view key) const {
  if (kind_ != Kind::kObject) return nullptr;
  for (size_t i = 0; i < keys_.size(); ++i) {
    if (keys_[i] == key) return &items_[i];
  }
  return nullptr;
}

class Parser {
 public:
  Parser(std::string_view text, ParseLimits limits) : s_(text), limits_(limits) {}

  absl::StatusOr<Value> ParseDocument() {
    Value v;
    FSDP_RETURN_IF_ERROR(ParseValue(v, 0));
    SkipSpace();
    if (pos_ != s_.size()) return Error("unexpected data after the JSON value");
    return v;
  }

 private:
  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid JSON at byte ", pos_, ": ", std::string(what)));
  }
  void SkipSpace() {
    while (pos_ < s_.size() &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Consume(std::string_view word) {
    if (s_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  absl::Status ParseValue(Value& v, int depth) {
    SkipSpace();
    if (pos_ >= s_.size()) return Error("unexpected end of input");
    const char c = s_[pos_];
    if (c == '{' || c == '[') {
      if (depth >= limits_.max_depth) {
        return Error(absl::StrCat("nesting deeper than ", limits_.max_depth, " levels"));
      }
      return c == '{' ? ParseObject(v, depth + 1) : ParseArray(v, depth + 1);
    }
    if (c == '"') {
      v.kind_ = Value::Kind::kString;
      return ParseString(v.str_);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return ParseNumber(v);
    if (Consume("true") || Consume("false")) {
      v.kind_ = Value::Kind::kBool;
      v.bool_ = c == 't';
      return absl::OkStatus();
    }
    if (Consume("null")) return absl::OkStatus();
    return Error("expected a value");
  }

  absl::Status ParseObject(Value& v, int depth) {
    v.kind_ = Value::Kind::kObject;
    ++pos_;  // '{'
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a string key");
      std::string key;
      FSDP_RETURN_IF_ERROR(ParseString(key));
      SkipSpace();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      v.keys_.push_back(std::move(key));
      v.items_.emplace_back();
      FSDP_RETURN_IF_ERROR(ParseValue(v.items_.back(), depth));
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        break;
      }
      return Error("expected ',' or '}'");
    }
    // Duplicate keys make the meaning ambiguous: reject them.
    std::vector<size_t> order(v.keys_.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return v.keys_[a] < v.keys_[b]; });
    for (size_t i = 1; i < order.size(); ++i) {
      if (v.keys_[order[i]] == v.keys_[order[i - 1]]) {
        return Error(absl::StrCat("duplicate key ", Quote(v.keys_[order[i]])));
      }
    }
    return absl::OkStatus();
  }

  absl::Status ParseArray(Value& v, int depth) {
    v.kind_ = Value::Kind::kArray;
    ++pos_;  // '['
    SkipSpace();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return absl::OkStatus();
    }
    while (true) {
      v.items_.emplace_back();
      FSDP_RETURN_IF_ERROR(ParseValue(v.items_.back(), depth));
      SkipSpace();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        return absl::OkStatus();
      }
      return Error("expected ',' or ']'");
    }
  }

  absl::Status ParseNumber(Value& v) {
    const size_t begin = pos_;
    bool integral = true;
    if (s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t d = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - d;
    };
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (digits() == 0) {
      return Error("malformed number");
    }
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      integral = false;
      if (digits() == 0) return Error("malformed number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      integral = false;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) return Error("malformed number");
    }
    const char* first = s_.data() + begin;
    const char* last = s_.data() + pos_;
    v.kind_ = Value::Kind::kNumber;
    if (integral) {
      auto r = std::from_chars(first, last, v.int_);
      v.is_int_ = r.ec == std::errc() && r.ptr == last;
    }
    auto r = std::from_chars(first, last, v.number_);
    if (r.ec == std::errc::result_out_of_range) {
      return Error("number out of range");
    }
    if (r.ec != std::errc() || r.ptr != last) return Error("malformed number");
    if (v.is_int_) v.number_ = static_cast<double>(v.int_);
    return absl::OkStatus();
  }

  static void AppendUtf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  }

  absl::StatusOr<uint32_t> Hex4() {
    if (s_.size() - pos_ < 4) return Error("truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        return Error("bad hex digit in \\u escape");
      }
    }
    return v;
  }

  // One UTF-8 sequence starting at pos_, checked (no overlong forms, no surrogates,
  // nothing above U+10FFFF), appended to out.
  absl::Status CopyUtf8(std::string& out) {
    const auto b0 = static_cast<unsigned char>(s_[pos_]);
    int len;
    uint32_t cp;
    if (b0 < 0x80) {
      len = 1;
      cp = b0;
    } else if ((b0 & 0xe0) == 0xc0) {
      len = 2;
      cp = b0 & 0x1f;
    } else if ((b0 & 0xf0) == 0xe0) {
      len = 3;
      cp = b0 & 0x0f;
    } else if ((b0 & 0xf8) == 0xf0) {
      len = 4;
      cp = b0 & 0x07;
    } else {
      return Error("invalid UTF-8");
    }
    if (s_.size() - pos_ < static_cast<size_t>(len)) return Error("truncated UTF-8 sequence");
    for (int i = 1; i < len; ++i) {
      const auto b = static_cast<unsigned char>(s_[pos_ + i]);
      if ((b & 0xc0) != 0x80) return Error("invalid UTF-8");
      cp = (cp << 6) | (b & 0x3f);
    }
    static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      return Error("invalid UTF-8");
    }
    out.append(s_.data() + pos_, len);
    pos_ += len;
    return absl::OkStatus();
  }

  absl::Status ParseString(std::string& out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= s_.size()) return Error("unterminated string");
      const char c = s_[pos_];
      if (c == '"') {
        ++pos_;
        return absl::OkStatus();
      }
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        FSDP_RETURN_IF_ERROR(CopyUtf8(out));
        continue;
      }
      if (++pos_ >= s_.size()) return Error("unterminated string");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          FSDP_ASSIGN_OR_RETURN(uint32_t cp, Hex4());
          if (cp >= 0xdc00 && cp <= 0xdfff) return Error("lone low surrogate in \\u escape");
          if (cp >= 0xd800 && cp <= 0xdbff) {
            if (!Consume("\\u")) return Error("lone high surrogate in \\u escape");
            FSDP_ASSIGN_OR_RETURN(uint32_t lo, Hex4());
            if (lo < 0xdc00 || lo > 0xdfff) return Error("bad surrogate pair in \\u escape");
            cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
          }
          AppendUtf8(out, cp);
          break;
        }
        default: return Error("unknown escape in string");
      }
    }
  }

  std::string_view s_;
  ParseLimits limits_;
  size_t pos_ = 0;
};

absl::StatusOr<Value> Parse(std::string_view text, ParseLimits limits) {
  return Parser(text, limits).ParseDocument();
}

void AppendQuoted(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (c) {
      case '"': out += "\\\""; continue;
      case '\\': out += "\\\\"; continue;
      case '\n': out += "\\n"; continue;
      case '\r': out += "\\r"; continue;
      case '\t': out += "\\t"; continue;
      case '\b': out += "\\b"; continue;
      case '\f': out += "\\f"; continue;
      default: break;
    }
    if (c < 0x20) {
      out += "\\u00";
      out += kHex[c >> 4];
      out += kHex[c & 0xf];
    } else if (c < 0x80) {
      out += static_cast<char>(c);
    } else {
      // A UTF-8 sequence: a lead byte, then its continuation bytes.
      const size_t len = c >= 0xf0 && c <= 0xf4   ? 4
                         : c >= 0xe0               ? 3
                         : c >= 0xc2 && c <= 0xdf ? 2
                                                   : 0;
      bool ok = len != 0 && i + len <= s.size();
      for (size_t k = 1; ok && k < len; ++k) {
        ok = (static_cast<unsigned char>(s[i + k]) & 0xc0) == 0x80;
      }
      if (ok) {
        out.append(s.substr(i, len));
        i += len - 1;
      } else {
        out += "\\ufffd";
      }
    }
  }
  out += '"';
}

std::string Quote(std::string_view s) {
  std::string out;
  AppendQuoted(out, s);
  return out;
}

void Writer::Separate() {
  if (after_key_) {
    after_key_ = false;
    return;
  }
  if (!first_.empty()) {
    if (!first_.back()) out_ += ',';
    first_.back() = false;
  }
}

Writer& Writer::BeginObject() {
  Separate();
  out_ += '{';
  first_.push_back(true);
  return *this;
}
Writer& Writer::EndObject() {
  out_ += '}';
  first_.pop_back();
  return *this;
}
Writer& Writer::BeginArray() {
  Separate();
  out_ += '[';
  first_.push_back(true);
  return *this;
}
Writer& Writer::EndArray() {
  out_ += ']';
  first_.pop_back();
  return *this;
}
Writer& Writer::Key(std::string_view key) {
  Separate();
  out_ += Quote(key);
  out_ += ':';
  after_key_ = true;
  return *this;
}
Writer& Writer::String(std::string_view s) {
  Separate();
  out_ += Quote(s);
  return *this;
}
Writer& Writer::Int(int64_t v) {
  Separate();
  out_ += std::to_string(v);
  return *this;
}
Writer& Writer::Bool(bool v) {
  Separate();
  out_ += v ? "true" : "false";
  return *this;
}

}  // namespace fsdp::json
