// The sharded model under its first name: ShardedGpt is ShardedModel (sharded_model.h), which
// trains the GPT and Llama alike.
#pragma once

#include "fsdp/nn/sharded_model.h"
