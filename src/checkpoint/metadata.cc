// metadata.json writer and checked reader.
#include "src/checkpoint/metadata.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "src/core/json.h"
#include "src/checkpoint/shard_file.h"

namespace fsdp::checkpoint {
namespace {

constexpr std::string_view kFormat = "fsdp-sharded-checkpoint";
constexpr int kMaxWorld = 1 << 20;

absl::Status Bad(std::string_view what) {
  return absl::DataLossError(absl::StrCat(kMetadataFile, ": ", std::string(what)));
}

void WritePieces(json::Writer& w, const std::vector<PieceRef>& pieces) {
  w.BeginArray();
  for (const PieceRef& p : pieces) {
    w.BeginArray().Int(p.file).Int(p.begin).Int(p.end).Int(static_cast<int64_t>(p.offset));
    w.EndArray();
  }
  w.EndArray();
}

// Reading: each getter names the field it failed on.
absl::StatusOr<const json::Value*> Field(const json::Value& obj, std::string_view key,
                                         std::string_view where) {
  const json::Value* v = obj.Find(key);
  if (v == nullptr) {
    return Bad(absl::StrCat(std::string(where), ": missing field '", std::string(key), "'"));
  }
  return v;
}

absl::StatusOr<int64_t> IntField(const json::Value& obj, std::string_view key,
                                 std::string_view where, int64_t lo, int64_t hi) {
  FSDP_ASSIGN_OR_RETURN(const json::Value* v, Field(obj, key, where));
  if (!v->is_int() || v->int_value() < lo || v->int_value() > hi) {
    return Bad(absl::StrCat(std::string(where), ": field '", std::string(key),
                            "' must be an integer in [", lo, ", ", hi, "]"));
  }
  return v->int_value();
}

absl::StatusOr<std::string> StringField(const json::Value& obj, std::string_view key,
                                        std::string_view where) {
  FSDP_ASSIGN_OR_RETURN(const json::Value* v, Field(obj, key, where));
  if (!v->is_string()) {
    return Bad(
        absl::StrCat(std::string(where), ": field '", std::string(key), "' must be a string"));
  }
  return v->str();
}

absl::Status ParsePieces(const json::Value& v, const CheckpointMetadata& m, int64_t numel,
                         const std::string& where, std::vector<PieceRef>& out) {
  if (!v.is_array()) return Bad(absl::StrCat(where, ": pieces must be an array"));
  for (const json::Value& p : v.items()) {
    if (!p.is_array() || p.items().size() != 4 ||
        !std::all_of(p.items().begin(), p.items().end(),
                     [](const json::Value& x) { return x.is_int() && x.int_value() >= 0; })) {
      return Bad(
          absl::StrCat(where, ": a piece must be [file, begin, end, offset] of integers >= 0"));
    }
    PieceRef r;
    const int64_t file = p.items()[0].int_value();
    r.begin = p.items()[1].int_value();
    r.end = p.items()[2].int_value();
    r.offset = static_cast<uint64_t>(p.items()[3].int_value());
    if (file >= static_cast<int64_t>(m.files.size())) {
      return Bad(absl::StrCat(where, ": a piece names shard file ", file, " of ", m.files.size()));
    }
    r.file = static_cast<int>(file);
    if (r.begin >= r.end || r.end > numel) {
      return Bad(absl::StrCat(where, ": piece [", r.begin, ", ", r.end,
                              ") is not a range inside the tensor's ", numel, " elements"));
    }
    const uint64_t bytes = static_cast<uint64_t>(r.end - r.begin) * 4;
    const uint64_t file_bytes = m.files[r.file].bytes;
    if (r.offset < kShardHeaderBytes || r.offset > file_bytes || bytes > file_bytes - r.offset) {
      return Bad(absl::StrCat(where, ": piece at byte ", r.offset, " (", bytes,
                              " bytes) lies outside ", m.files[r.file].name, " (", file_bytes,
                              " bytes)"));
    }
    out.push_back(r);
  }
  std::sort(out.begin(), out.end(),
            [](const PieceRef& a, const PieceRef& b) { return a.begin < b.begin; });
  int64_t at = 0;
  for (const PieceRef& r : out) {
    if (r.begin != at) {
      return Bad(absl::StrCat(where, ": the pieces do not tile the tensor: elements [",
                              std::min(at, r.begin), ", ", std::max(at, r.begin),
                              r.begin < at ? ") are stored twice" : ") are in no shard file"));
    }
    at = r.end;
  }
  if (at != numel) {
    return Bad(absl::StrCat(where, ": elements [", at, ", ", numel, ") are in no shard file"));
  }
  return absl::OkStatus();
}

absl::Status ParseTensor(const json::Value& v, CheckpointMetadata& m, TensorRecord& t) {
  if (!v.is_object()) return Bad("a tensor entry is not an object");
  FSDP_ASSIGN_OR_RETURN(t.name, StringField(v, "name", "tensor"));
  if (t.name.empty()) return Bad("a tensor has an empty name");
  const std::string where = absl::StrCat("tensor ", json::Quote(t.name));
  FSDP_ASSIGN_OR_RETURN(std::string dtype, StringField(v, "dtype", where));
  if (dtype != "F32") {
    return Bad(
        absl::StrCat(where, ": dtype ", json::Quote(dtype), " (sharded checkpoints hold F32)"));
  }
  FSDP_ASSIGN_OR_RETURN(const json::Value* shape, Field(v, "shape", where));
  if (!shape->is_array() || shape->items().empty()) {
    return Bad(absl::StrCat(where, ": 'shape' must be a non-empty array"));
  }
  t.numel = 1;
  for (const json::Value& d : shape->items()) {
    if (!d.is_int() || d.int_value() < 1 ||
        t.numel > (std::numeric_limits<int64_t>::max() / 8) / d.int_value()) {
      return Bad(absl::StrCat(where, ": dimensions must be integers >= 1 whose product fits"));
    }
    t.numel *= d.int_value();
    t.shape.push_back(d.int_value());
  }
  FSDP_ASSIGN_OR_RETURN(const json::Value* param, Field(v, "param", where));
  FSDP_RETURN_IF_ERROR(ParsePieces(*param, m, t.numel, where + " param", t.param));
  FSDP_ASSIGN_OR_RETURN(const json::Value* state, Field(v, "state", where));
  if (!state->is_object() || state->keys().size() != m.state_names.size()) {
    return Bad(absl::StrCat(where, ": 'state' must hold exactly the optimizer states"));
  }
  t.state.resize(m.state_names.size());
  for (size_t i = 0; i < m.state_names.size(); ++i) {
    const json::Value* s = state->Find(m.state_names[i]);
    if (s == nullptr) {
      return Bad(absl::StrCat(where, ": no optimizer state '", m.state_names[i], "'"));
    }
    FSDP_RETURN_IF_ERROR(
        ParsePieces(*s, m, t.numel, absl::StrCat(where, " ", m.state_names[i]), t.state[i]));
  }
  return absl::OkStatus();
}

absl::Status ParseTrainingState(const json::Value& v, CheckpointMetadata& m) {
  if (!v.is_object()) return Bad("'training_state' is not an object");
  if (const json::Value* dl = v.Find("data_loader")) {
    if (!dl->is_object()) return Bad("'data_loader' is not an object");
    FSDP_ASSIGN_OR_RETURN(std::string seed, StringField(*dl, "seed", "data_loader"));
    uint64_t s = 0;
    auto r = std::from_chars(seed.data(), seed.data() + seed.size(), s);
    if (seed.empty() || r.ec != std::errc() || r.ptr != seed.data() + seed.size()) {
      return Bad("data_loader: 'seed' must be a decimal string");
    }
    FSDP_ASSIGN_OR_RETURN(
        int64_t step, IntField(*dl, "step", "data_loader", 0, std::numeric_limits<int64_t>::max()));
    m.data_loader = std::make_pair(s, step);
  }
  if (const json::Value* values = v.Find("values")) {
    if (!values->is_object()) return Bad("'values' is not an object");
    for (size_t i = 0; i < values->keys().size(); ++i) {
      if (!values->items()[i].is_string()) {
        return Bad(absl::StrCat("value ", json::Quote(values->keys()[i]), " is not a string"));
      }
      m.values.emplace_back(values->keys()[i], values->items()[i].str());
    }
  }
  return absl::OkStatus();
}

absl::Status ParseLossScale(const json::Value& r, CheckpointMetadata& m) {
  FSDP_ASSIGN_OR_RETURN(const json::Value* ls, Field(r, "loss_scale", "top level"));
  if (!ls->is_object()) return Bad("'loss_scale' is not an object");
  FSDP_ASSIGN_OR_RETURN(std::string scale, StringField(*ls, "scale", "loss_scale"));
  auto res = std::from_chars(scale.data(), scale.data() + scale.size(), m.loss_scale);
  if (scale.empty() || res.ec != std::errc() || res.ptr != scale.data() + scale.size() ||
      !std::isfinite(m.loss_scale) || m.loss_scale <= 0) {
    return Bad("loss_scale: 'scale' must be a positive finite number in a string");
  }
  constexpr int64_t kMaxGood = std::numeric_limits<int32_t>::max();
  FSDP_ASSIGN_OR_RETURN(m.loss_scale_good_steps,
                        IntField(*ls, "good_steps", "loss_scale", 0, kMaxGood));
  FSDP_ASSIGN_OR_RETURN(m.skipped_steps, IntField(*ls, "skipped_steps", "loss_scale", 0,
                                                  std::numeric_limits<int64_t>::max()));
  return absl::OkStatus();
}

// No two pieces may share bytes of a file.
absl::Status CheckNoOverlap(const CheckpointMetadata& m) {
  std::vector<std::tuple<int, uint64_t, uint64_t, const std::string*>> ranges;
  for (const TensorRecord& t : m.tensors) {
    for (const PieceRef& p : t.param) {
      ranges.emplace_back(p.file, p.offset, p.offset + (p.end - p.begin) * 4, &t.name);
    }
    for (const auto& s : t.state) {
      for (const PieceRef& p : s) {
        ranges.emplace_back(p.file, p.offset, p.offset + (p.end - p.begin) * 4, &t.name);
      }
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    const auto& [fa, ba, ea, na] = ranges[i - 1];
    const auto& [fb, bb, eb, nb] = ranges[i];
    if (fa == fb && bb < ea) {
      return Bad(absl::StrCat("pieces of tensors ", json::Quote(*na), " and ", json::Quote(*nb),
                              " overlap in ", m.files[fa].name));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::string SerializeMetadata(const CheckpointMetadata& m) {
  json::Writer w;
  w.BeginObject();
  w.Key("format").String(kFormat);
  w.Key("version").Int(kFormatVersion);
  w.Key("world_size").Int(m.world_size);
  w.Key("mesh").BeginArray().Int(m.replicate_size).Int(m.shard_size).EndArray();
  w.Key("strategy").String(m.strategy);
  w.Key("optimizer").String(m.optimizer);
  w.Key("step").Int(m.step);
  w.Key("optimizer_step").Int(m.optimizer_step);
  w.Key("loss_scale").BeginObject();
  w.Key("scale").String(absl::StrFormat("%.9g", m.loss_scale));  // round-trips a float exactly
  w.Key("good_steps").Int(m.loss_scale_good_steps);
  w.Key("skipped_steps").Int(m.skipped_steps);
  w.EndObject();
  w.Key("state_names").BeginArray();
  for (const std::string& s : m.state_names) w.String(s);
  w.EndArray();
  w.Key("training_state").BeginObject();
  if (m.data_loader) {
    w.Key("data_loader").BeginObject();
    w.Key("seed").String(std::to_string(m.data_loader->first));
    w.Key("step").Int(m.data_loader->second);
    w.EndObject();
  }
  w.Key("values").BeginObject();
  for (const auto& [k, v] : m.values) w.Key(k).String(v);
  w.EndObject();
  w.EndObject();
  if (!m.model.empty()) {
    w.Key("model").BeginObject();
    for (const auto& [k, v] : m.model) w.Key(k).String(v);
    w.EndObject();
  }
  w.Key("files").BeginArray();
  for (const ShardFileRecord& f : m.files) {
    w.BeginObject().Key("name").String(f.name).Key("bytes").Int(static_cast<int64_t>(f.bytes));
    w.Key("crc32c").String(CrcHex(f.crc32c)).EndObject();
  }
  w.EndArray();
  w.Key("tensors").BeginArray();
  for (const TensorRecord& t : m.tensors) {
    w.BeginObject().Key("name").String(t.name).Key("dtype").String("F32");
    w.Key("shape").BeginArray();
    for (int64_t d : t.shape) w.Int(d);
    w.EndArray();
    w.Key("param");
    WritePieces(w, t.param);
    w.Key("state").BeginObject();
    for (size_t i = 0; i < m.state_names.size(); ++i) {
      w.Key(m.state_names[i]);
      WritePieces(w, t.state[i]);
    }
    w.EndObject().EndObject();
  }
  w.EndArray();
  w.EndObject();
  return w.text() + "\n";
}

std::vector<std::string> ModelDifferences(const ModelDescription& saved,
                                          const ModelDescription& current, std::string_view file) {
  std::vector<std::string> out;
  if (saved.empty() || current.empty()) return out;
  auto find = [](const ModelDescription& d, const std::string& key) -> const std::string* {
    for (const auto& [k, v] : d) {
      if (k == key) return &v;
    }
    return nullptr;
  };
  std::vector<std::string> keys;
  for (const ModelDescription* d : {&current, &saved}) {
    for (const auto& kv : *d) {
      if (kv.first != "name" && std::find(keys.begin(), keys.end(), kv.first) == keys.end()) {
        keys.push_back(kv.first);
      }
    }
  }
  for (const std::string& k : keys) {
    const std::string *a = find(saved, k), *b = find(current, k);
    if (a != nullptr && b != nullptr && *a == *b) continue;
    out.push_back(absl::StrCat(k, ": ", a != nullptr ? *a : "(not recorded)", " in ",
                               std::string(file), ", ", b != nullptr ? *b : "(none)",
                               " in this model"));
  }
  return out;
}

absl::StatusOr<CheckpointMetadata> ParseMetadata(std::string_view text) {
  absl::StatusOr<json::Value> root = json::Parse(text);
  if (!root.ok()) return Bad(std::string(root.status().message()));
  if (!root->is_object()) return Bad("not a JSON object");
  const json::Value& r = *root;
  CheckpointMetadata m;
  FSDP_ASSIGN_OR_RETURN(std::string format, StringField(r, "format", "top level"));
  if (format != kFormat) {
    return Bad(absl::StrCat("format is ", json::Quote(format), ", not ", json::Quote(kFormat)));
  }
  FSDP_ASSIGN_OR_RETURN(int64_t version, IntField(r, "version", "top level", 0, 1 << 30));
  if (version != kFormatVersion) {
    return Bad(
        absl::StrCat("format version ", version, " is not supported (want ", kFormatVersion, ")"));
  }
  FSDP_ASSIGN_OR_RETURN(int64_t world, IntField(r, "world_size", "top level", 1, kMaxWorld));
  m.world_size = static_cast<int>(world);
  FSDP_ASSIGN_OR_RETURN(const json::Value* mesh, Field(r, "mesh", "top level"));
  if (!mesh->is_array() || mesh->items().size() != 2 || !mesh->items()[0].is_int() ||
      !mesh->items()[1].is_int() || mesh->items()[0].int_value() < 1 ||
      mesh->items()[1].int_value() < 1 || mesh->items()[0].int_value() > world ||
      mesh->items()[1].int_value() > world ||  // (so that the product cannot overflow)
      mesh->items()[0].int_value() * mesh->items()[1].int_value() != world) {
    return Bad("'mesh' must be [replicate, shard] with replicate * shard = world_size");
  }
  m.replicate_size = static_cast<int>(mesh->items()[0].int_value());
  m.shard_size = static_cast<int>(mesh->items()[1].int_value());
  FSDP_ASSIGN_OR_RETURN(m.strategy, StringField(r, "strategy", "top level"));
  FSDP_ASSIGN_OR_RETURN(m.optimizer, StringField(r, "optimizer", "top level"));
  constexpr int64_t kMaxStep = int64_t{1} << 62;
  FSDP_ASSIGN_OR_RETURN(m.step, IntField(r, "step", "top level", 0, kMaxStep));
  FSDP_ASSIGN_OR_RETURN(m.optimizer_step, IntField(r, "optimizer_step", "top level", 0, kMaxStep));
  FSDP_RETURN_IF_ERROR(ParseLossScale(r, m));
  FSDP_ASSIGN_OR_RETURN(const json::Value* states, Field(r, "state_names", "top level"));
  if (!states->is_array() || states->items().size() > 8) {
    return Bad("'state_names' must be an array of at most 8 names");
  }
  for (const json::Value& s : states->items()) {
    if (!s.is_string() || s.str().empty() ||
        std::find(m.state_names.begin(), m.state_names.end(), s.str()) != m.state_names.end()) {
      return Bad("'state_names' must hold distinct non-empty strings");
    }
    m.state_names.push_back(s.str());
  }
  FSDP_ASSIGN_OR_RETURN(const json::Value* training, Field(r, "training_state", "top level"));
  FSDP_RETURN_IF_ERROR(ParseTrainingState(*training, m));

  if (const json::Value* model = r.Find("model")) {
    if (!model->is_object()) return Bad("'model' is not an object");
    for (size_t i = 0; i < model->keys().size(); ++i) {
      if (!model->items()[i].is_string() || model->keys()[i].empty()) {
        return Bad(absl::StrCat("model: ", json::Quote(model->keys()[i]),
                                " must be a non-empty key with a string value"));
      }
      m.model.emplace_back(model->keys()[i], model->items()[i].str());
    }
  }
  FSDP_ASSIGN_OR_RETURN(const json::Value* files, Field(r, "files", "top level"));
  if (!files->is_array() || files->items().size() != static_cast<size_t>(m.world_size)) {
    return Bad("'files' must list one shard file per rank of world_size");
  }
  for (size_t i = 0; i < files->items().size(); ++i) {
    const json::Value& f = files->items()[i];
    if (!f.is_object()) return Bad("a 'files' entry is not an object");
    ShardFileRecord rec;
    FSDP_ASSIGN_OR_RETURN(rec.name, StringField(f, "name", "files"));
    const std::string expected = ShardFileName(static_cast<int>(i), m.world_size);
    if (rec.name != expected) {
      return Bad(absl::StrCat("shard file ", i, " is named ", json::Quote(rec.name), ", expected ",
                              json::Quote(expected)));
    }
    FSDP_ASSIGN_OR_RETURN(int64_t bytes, IntField(f, "bytes", rec.name, kShardHeaderBytes,
                                                  std::numeric_limits<int64_t>::max()));
    rec.bytes = static_cast<uint64_t>(bytes);
    FSDP_ASSIGN_OR_RETURN(std::string crc, StringField(f, "crc32c", rec.name));
    if (!ParseCrcHex(crc, &rec.crc32c)) {
      return Bad(absl::StrCat(rec.name, ": 'crc32c' must look like 0x1234abcd"));
    }
    m.files.push_back(std::move(rec));
  }
  FSDP_ASSIGN_OR_RETURN(const json::Value* tensors, Field(r, "tensors", "top level"));
  if (!tensors->is_array() || tensors->items().empty()) {
    return Bad("'tensors' must be a non-empty array");
  }
  for (const json::Value& tv : tensors->items()) {
    TensorRecord t;
    FSDP_RETURN_IF_ERROR(ParseTensor(tv, m, t));
    m.tensors.push_back(std::move(t));
  }
  std::vector<const std::string*> names;
  for (const TensorRecord& t : m.tensors) names.push_back(&t.name);
  std::sort(names.begin(), names.end(),
            [](const std::string* a, const std::string* b) { return *a < *b; });
  for (size_t i = 1; i < names.size(); ++i) {
    if (*names[i] == *names[i - 1]) {
      return Bad(absl::StrCat("tensor ", json::Quote(*names[i]), " is listed twice"));
    }
  }
  FSDP_RETURN_IF_ERROR(CheckNoOverlap(m));
  return m;
}

}  // namespace fsdp::checkpoint
