// CRC32C (Castagnoli), the checksum of every checkpoint file: a software slicing-by-8
// implementation, so the readers build anywhere (the fuzz targets compile it standalone).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace fsdp::checkpoint {

// Extends `crc` (the value returned for the bytes before, 0 for none) over `n` bytes.
uint32_t Crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t Crc32c(const void* data, size_t n) { return Crc32cExtend(0, data, n); }
inline uint32_t Crc32c(std::string_view s) { return Crc32c(s.data(), s.size()); }

}  // namespace fsdp::checkpoint
