// Where a data loader stands, as a checkpoint records it: the seed of its order and the step
// its next batch comes from. The loaders (fsdp/nn/data.h) report and restore it; the
// checkpoint code (fsdp/checkpoint.h) saves it without depending on any loader.
#pragma once

#include <cstdint>

namespace fsdp {

struct DataPosition {
  uint64_t seed = 0;
  int64_t step = 0;  // the step the next batch comes from
};

}  // namespace fsdp
