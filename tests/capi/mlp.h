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

#ifdef __cplusplus
}
#endif

#endif
