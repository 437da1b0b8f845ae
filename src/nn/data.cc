// Token datasets (text bytes, nanoGPT / llm.c .bin files) and the data-parallel DataLoader.
#include "fsdp/nn/data.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "src/nn/counter_rng.h"

namespace fsdp::nn {
namespace {

constexpr int32_t kLlmcMagic = 20240520;  // llm.c's token files start with this int32
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const std::string why = std::strerror(errno);
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("cannot open '", path, "': ", why));
    return absl::PermissionDeniedError(absl::StrCat("cannot open '", path, "': ", why));
  }
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", path, "'"));
  return bytes;
}

int32_t LoadLe32(const char* bytes) {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes);
  return static_cast<int32_t>(p[0] | (p[1] << 8) | (p[2] << 16) | (uint32_t{p[3]} << 24));
}

}  // namespace

TokenDataset TokenDataset::FromText(std::string_view text) {
  TokenDataset d;
  d.tokens_.assign(text.size(), 0);
  for (size_t i = 0; i < text.size(); ++i) d.tokens_[i] = static_cast<unsigned char>(text[i]);
  d.vocab_size_ = 256;
  return d;
}

absl::StatusOr<TokenDataset> TokenDataset::FromTokens(std::vector<uint16_t> tokens,
                                                      int vocab_size) {
  if (vocab_size <= 0 || vocab_size > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size must be in [1, 65536] for uint16 tokens, got ", vocab_size));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token ", i, " is ", tokens[i],
                                                     ", not below the vocabulary size ",
                                                     vocab_size));
    }
  }
  TokenDataset d;
  d.tokens_ = std::move(tokens);
  d.vocab_size_ = vocab_size;
  return d;
}

absl::StatusOr<TokenDataset> TokenDataset::FromBinFile(const std::string& path,
                                                       int vocab_size) {
  FSDP_ASSIGN_OR_RETURN(std::string bytes, ReadFile(path));
  size_t begin = 0;
  if (bytes.size() >= kLlmcHeaderBytes && LoadLe32(bytes.data()) == kLlmcMagic) {
    const int64_t count = LoadLe32(bytes.data() + 2 * sizeof(int32_t));
    if (count >= 0 && bytes.size() == kLlmcHeaderBytes + 2 * static_cast<size_t>(count)) {
      begin = kLlmcHeaderBytes;
    }
  }
  const size_t payload = bytes.size() - begin;
  if (payload % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' has ", bytes.size(),
                     " bytes, not a whole number of uint16 tokens: is it a token file?"));
  }
  std::vector<uint16_t> tokens(payload / 2);
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data() + begin + 2 * i);
    tokens[i] = static_cast<uint16_t>(p[0] | (p[1] << 8));
  }
  auto d = FromTokens(std::move(tokens), vocab_size);
  if (!d.ok()) {
    return absl::Status(d.status().code(), absl::StrCat("'", path, "': ", d.status().message()));
  }
  return d;
}

absl::StatusOr<TokenDataset> TokenDataset::FromFile(const std::string& path, int vocab_size) {
  if (absl::EndsWith(path, ".bin")) return FromBinFile(path, vocab_size);
  FSDP_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  if (vocab_size < 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is read as text bytes, which needs a vocabulary of at least 256, not ",
        vocab_size));
  }
  TokenDataset d = FromText(text);
  d.vocab_size_ = vocab_size;
  return d;
}

TokenDataset TokenDataset::Slice(int64_t begin, int64_t end) const {
  begin = std::clamp<int64_t>(begin, 0, size());
  end = std::clamp<int64_t>(end, begin, size());
  TokenDataset d;
  d.tokens_.assign(tokens_.begin() + begin, tokens_.begin() + end);
  d.vocab_size_ = vocab_size_;
  return d;
}

absl::StatusOr<TrainValSplit> SplitTrainVal(const TokenDataset& data, double val_fraction) {
  if (!(val_fraction > 0.0 && val_fraction < 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("val_fraction must be in (0, 1), got ", val_fraction));
  }
  const int64_t cut = data.size() - static_cast<int64_t>(val_fraction * data.size());
  return TrainValSplit{data.Slice(0, cut), data.Slice(cut, data.size())};
}

// ---- DataLoader ------------------------------------------------------------------------------

absl::StatusOr<DataLoader> DataLoader::Create(const TokenDataset* data,
                                              DataLoaderOptions options) {
  if (data == nullptr) return absl::InvalidArgumentError("DataLoader: dataset is null");
  if (options.batch_size <= 0 || options.seq_len <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("DataLoader: batch_size and seq_len must be positive, got B=",
                     options.batch_size, " T=", options.seq_len));
  }
  if (options.world_size <= 0 || options.rank < 0 || options.rank >= options.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("DataLoader: rank ", options.rank,
                                                   " is not in [0, ", options.world_size, ")"));
  }
  if (data->size() < options.seq_len + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("DataLoader: the dataset has ", data->size(),
                     " tokens, too few for one sequence of T+1 = ", options.seq_len + 1));
  }
  return DataLoader(data, options);
}

int64_t DataLoader::steps_per_epoch() const {
  const int64_t windows = (data_->size() - 1) / options_.seq_len;
  const int64_t rows = static_cast<int64_t>(options_.world_size) * options_.batch_size;
  return (windows + rows - 1) / rows;
}

int64_t DataLoader::RowStart(int64_t step, int64_t global_row) const {
  const int64_t T = options_.seq_len;
  const int64_t rows = static_cast<int64_t>(options_.world_size) * options_.batch_size;
  if (options_.order == SampleOrder::kSequential) {
    const int64_t windows = (data_->size() - 1) / T;
    return ((step * rows + global_row) % windows) * T;
  }
  // One stream per step, one number per global row: rank r draws only its own rows.
  const uint64_t key = internal::SplitMix64(options_.seed ^ internal::SplitMix64(step));
  const uint64_t r = internal::RandomAt(key, static_cast<uint64_t>(global_row));
  return static_cast<int64_t>(r % static_cast<uint64_t>(data_->size() - T));
}

Batch DataLoader::At(int64_t step) const {
  Batch b;
  b.B = options_.batch_size;
  b.T = options_.seq_len;
  b.inputs.resize(static_cast<size_t>(b.B) * b.T);
  b.targets.resize(b.inputs.size());
  const std::vector<uint16_t>& tokens = data_->tokens();
  for (int row = 0; row < b.B; ++row) {
    const int64_t start = RowStart(step, static_cast<int64_t>(options_.rank) * b.B + row);
    for (int t = 0; t < b.T; ++t) {
      b.inputs[static_cast<size_t>(row) * b.T + t] = tokens[start + t];
      b.targets[static_cast<size_t>(row) * b.T + t] = tokens[start + t + 1];
    }
  }
  return b;
}

Batch DataLoader::Next() { return At(step_++); }

absl::Status DataLoader::Restore(const DataLoaderState& state) {
  if (state.seed != options_.seed) {
    return absl::FailedPreconditionError(
        absl::StrCat("DataLoader::Restore: the state was saved with seed ", state.seed,
                     ", this loader has seed ", options_.seed));
  }
  if (state.step < 0) {
    return absl::InvalidArgumentError(absl::StrCat("DataLoader::Restore: step ", state.step));
  }
  step_ = state.step;
  return absl::OkStatus();
}

}  // namespace fsdp::nn
