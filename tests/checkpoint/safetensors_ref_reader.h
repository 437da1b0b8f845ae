// A small safetensors reader for the tests, written independently of src/checkpoint (no code
// shared with the library's reader or writer): it checks a file against the public format and
// gives each tensor's bytes by name. Used to check exported files by value and to compare
// them with golden files written by the reference Python implementation.
//
// Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
// N bytes of JSON {"__metadata__": {"k": "v", ...}, "name": {"dtype": "F32", "shape": [..],
// "data_offsets": [begin, end]}, ...} (possibly padded with spaces), then the data section;
// offsets are relative to the data section.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace fsdp::testing::ref_st {

struct Tensor {
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte range in the data section
  std::string bytes;            // a copy of the data (files here are small)
};

struct File {
  std::string raw;          // the whole file
  uint64_t header_len = 0;  // N
  std::string header;       // the N header bytes
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
  bool has_metadata = false;
  uint64_t data_bytes() const { return raw.size() - 8 - header_len; }
};

namespace internal {

// A minimal JSON reader for the structure above: objects, arrays, strings, integers.
class Json {
 public:
  explicit Json(std::string_view s) : s_(s) {}

  void Ws() {
    while (p_ < s_.size() &&
           (s_[p_] == ' ' || s_[p_] == '\n' || s_[p_] == '\r' || s_[p_] == '\t')) {
      ++p_;
    }
  }
  bool Eat(char c) {
    Ws();
    if (p_ < s_.size() && s_[p_] == c) {
      ++p_;
      return true;
    }
    return false;
  }
  bool AtEnd() {
    Ws();
    return p_ == s_.size();
  }
  size_t pos() const { return p_; }

  absl::StatusOr<std::string> String() {
    if (!Eat('"')) return Err("expected a string");
    std::string out;
    while (p_ < s_.size() && s_[p_] != '"') {
      char c = s_[p_++];
      if (static_cast<unsigned char>(c) < 0x20) return Err("control character in a string");
      if (c == '\\') {
        if (p_ >= s_.size()) return Err("unterminated escape");
        const char e = s_[p_++];
        switch (e) {
          case '"':
          case '\\':
          case '/':
            out += e;
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u': {  // ASCII escapes only: the tests' names and metadata are ASCII
            if (p_ + 4 > s_.size()) return Err("short \\u escape");
            unsigned v = 0;
            for (int k = 0; k < 4; ++k) {
              const char h = s_[p_++];
              v = v * 16 + (h >= '0' && h <= '9'   ? h - '0'
                            : h >= 'a' && h <= 'f' ? h - 'a' + 10
                            : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                   : 99);
              if (v > 0xffff) return Err("bad \\u escape");
            }
            if (v >= 0x80) return Err("non-ASCII \\u escape (not needed by these tests)");
            out += static_cast<char>(v);
            break;
          }
          default:
            return Err("bad escape");
        }
      } else {
        out += c;
      }
    }
    if (p_ >= s_.size()) return Err("unterminated string");
    ++p_;
    return out;
  }

  absl::StatusOr<int64_t> Int() {
    Ws();
    const size_t start = p_;
    if (p_ < s_.size() && s_[p_] == '-') ++p_;
    int64_t v = 0;
    size_t digits = 0;
    while (p_ < s_.size() && s_[p_] >= '0' && s_[p_] <= '9') {
      if (v > (INT64_MAX - 9) / 10) return Err("integer too large");
      v = v * 10 + (s_[p_++] - '0');
      ++digits;
    }
    if (digits == 0) return Err("expected an integer");
    if (p_ < s_.size() && (s_[p_] == '.' || s_[p_] == 'e' || s_[p_] == 'E')) {
      return Err("expected an integer, got a number with a fraction or exponent");
    }
    return s_[start] == '-' ? -v : v;
  }

  absl::StatusOr<std::vector<int64_t>> IntArray() {
    if (!Eat('[')) return Err("expected an array");
    std::vector<int64_t> out;
    if (Eat(']')) return out;
    do {
      auto v = Int();
      if (!v.ok()) return v.status();
      out.push_back(*v);
    } while (Eat(','));
    if (!Eat(']')) return Err("expected ']'");
    return out;
  }

  absl::Status Err(std::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat("header JSON at byte ", p_, ": ", std::string(what)));
  }

 private:
  std::string_view s_;
  size_t p_ = 0;
};

inline uint64_t DtypeBytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

}  // namespace internal

// Parses and checks a whole file: the header length fits, the header is one JSON object of
// tensor entries (exactly dtype, shape, data_offsets) and an optional "__metadata__" of
// strings, followed by nothing but spaces; no duplicate names; every range has
// end - begin == numel * dtype size and lies in the data section; sorted by offset, the
// ranges are non-overlapping and cover the data section exactly.
inline absl::StatusOr<File> Parse(std::string raw) {
  File f;
  f.raw = std::move(raw);
  if (f.raw.size() < 8) return absl::InvalidArgumentError("file shorter than 8 bytes");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i)
    n |= static_cast<uint64_t>(static_cast<unsigned char>(f.raw[i])) << (8 * i);
  if (n == 0 || n > f.raw.size() - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("header length ", n, " does not fit a file of ", f.raw.size(), " bytes"));
  }
  f.header_len = n;
  f.header = f.raw.substr(8, n);
  internal::Json j(f.header);
  if (!j.Eat('{')) return j.Err("the header is not an object");
  std::vector<std::string> seen;
  if (!j.Eat('}')) {
    do {
      auto key = j.String();
      if (!key.ok()) return key.status();
      if (std::find(seen.begin(), seen.end(), *key) != seen.end()) {
        return j.Err(absl::StrCat("duplicate key '", *key, "'"));
      }
      seen.push_back(*key);
      if (!j.Eat(':')) return j.Err("expected ':'");
      if (!j.Eat('{')) return j.Err(absl::StrCat("value of '", *key, "' is not an object"));
      if (*key == "__metadata__") {
        f.has_metadata = true;
        if (!j.Eat('}')) {
          do {
            auto k = j.String();
            if (!k.ok()) return k.status();
            if (!j.Eat(':')) return j.Err("expected ':'");
            auto v = j.String();
            if (!v.ok()) return v.status();
            if (!f.metadata.emplace(*k, *v).second) return j.Err("duplicate metadata key");
          } while (j.Eat(','));
          if (!j.Eat('}')) return j.Err("expected '}' after the metadata");
        }
        continue;
      }
      Tensor t;
      bool has_dtype = false, has_shape = false, has_offsets = false;
      do {
        auto field = j.String();
        if (!field.ok()) return field.status();
        if (!j.Eat(':')) return j.Err("expected ':'");
        if (*field == "dtype" && !has_dtype) {
          auto d = j.String();
          if (!d.ok()) return d.status();
          t.dtype = *d;
          has_dtype = true;
        } else if (*field == "shape" && !has_shape) {
          auto s = j.IntArray();
          if (!s.ok()) return s.status();
          t.shape = *s;
          has_shape = true;
        } else if (*field == "data_offsets" && !has_offsets) {
          auto o = j.IntArray();
          if (!o.ok()) return o.status();
          if (o->size() != 2 || (*o)[0] < 0 || (*o)[1] < (*o)[0]) {
            return j.Err(absl::StrCat("tensor '", *key, "': bad data_offsets"));
          }
          t.begin = static_cast<uint64_t>((*o)[0]);
          t.end = static_cast<uint64_t>((*o)[1]);
          has_offsets = true;
        } else {
          return j.Err(absl::StrCat("tensor '", *key, "': unexpected field '", *field, "'"));
        }
      } while (j.Eat(','));
      if (!j.Eat('}')) return j.Err("expected '}' after a tensor");
      if (!has_dtype || !has_shape || !has_offsets) {
        return j.Err(absl::StrCat("tensor '", *key, "' lacks dtype, shape or data_offsets"));
      }
      f.tensors.emplace(*key, std::move(t));
    } while (j.Eat(','));
    if (!j.Eat('}')) return j.Err("expected '}' at the end of the header");
  }
  // Only padding spaces may follow the object.
  for (size_t i = j.pos(); i < f.header.size(); ++i) {
    if (f.header[i] != ' ') return j.Err("trailing bytes after the header object");
  }
  // Ranges: sizes match, inside the data section, tiling it.
  const uint64_t data = f.data_bytes();
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto& [name, t] : f.tensors) {
    const uint64_t es = internal::DtypeBytes(t.dtype);
    if (es == 0) return absl::InvalidArgumentError(absl::StrCat(name, ": unknown dtype ", t.dtype));
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": negative dimension"));
      numel *= static_cast<uint64_t>(d);
    }
    if (t.end - t.begin != numel * es) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": data_offsets [", t.begin, ", ", t.end,
                                                     ") do not hold ", numel, " x ", es, " bytes"));
    }
    if (t.end > data) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": data_offsets end ", t.end, " past the data section (", data, ")"));
    }
    t.bytes = f.raw.substr(8 + n + t.begin, t.end - t.begin);
    ranges.emplace_back(t.begin, t.end);
  }
  std::sort(ranges.begin(), ranges.end());
  uint64_t at = 0;
  for (const auto& [b, e] : ranges) {
    if (b != at) {
      return absl::InvalidArgumentError(
          absl::StrCat("data ranges ", b < at ? "overlap" : "leave a gap", " at byte ", at));
    }
    at = e;
  }
  if (at != data) {
    return absl::InvalidArgumentError(
        absl::StrCat("the tensors cover ", at, " of the ", data, " data bytes"));
  }
  return f;
}

// The f32 values of an F32 tensor (little-endian).
inline std::vector<float> F32Values(const Tensor& t) {
  std::vector<float> out(t.bytes.size() / 4);
  for (size_t i = 0; i < out.size(); ++i) {
    uint32_t u = 0;
    for (int k = 0; k < 4; ++k)
      u |= static_cast<uint32_t>(static_cast<unsigned char>(t.bytes[4 * i + k])) << (8 * k);
    out[i] = std::bit_cast<float>(u);
  }
  return out;
}

// The raw 16-bit values of a BF16 / F16 tensor (little-endian).
inline std::vector<uint16_t> U16Values(const Tensor& t) {
  std::vector<uint16_t> out(t.bytes.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<uint16_t>(
        static_cast<unsigned char>(t.bytes[2 * i]) |
        static_cast<unsigned>(static_cast<unsigned char>(t.bytes[2 * i + 1])) << 8);
  }
  return out;
}

// A float for messages: 9 significant digits and its bits.
inline std::string Show(float x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g (0x%08x)", static_cast<double>(x),
                static_cast<unsigned>(std::bit_cast<uint32_t>(x)));
  return buf;
}

// bf16 of a finite f32 by the definition of round-to-nearest-even (no bit tricks): of the two
// bf16 values around x (truncation and its successor in magnitude), the nearer one, and on a
// tie the one with an even last mantissa bit. Beyond the largest bf16 the successor is 2^128
// (rounding to it gives infinity).
inline uint16_t ReferenceBf16(float x) {
  const uint32_t u = std::bit_cast<uint32_t>(x);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);  // same sign, magnitude truncated
  const uint16_t hi = static_cast<uint16_t>(lo + 1);   // next magnitude, same sign
  const double dx = std::fabs(static_cast<double>(x));
  const double dlo =
      std::fabs(static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(lo) << 16)));
  const double dhi =
      (hi & 0x7fff) == 0x7f80
          ? std::ldexp(1.0, 128)
          : std::fabs(static_cast<double>(std::bit_cast<float>(static_cast<uint32_t>(hi) << 16)));
  const double to_lo = dx - dlo, to_hi = dhi - dx;
  if (to_lo < to_hi) return lo;
  if (to_hi < to_lo) return hi;
  return (lo & 1) == 0 ? lo : hi;
}

}  // namespace fsdp::testing::ref_st
