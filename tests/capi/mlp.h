/* A two-layer perceptron in plain C, trained through libfsdp's hooks by the C API tests
 * (c_api_train_test.c) and, for comparison, through the C++ API (c_api_reference.cc):
 *   h = relu(x W1^T + b1),  y = h W2^T + b2,  loss = 0.5 mean((y - t)^2)
 * Unit 0 holds W1 [H, I] and b1 [H]; unit 1 holds W2 [O, H] and b2 [O]. */
#ifndef FSDP_TESTS_CAPI_MLP_H_
#define FSDP_TESTS_CAPI_MLP_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MLP_IN 8
#define MLP_HIDDEN 16
#define MLP_OUT 4
#define MLP_BATCH 4
#define MLP_STEPS 4
#define MLP_MICRO_BATCHES 2
#define MLP_LR 0.05f

/* Parameter p of unit u: 0 = weight, 1 = bias. Shapes and element counts. */
int mlp_param_ndim(int unit, int param);
void mlp_param_shape(int unit, int param, int64_t shape[2]);
int64_t mlp_param_numel(int unit, int param);
/* The initial value of element i of parameter p of unit u. */
float mlp_init(int unit, int param, int64_t i);

/* The batch of rank `rank` at (step, micro_batch): x [MLP_BATCH, MLP_IN], t [MLP_BATCH, MLP_OUT]. */
void mlp_batch(int rank, int step, int micro_batch, float* x, float* t);

/* Activations kept from the forward for the backward. */
typedef struct mlp_acts {
  float x[MLP_BATCH * MLP_IN];
  float t[MLP_BATCH * MLP_OUT];
  float hpre[MLP_BATCH * MLP_HIDDEN];
  float h[MLP_BATCH * MLP_HIDDEN];
  float y[MLP_BATCH * MLP_OUT];
  float dh[MLP_BATCH * MLP_HIDDEN];
} mlp_acts;

void mlp_forward1(mlp_acts* a, const float* w1, const float* b1);
/* Returns the loss. */
float mlp_forward2(mlp_acts* a, const float* w2, const float* b2);
/* Accumulates (+=) dW2, db2 and writes dh. */
void mlp_backward2(mlp_acts* a, const float* w2, float* dw2, float* db2);
/* Accumulates dW1, db1. */
void mlp_backward1(const mlp_acts* a, float* dw1, float* db1);

/* The bundled-model run (c_api_gpt_test): "nano" on GPT_RANKS ranks, B x T tokens of rank `rank`
 * at step `step` (targets: the inputs shifted by one, as a language model's). */
#define GPT_RANKS 2
#define GPT_BATCH 2
#define GPT_SEQ 32
#define GPT_STEPS 3
#define GPT_LR 1e-3f
void gpt_tokens(int rank, int step, int vocab, int32_t* inputs, int32_t* targets);
/* A reference file: for each rank its GPT_STEPS losses and GPT_STEPS gradient norms, then its
 * loss of a forward-only pass on step GPT_STEPS's tokens after training. */
#define GPT_REF_FLOATS (GPT_RANKS * (2 * GPT_STEPS + 1))

#ifdef __cplusplus
}
#endif

#endif
