// Formats a collective's payload can take on the wire besides the buffer's own dtype: block
// quantization as DeepSpeed ZeRO++ (qwZ) and torchao's float8 all-gather use it. A payload of
// n elements in blocks of B is its codes (one byte per element, padded to a multiple of 4
// bytes) followed by one f32 scale per block (the last block may be shorter):
//   int8:     symmetric; scale = max|x| / 127 over the block, code = x / scale rounded to
//             nearest even (|code| <= 127); x' = code * scale, so |x - x'| <= scale / 2.
//   fp8 e4m3: OCP E4M3FN codes of x / scale, scale = max|x| / 448, rounded to nearest even;
//             x' = decode(code) * scale, relative error <= 2^-4 of |x| above the subnormals.
// An all-zero block has scale 0 and decodes to zeros; an inf or NaN makes its block's scale
// non-finite, so it decodes to non-finite values (never to plausible finite numbers).
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/statusor.h"

namespace fsdp {

enum class WireFormat : uint8_t {
  kDType = 0,    // the buffer's own dtype (param_dtype, reduce_dtype): no quantization
  kInt8 = 1,     // int8 codes, f32 scale per block
  kFp8E4M3 = 2,  // fp8 e4m3 codes, f32 scale per block
};
std::string_view WireFormatName(WireFormat f);  // "dtype", "int8", "fp8"
// WireFormatName's inverse, case-insensitive; also "fp8_e4m3", "e4m3". InvalidArgument naming
// the allowed names otherwise.
absl::StatusOr<WireFormat> ParseWireFormat(std::string_view name);

// The bytes of n elements block-quantized in blocks of `block`.
struct QuantizedLayout {
  int64_t n = 0, block = 1;
  int64_t blocks() const { return (n + block - 1) / block; }
  int64_t code_bytes() const { return (n + 3) / 4 * 4; }  // the scales start 4-byte aligned
  int64_t bytes() const { return code_bytes() + 4 * blocks(); }
};

}  // namespace fsdp
