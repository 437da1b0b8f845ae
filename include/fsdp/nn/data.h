// Training data for the GPT (MODEL_SPEC.md "Data"): token datasets from text bytes (V = 256)
// or token files, the corpus embedded in the library, and a data-parallel DataLoader whose
// batches depend only on (seed, step, global row), so N ranks of batch B together read
// exactly the batch one rank of batch N*B reads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/data_position.h"
#include "fsdp/status.h"

namespace fsdp::nn {

// data/corpus.txt (Debian's license texts, see data/README.md), built into the library.
std::string_view EmbeddedCorpus();

class TokenDataset {
 public:
  TokenDataset() = default;
  // Each byte is a token (V = 256).
  static TokenDataset FromText(std::string_view text);
  // Token ids, checked against [0, vocab_size).
  static absl::StatusOr<TokenDataset> FromTokens(std::vector<uint16_t> tokens, int vocab_size);
  // Files are read whole into memory, so their size is limited: a file larger than
  // `max_bytes` is a ResourceExhausted error rather than an allocation that takes the
  // machine's memory. Only regular files are read (a directory, a device such as /dev/zero or
  // a pipe is an InvalidArgument error). The tokens take 2 bytes each in memory, i.e. as much
  // as a token file and twice as much as a text file.
  static constexpr uint64_t kDefaultMaxFileBytes = uint64_t{4} << 30;  // 4 GiB

  // A token file of little-endian uint16 ids: nanoGPT's headerless .bin, or llm.c's .bin with
  // its 1024-byte header (magic 20240520). Ids are checked against [0, vocab_size).
  static absl::StatusOr<TokenDataset> FromBinFile(const std::string& path, int vocab_size,
                                                  uint64_t max_bytes = kDefaultMaxFileBytes);
  // A path ending in ".bin" is read as a token file, anything else as text bytes.
  static absl::StatusOr<TokenDataset> FromFile(const std::string& path, int vocab_size,
                                               uint64_t max_bytes = kDefaultMaxFileBytes);

  int vocab_size() const { return vocab_size_; }
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  const std::vector<uint16_t>& tokens() const { return tokens_; }
  // Tokens [begin, end), clamped to the dataset.
  TokenDataset Slice(int64_t begin, int64_t end) const;

 private:
  std::vector<uint16_t> tokens_;
  int vocab_size_ = 256;
};

struct TrainValSplit {
  TokenDataset train, val;
};
// The last `val_fraction` of the tokens is the validation split, the rest the training split.
absl::StatusOr<TrainValSplit> SplitTrainVal(const TokenDataset& data, double val_fraction = 0.1);

// B sequences of T+1 consecutive tokens: inputs are the first T, targets the last T.
struct Batch {
  int B = 0, T = 0;
  std::vector<int32_t> inputs;   // [B, T]
  std::vector<int32_t> targets;  // [B, T]
};

enum class SampleOrder {
  kRandom,      // each row starts at a random offset, a function of (seed, step, global row)
  kSequential,  // row g of step s is window (s * N * B + g) of T tokens, wrapping around
};

struct DataLoaderOptions {
  int batch_size = 8;  // B, sequences per rank
  int seq_len = 64;    // T
  int rank = 0;
  int world_size = 1;  // N; the global batch of a step is N * B rows, rank r has [rB, (r+1)B)
  uint64_t seed = 0;
  SampleOrder order = SampleOrder::kRandom;
};

// Where a DataLoader stands: enough to resume the same data order (in checkpoints). It does
// not depend on the rank, and stays valid on another world size with the same N * B.
// seed, and the step the next Next() returns (what a checkpoint saves).
using DataLoaderState = DataPosition;

class DataLoader {
 public:
  // `data` must outlive the loader; it needs at least T + 1 tokens.
  static absl::StatusOr<DataLoader> Create(const TokenDataset* data, DataLoaderOptions options);

  // The batch of the current step, then advances to the next step.
  Batch Next();
  // The batch of any step (a pure function of the options and `step`).
  Batch At(int64_t step) const;

  const DataLoaderOptions& options() const { return options_; }
  // Sequential steps that visit every window once (the whole split, for evaluation).
  int64_t steps_per_epoch() const;
  DataLoaderState state() const { return {options_.seed, step_}; }
  // Continues from `state`; its seed must be this loader's seed.
  absl::Status Restore(const DataLoaderState& state);

 private:
  DataLoader(const TokenDataset* data, DataLoaderOptions options)
      : data_(data), options_(options) {}
  int64_t RowStart(int64_t step, int64_t global_row) const;

  const TokenDataset* data_;
  DataLoaderOptions options_;
  int64_t step_ = 0;
};

}  // namespace fsdp::nn
