// The rounding of the double-precision references' autocast emulation: values rounded to a
// 16-bit dtype through f32, as the models round their f32 values.
#pragma once

#include <vector>

#include "fsdp/dtype.h"

namespace fsdp::nn::testing {

// v rounded to `dtype` (bf16 or f16) and back; kF32 leaves it as it is.
inline std::vector<double> RoundedTo(DType dtype, std::vector<double> v) {
  if (dtype == DType::kBF16) {
    for (double& x : v) x = Bf16ToFloat(FloatToBf16(static_cast<float>(x)));
  } else if (dtype == DType::kF16) {
    for (double& x : v) x = F16ToFloat(FloatToF16(static_cast<float>(x)));
  }
  return v;
}

}  // namespace fsdp::nn::testing
