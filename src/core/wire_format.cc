// Names of the quantized wire formats (fsdp/wire_format.h).
#include "fsdp/wire_format.h"

#include <string>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace fsdp {

std::string_view WireFormatName(WireFormat f) {
  switch (f) {
    case WireFormat::kDType: return "dtype";
    case WireFormat::kInt8: return "int8";
    case WireFormat::kFp8E4M3: return "fp8";
  }
  return "?";
}

absl::StatusOr<WireFormat> ParseWireFormat(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(absl::string_view(name.data(), name.size()));
  if (n == "dtype") return WireFormat::kDType;
  if (n == "int8") return WireFormat::kInt8;
  if (n == "fp8" || n == "fp8_e4m3" || n == "e4m3") return WireFormat::kFp8E4M3;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown wire format '", std::string(name),
                   "'; use dtype (the buffer's own dtype), int8 or fp8 (e4m3), each with one "
                   "f32 scale per block"));
}

}  // namespace fsdp
