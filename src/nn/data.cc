// Token datasets (text bytes, nanoGPT / llm.c .bin files) and the data-parallel DataLoader.
#include "fsdp/nn/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <new>
#include <stdexcept>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "src/nn/counter_rng.h"

namespace fsdp::nn {
namespace {

constexpr int32_t kLlmcMagic = 20240520;  // llm.c's token files start with this int32
constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

// A regular file opened for reading, no larger than a limit. Nothing here throws: devices
// (/dev/zero), directories and pipes are refused before any read, and the size is known
// before any allocation.
class InputFile {
 public:
  static absl::StatusOr<InputFile> Open(const std::string& path, uint64_t max_bytes) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below).
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      const int err = errno;
      const std::string msg = absl::StrCat("cannot open '", path, "': ", std::strerror(err));
      if (err == ENOENT || err == ENOTDIR) return absl::NotFoundError(msg);
      if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
      return absl::InvalidArgumentError(msg);
    }
    InputFile f(path, fd);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      return absl::InternalError(absl::StrCat("cannot stat '", path, "': ", std::strerror(errno)));
    }
    if (!S_ISREG(st.st_mode)) {
      const char* what = S_ISDIR(st.st_mode)    ? "a directory"
                         : S_ISCHR(st.st_mode)  ? "a character device"
                         : S_ISBLK(st.st_mode)  ? "a block device"
                         : S_ISFIFO(st.st_mode) ? "a pipe"
                         : S_ISSOCK(st.st_mode) ? "a socket"
                                                : "a special file";
      return absl::InvalidArgumentError(
          absl::StrCat("'", path, "' is ", what,
                       ", not a regular file: give a token file (.bin) or a text file"));
    }
    f.size_ = static_cast<uint64_t>(st.st_size);
    if (f.size_ > max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "'", path, "' has ", f.size_, " bytes, more than the limit of ", max_bytes,
          " bytes for a data file read into memory (the default limit is ",
          TokenDataset::kDefaultMaxFileBytes, " bytes = 4 GiB)"));
    }
    return f;
  }
  InputFile(InputFile&& o) noexcept : path_(std::move(o.path_)), fd_(o.fd_), size_(o.size_) {
    o.fd_ = -1;
  }
  InputFile& operator=(InputFile&&) = delete;
  ~InputFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  uint64_t size() const { return size_; }

  // Exactly n bytes from the current position.
  absl::Status Read(void* dest, size_t n) {
    char* p = static_cast<char*>(dest);
    while (n > 0) {
      const ssize_t r = ::read(fd_, p, std::min<size_t>(n, size_t{1} << 30));
      if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
      if (r < 0) {
        return absl::DataLossError(
            absl::StrCat("error reading '", path_, "': ", std::strerror(errno)));
      }
      if (r == 0) {
        return absl::DataLossError(
            absl::StrCat("'", path_, "' ended early: it shrank while being read"));
      }
      p += r;
      n -= static_cast<size_t>(r);
    }
    return absl::OkStatus();
  }

 private:
  InputFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// n tokens, or ResourceExhausted instead of std::bad_alloc.
absl::Status Allocate(std::vector<uint16_t>& tokens, uint64_t n, const std::string& path) {
  try {
    tokens.resize(static_cast<size_t>(n));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory for the ", n, " tokens of '", path, "' (", 2 * n, " bytes)"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(absl::StrCat("'", path, "' is too large to hold"));
  }
  return absl::OkStatus();
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

absl::StatusOr<TokenDataset> TokenDataset::FromBinFile(const std::string& path, int vocab_size,
                                                       uint64_t max_bytes) {
  FSDP_ASSIGN_OR_RETURN(InputFile file, InputFile::Open(path, max_bytes));
  const uint64_t bytes = file.size();
  if (bytes % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", path, "' has ", bytes,
                     " bytes, not a whole number of uint16 tokens: is it a token file?"));
  }
  std::vector<uint16_t> tokens;
  FSDP_RETURN_IF_ERROR(Allocate(tokens, bytes / 2, path));
  FSDP_RETURN_IF_ERROR(file.Read(tokens.data(), static_cast<size_t>(bytes)));
  if constexpr (std::endian::native == std::endian::big) {
    for (uint16_t& t : tokens) t = static_cast<uint16_t>((t >> 8) | (t << 8));
  }
  if (bytes >= kLlmcHeaderBytes) {
    char head[3 * sizeof(int32_t)];
    for (size_t i = 0; i < sizeof(head) / 2; ++i) {
      head[2 * i] = static_cast<char>(tokens[i] & 0xff);
      head[2 * i + 1] = static_cast<char>(tokens[i] >> 8);
    }
    const int64_t count = LoadLe32(head + 2 * sizeof(int32_t));
    if (LoadLe32(head) == kLlmcMagic && count >= 0 &&
        bytes == kLlmcHeaderBytes + 2 * static_cast<uint64_t>(count)) {
      tokens.erase(tokens.begin(), tokens.begin() + kLlmcHeaderBytes / 2);
    }
  }
  auto d = FromTokens(std::move(tokens), vocab_size);
  if (!d.ok()) {
    return absl::Status(d.status().code(), absl::StrCat("'", path, "': ", d.status().message()));
  }
  return d;
}

absl::StatusOr<TokenDataset> TokenDataset::FromFile(const std::string& path, int vocab_size,
                                                    uint64_t max_bytes) {
  if (absl::EndsWith(path, ".bin")) return FromBinFile(path, vocab_size, max_bytes);
  if (vocab_size < 256 || vocab_size > 65536) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", path, "' is read as text bytes, which needs a vocabulary of 256 to 65536, not ",
        vocab_size));
  }
  FSDP_ASSIGN_OR_RETURN(InputFile file, InputFile::Open(path, max_bytes));
  TokenDataset d;
  FSDP_RETURN_IF_ERROR(Allocate(d.tokens_, file.size(), path));
  // Each byte becomes a token, a chunk at a time.
  std::vector<unsigned char> chunk(std::min<uint64_t>(file.size(), uint64_t{1} << 20));
  for (uint64_t at = 0; at < file.size();) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk.size(), file.size() - at));
    FSDP_RETURN_IF_ERROR(file.Read(chunk.data(), n));
    std::copy(chunk.begin(), chunk.begin() + static_cast<std::ptrdiff_t>(n),
              d.tokens_.begin() + static_cast<std::ptrdiff_t>(at));
    at += n;
  }
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
