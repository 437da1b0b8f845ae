// What libfsdp and its tools may read and write on the file system.
//
// An output (an export, a trace, a benchmark's JSON lines, CSV or plots) only ever creates a
// new file or replaces a regular file that is empty or already of its own kind: never a
// device, a FIFO, a socket, a directory, a symbolic link, or a file of another kind (a corpus,
// someone's notes). Outputs are written whole to a temporary file next to the target, then
// renamed over it, so a reader never sees half a file. Inputs are opened without blocking
// (a FIFO in place of a file is an error, not a hang) and must be regular files.
//
//   FSDP_RETURN_IF_ERROR(fsdp::CheckOutputPath(path, fsdp::kChromeTraceFile, {corpus_path}));
//   ...
//   FSDP_RETURN_IF_ERROR(fsdp::WriteOutputFile(path, json, fsdp::kChromeTraceFile));
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/status.h"

namespace fsdp {

// A kind of file libfsdp writes: how to tell an existing file of that kind from anything else.
struct OutputKind {
  const char* name;  // "a safetensors file", in messages
  // True when `head`, the first bytes of a non-empty regular file (up to 4 KiB) of `size`
  // bytes in all, is this kind.
  bool (*recognise)(std::string_view head, uint64_t size);
};

extern const OutputKind kSafetensorsFile;   // an 8-byte header length, then a JSON header
extern const OutputKind kChromeTraceFile;   // {"traceEvents":[ ... (Tracer::WriteChromeTrace)
extern const OutputKind kJsonLinesFile;     // lines of JSON objects
extern const OutputKind kCsvFile;           // a header line of comma-separated names
extern const OutputKind kSvgFile;           // <svg ... or <?xml ...

// What is at `path`, in words, for messages: "a directory", "a character device", "a FIFO",
// "a socket", "a block device", "a symbolic link to /x", "a symbolic link loop", "a regular
// file", or "nothing" when it does not exist (lstat: a symbolic link is named as such).
std::string DescribePath(const std::string& path);

// Whether `a` and `b` name the same existing file (same device and inode, after symbolic
// links). False when either does not exist.
bool SameFile(const std::string& a, const std::string& b);

// Checks, without writing anything, that `path` may be written as an output of `kind`:
//  - `path` does not exist, or is a regular file (not a symbolic link) that is empty or of
//    `kind`;
//  - its directory exists and is a directory;
//  - it is not the same file as any of `inputs` (the files the program reads: "--data=x").
//    Each input is "LABEL=PATH" or a bare path.
// FailedPrecondition (or NotFound for a missing directory): "cannot ACTION PATH: what it is
// and what to do".
absl::Status CheckOutputPath(const std::string& path, const OutputKind& kind,
                             const std::vector<std::string>& inputs = {},
                             std::string_view action = "write");

// CheckOutputPath, then writes `contents` to a temporary file beside `path`, fsyncs it and
// renames it over `path`.
absl::Status WriteOutputFile(const std::string& path, std::string_view contents,
                             const OutputKind& kind);

// Opens an input for reading without blocking on a FIFO or a device: the file descriptor of
// a regular file (symbolic links followed), or an error naming the path and what it is. The
// descriptor is blocking again when returned; `size` receives the file's size when not null.
absl::StatusOr<int> OpenRegularFileForReading(const std::string& path, uint64_t* size = nullptr);

// Free bytes for an unprivileged writer on the file system holding `path` (or, when `path`
// does not exist yet, its nearest existing parent). NotFound when none can be found.
absl::StatusOr<uint64_t> FreeBytesAt(const std::string& path);

// Whether two paths (existing or not: their nearest existing parents) are on one file system.
bool SameFileSystem(const std::string& a, const std::string& b);

// "1.5 GiB", "320.0 MiB", "12 bytes": for messages.
std::string FormatBytes(uint64_t bytes);

}  // namespace fsdp
