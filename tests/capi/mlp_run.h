/* What the C API tests and the C++ reference share: the configurations trained and the layout
 * of a reference file (written by c_api_reference, read by c_api_train_test). */
#ifndef FSDP_TESTS_CAPI_MLP_RUN_H_
#define FSDP_TESTS_CAPI_MLP_RUN_H_

#include "mlp.h"

/* A configuration: strategy (fsdp_strategy's value), hybrid shard size, ranks. */
typedef struct mlp_config {
  const char* name; /* file name stem, e.g. "full_shard_4" */
  int strategy;
  int hybrid_shard_size;
  int world;
} mlp_config;

#define MLP_NUM_CONFIGS 5
static const mlp_config kMlpConfigs[MLP_NUM_CONFIGS] = {
    {"full_shard_2", 0, 0, 2},
    {"full_shard_4", 0, 0, 4},
    {"hybrid_shard_2x2", 3, 2, 4},
    {"hybrid_shard_2x1", 3, 1, 2},
    {"no_shard_2", 2, 0, 2},
};

#define MLP_LOSSES (MLP_STEPS * MLP_MICRO_BATCHES)
#define MLP_UNIT0 (MLP_HIDDEN * MLP_IN + MLP_HIDDEN)
#define MLP_UNIT1 (MLP_OUT * MLP_HIDDEN + MLP_OUT)
/* A reference file: for each rank its MLP_LOSSES losses, then each rank's MLP_STEPS gradient
 * norms, then the final parameters of unit 0 and unit 1 (all f32, native byte order). */
#define MLP_REF_FLOATS(world) ((world) * (MLP_LOSSES + MLP_STEPS) + MLP_UNIT0 + MLP_UNIT1)

#endif
