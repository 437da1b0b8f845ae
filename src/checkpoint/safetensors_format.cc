// Parsing, validation and construction of safetensors headers.
#include "src/checkpoint/safetensors_format.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "src/core/json.h"

namespace fsdp::checkpoint {
namespace {

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", std::string(what)));
}

absl::StatusOr<DType> ParseDType(const std::string& name, const std::string& tensor) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  static constexpr std::string_view kOther[] = {"F64", "I64", "I32", "I16",  "I8",      "U8",
                                                "U16", "U32", "U64", "BOOL", "F8_E4M3", "F8_E5M2"};
  for (std::string_view o : kOther) {
    if (name == o) {
      return Bad(absl::StrCat("tensor ", json::Quote(tensor), " has dtype ", name,
                              "; libfsdp reads F32, BF16 and F16"));
    }
  }
  return Bad(
      absl::StrCat("tensor ", json::Quote(tensor), " has an unknown dtype ", json::Quote(name)));
}

absl::Status ParseTensor(const std::string& name, const json::Value& v, SafetensorsTensor& t) {
  const std::string q = json::Quote(name);
  if (name.empty()) return Bad("a tensor has an empty name");
  if (!v.is_object()) return Bad(absl::StrCat("tensor ", q, ": entry is not an object"));
  for (const std::string& k : v.keys()) {
    if (k != "dtype" && k != "shape" && k != "data_offsets") {
      return Bad(absl::StrCat("tensor ", q, ": unexpected field ", json::Quote(k)));
    }
  }
  const json::Value* dtype = v.Find("dtype");
  const json::Value* shape = v.Find("shape");
  const json::Value* offsets = v.Find("data_offsets");
  if (dtype == nullptr || !dtype->is_string()) {
    return Bad(absl::StrCat("tensor ", q, ": 'dtype' missing or not a string"));
  }
  if (shape == nullptr || !shape->is_array()) {
    return Bad(absl::StrCat("tensor ", q, ": 'shape' missing or not an array"));
  }
  if (offsets == nullptr || !offsets->is_array() || offsets->items().size() != 2 ||
      !offsets->items()[0].is_int() || !offsets->items()[1].is_int()) {
    return Bad(absl::StrCat("tensor ", q, ": 'data_offsets' must be [begin, end]"));
  }
  t.name = name;
  FSDP_ASSIGN_OR_RETURN(t.dtype, ParseDType(dtype->str(), name));
  int64_t numel = 1;
  for (const json::Value& d : shape->items()) {
    if (!d.is_int() || d.int_value() < 0) {
      return Bad(absl::StrCat("tensor ", q, ": dimensions must be integers >= 0"));
    }
    const int64_t dim = d.int_value();
    if (dim != 0 && numel > std::numeric_limits<int64_t>::max() / 8 / dim) {
      return Bad(absl::StrCat("tensor ", q, ": the shape's element count overflows"));
    }
    numel *= dim;
    t.shape.push_back(dim);
  }
  t.numel = numel;
  const int64_t b = offsets->items()[0].int_value(), e = offsets->items()[1].int_value();
  if (b < 0 || e < b) {
    return Bad(absl::StrCat("tensor ", q, ": data_offsets [", b, ", ", e, "] are not a range"));
  }
  t.begin = static_cast<uint64_t>(b);
  t.end = static_cast<uint64_t>(e);
  const uint64_t want = static_cast<uint64_t>(numel) * DTypeSize(t.dtype);
  if (t.end - t.begin != want) {
    return Bad(absl::StrCat("tensor ", q, ": data_offsets [", b, ", ", e, "] hold ", e - b,
                            " bytes but the shape and dtype need ", want));
  }
  return absl::OkStatus();
}

}  // namespace

const SafetensorsTensor* SafetensorsHeader::Find(std::string_view name) const {
  for (const SafetensorsTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

bool IsPlainFileName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

absl::StatusOr<SafetensorsIndex> ParseSafetensorsIndex(std::string_view text) {
  auto bad = [](const std::string& what) { return absl::DataLossError(what); };
  absl::StatusOr<json::Value> root = json::Parse(text);
  if (!root.ok()) return bad(std::string(root.status().message()));
  if (!root->is_object()) return bad("not a JSON object");
  const json::Value* map = root->Find("weight_map");
  if (map == nullptr || !map->is_object()) return bad("no \"weight_map\" object");
  if (map->keys().empty()) return bad("the weight_map is empty");
  SafetensorsIndex index;
  if (const json::Value* meta = root->Find("metadata"); meta != nullptr) {
    if (!meta->is_object()) return bad("\"metadata\" is not an object");
    if (const json::Value* t = meta->Find("total_size"); t != nullptr) {
      if (!t->is_int() || t->int_value() < 0) {
        return bad("\"metadata\".\"total_size\" is not a byte count");
      }
      index.total_size = t->int_value();
    }
  }
  for (size_t i = 0; i < map->keys().size(); ++i) {
    const std::string& name = map->keys()[i];
    const json::Value& v = map->items()[i];
    if (!v.is_string() || !IsPlainFileName(v.str())) {
      return bad(absl::StrCat("the weight_map gives tensor '", name,
                              "' a file that is not a name in the index's directory"));
    }
    index.weight_map.emplace_back(name, v.str());
  }
  return index;
}

std::string_view SafetensorsDTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    default: return "?";  // only f32, bf16 and f16 tensors are exported
  }
}

absl::StatusOr<uint64_t> ParseSafetensorsLength(std::string_view first8, uint64_t file_size) {
  if (first8.size() < 8 || file_size < 8) {
    return Bad(absl::StrCat("file of ", file_size, " bytes is too short for the header length"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(first8[i]);
  if (n == 0) return Bad("header length is 0");
  if (n > kSafetensorsMaxHeaderBytes) {
    return Bad(absl::StrCat("header length ", n, " exceeds the limit of ",
                            kSafetensorsMaxHeaderBytes, " bytes"));
  }
  if (n > file_size - 8) {
    return Bad(absl::StrCat("header length ", n, " runs past the end of the file (", file_size,
                            " bytes): truncated or not a safetensors file"));
  }
  return n;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(std::string_view header,
                                                         uint64_t file_size) {
  if (header.empty() || header[0] != '{') return Bad("the header does not start with '{'");
  if (file_size < 8 || header.size() > file_size - 8) {
    return Bad("the header is larger than the file");
  }
  absl::StatusOr<json::Value> root = json::Parse(header);
  if (!root.ok()) return Bad(absl::StrCat("header: ", std::string(root.status().message())));
  if (!root->is_object()) return Bad("the header is not a JSON object");
  SafetensorsHeader out;
  out.data_start = 8 + header.size();
  for (size_t i = 0; i < root->keys().size(); ++i) {
    const std::string& key = root->keys()[i];
    const json::Value& v = root->items()[i];
    if (key == "__metadata__") {
      if (!v.is_object()) return Bad("'__metadata__' is not an object");
      for (size_t j = 0; j < v.keys().size(); ++j) {
        if (!v.items()[j].is_string()) {
          return Bad(absl::StrCat("'__metadata__' value of ", json::Quote(v.keys()[j]),
                                  " is not a string"));
        }
        out.metadata.emplace_back(v.keys()[j], v.items()[j].str());
      }
      continue;
    }
    SafetensorsTensor t;
    FSDP_RETURN_IF_ERROR(ParseTensor(key, v, t));
    out.tensors.push_back(std::move(t));
  }
  // The data section must be indexed entirely: sorted by offset, the tensors tile it.
  std::vector<const SafetensorsTensor*> order;
  for (const SafetensorsTensor& t : out.tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t at = 0;
  for (const SafetensorsTensor* t : order) {
    if (t->begin != at) {
      return Bad(absl::StrCat("tensor ", json::Quote(t->name), " starts at data offset ", t->begin,
                              " but the previous tensor ends at ", at,
                              t->begin < at ? " (overlap)" : " (gap)"));
    }
    at = t->end;
  }
  const uint64_t data_bytes = file_size - out.data_start;
  if (at != data_bytes) {
    return Bad(absl::StrCat("the tensors cover ", at, " bytes of data but the file holds ",
                            data_bytes,
                            at > data_bytes ? " (truncated file?)" : " (trailing bytes)"));
  }
  return out;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsFile(std::string_view file) {
  FSDP_ASSIGN_OR_RETURN(uint64_t n, ParseSafetensorsLength(file, file.size()));
  return ParseSafetensorsHeader(file.substr(8, n), file.size());
}

std::string BuildSafetensorsHeader(
    std::vector<SafetensorsTensor>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  json::Writer w;
  w.BeginObject();
  if (!metadata.empty()) {
    w.Key("__metadata__").BeginObject();
    for (const auto& [k, v] : metadata) w.Key(k).String(v);
    w.EndObject();
  }
  uint64_t at = 0;
  for (SafetensorsTensor& t : tensors) {
    t.begin = at;
    t.end = at + static_cast<uint64_t>(t.numel) * DTypeSize(t.dtype);
    at = t.end;
    w.Key(t.name).BeginObject();
    w.Key("dtype").String(SafetensorsDTypeName(t.dtype));
    w.Key("shape").BeginArray();
    for (int64_t d : t.shape) w.Int(d);
    w.EndArray();
    w.Key("data_offsets").BeginArray().Int(static_cast<int64_t>(t.begin));
    w.Int(static_cast<int64_t>(t.end)).EndArray();
    w.EndObject();
  }
  w.EndObject();
  std::string json = w.text();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + json;
}

}  // namespace fsdp::checkpoint
