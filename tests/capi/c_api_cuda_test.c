/* The C API's native handles on the cuda backend (labelled `gpu`; without a CUDA device it says
 * so and exits 77, skipped):
 *   - exporting: the backend's compute and communication streams are CUDA streams;
 *   - adopting memory: a cudaMalloc'd buffer of the caller's, wrapped as a view, is read and
 *     written by the library in place (the caller sees the library's writes with cudaMemcpy);
 *     host memory is refused;
 *   - adopting a stream: a backend created with {"compute_stream", "<address>"} computes on the
 *     caller's stream and leaves it alive when destroyed;
 *   - training on it: the perceptron of mlp.h through the hooks, views copied to and from the
 *     host, on 1 rank: its loss falls. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "fsdp/c_api.h"
#include "mlp_run.h"

static int failures = 0;
#define EXPECT_TRUE(cond)                                              \
  do {                                                                 \
    if (!(cond)) {                                                     \
      ++failures;                                                      \
      fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond); \
    }                                                                  \
  } while (0)

static fsdp_error* init_param(void* user, int unit, int param, int64_t begin, int64_t end,
                              float* out) {
  (void)user;
  for (int64_t i = begin; i < end; ++i) out[i - begin] = mlp_init(unit, param, i);
  return NULL;
}

/* The perceptron on `backend` through the hooks with host copies; losses of the first and the
 * last step. */
static fsdp_error* train(fsdp_world* world, void* user) {
  float* losses = (float*)user;
  fsdp_backend* backend = NULL;
  CHECK(fsdp_backend_create("cuda", NULL, 0, 0, &backend));
  fsdp_runtime* rt = NULL;
  fsdp_error* e = fsdp_runtime_create(backend, world, NULL, &rt);
  static const char* names[2][2] = {{"w1", "b1"}, {"w2", "b2"}};
  int64_t shapes[2][2][2];
  for (int u = 0; u < 2 && e == NULL; ++u) {
    fsdp_param p[2];
    for (int i = 0; i < 2; ++i) {
      fsdp_param_init(&p[i]);
      mlp_param_shape(u, i, shapes[u][i]);
      p[i].name = names[u][i];
      p[i].shape = shapes[u][i];
      p[i].ndim = mlp_param_ndim(u, i);
    }
    e = fsdp_runtime_register_unit(rt, u == 0 ? "layer1" : "layer2", p, 2, NULL);
  }
  if (e == NULL) e = fsdp_runtime_finalize(rt, init_param, NULL);
  static float params[2][MLP_UNIT0], grads[2][MLP_UNIT0];
  static mlp_acts a;
  const int64_t bias[2] = {MLP_HIDDEN * MLP_IN, MLP_OUT * MLP_HIDDEN};
  for (int step = 0; step < 20 && e == NULL; ++step) {
    float loss = 0;
    for (int m = 0; m < MLP_MICRO_BATCHES && e == NULL; ++m) {
      fsdp_unit_view v[2];
      v[0].struct_size = v[1].struct_size = sizeof v[0];
      mlp_batch(0, step % 2, m, a.x, a.t);
      e = fsdp_set_sync_gradients(rt, m == MLP_MICRO_BATCHES - 1);
      for (int u = 0; u < 2 && e == NULL; ++u) {
        e = fsdp_pre_forward(rt, u, &v[u]);
        if (e == NULL) {
          e = fsdp_view_copy_to_host(backend, &v[u].params, params[u], v[u].params.count * 4);
        }
        if (e == NULL && u == 0) mlp_forward1(&a, params[0], params[0] + bias[0]);
        if (e == NULL && u == 1) loss += mlp_forward2(&a, params[1], params[1] + bias[1]);
        if (e == NULL) e = fsdp_post_forward(rt, u);
      }
      for (int u = 1; u >= 0 && e == NULL; --u) {
        e = fsdp_pre_backward(rt, u, &v[u]);
        if (e == NULL) {
          e = fsdp_view_copy_to_host(backend, &v[u].params, params[u], v[u].params.count * 4);
        }
        if (e == NULL) {
          e = fsdp_view_copy_to_host(backend, &v[u].grads, grads[u], v[u].grads.count * 4);
        }
        if (e == NULL && u == 1) mlp_backward2(&a, params[1], grads[1], grads[1] + bias[1]);
        if (e == NULL && u == 0) mlp_backward1(&a, grads[0], grads[0] + bias[0]);
        if (e == NULL) {
          e = fsdp_view_copy_from_host(backend, &v[u].grads, grads[u], v[u].grads.count * 4);
        }
        if (e == NULL) e = fsdp_post_backward(rt, u);
      }
      if (e == NULL) e = fsdp_finish_backward(rt);
    }
    if (e == NULL) e = fsdp_step(rt, MLP_LR, NULL);
    if (step == 0) losses[0] = loss;
    losses[1] = loss;
  }
  fsdp_runtime_destroy(rt);
  fsdp_backend_destroy(backend);
  return e;
}

static fsdp_error* run(void) {
  fsdp_backend* b = NULL;
  CHECK(fsdp_backend_create("cuda", NULL, 0, 0, &b));
  void* compute = NULL;
  void* comm = NULL;
  CHECK(fsdp_backend_native_stream(b, 0, &compute));
  CHECK(fsdp_backend_native_stream(b, 1, &comm));
  EXPECT_TRUE(compute != NULL && comm != NULL && compute != comm);
  EXPECT_TRUE(cudaStreamQuery((cudaStream_t)compute) == cudaSuccess);

  /* Adopted device memory: the library writes it in place. */
  float* device = NULL;
  EXPECT_TRUE(cudaMalloc((void**)&device, 64) == cudaSuccess);
  float src[16], dst[16], seen[16];
  for (int i = 0; i < 16; ++i) src[i] = (float)i * 0.5f;
  fsdp_view v;
  v.struct_size = sizeof v;
  CHECK(fsdp_backend_wrap_native_memory(b, device, 16, FSDP_DTYPE_F32, &v));
  EXPECT_TRUE(v.host == NULL && v.count == 16);
  CHECK(fsdp_view_copy_from_host(b, &v, src, 64));
  CHECK(fsdp_view_copy_to_host(b, &v, dst, 64));
  EXPECT_TRUE(cudaMemcpy(seen, device, 64, cudaMemcpyDeviceToHost) == cudaSuccess);
  EXPECT_TRUE(memcmp(src, dst, 64) == 0 && memcmp(src, seen, 64) == 0);
  fsdp_error* e = fsdp_backend_wrap_native_memory(b, src, 16, FSDP_DTYPE_F32, &v);
  EXPECT_TRUE(fsdp_error_code(e) == FSDP_CODE_INVALID_ARGUMENT);
  fsdp_error_destroy(e);
  fsdp_backend_destroy(b);
  cudaFree(device);

  /* An adopted compute stream. */
  cudaStream_t mine = NULL;
  EXPECT_TRUE(cudaStreamCreate(&mine) == cudaSuccess);
  char address[32];
  snprintf(address, sizeof address, "%p", (void*)mine);
  fsdp_key_value option = {"compute_stream", address};
  CHECK(fsdp_backend_create("cuda", &option, 1, 0, &b));
  CHECK(fsdp_backend_native_stream(b, 0, &compute));
  EXPECT_TRUE(compute == (void*)mine);
  fsdp_backend_destroy(b);
  EXPECT_TRUE(cudaStreamQuery(mine) == cudaSuccess); /* still alive: the backend left it */
  EXPECT_TRUE(cudaStreamDestroy(mine) == cudaSuccess);

  float losses[2] = {0, 0};
  CHECK(fsdp_run_threads(1, NULL, train, losses));
  printf("c_api_cuda_test: the perceptron on the GPU through the hooks: loss %.5f -> %.5f\n",
         losses[0], losses[1]);
  EXPECT_TRUE(losses[1] < losses[0]);
  return NULL;
}

int main(void) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    printf("skipped: no CUDA device\n");
    return 77;
  }
  fsdp_error* e = run();
  if (e != NULL) {
    fprintf(stderr, "c_api_cuda_test: %s\n", fsdp_error_message(e));
    fsdp_error_destroy(e);
    return 1;
  }
  if (failures != 0) {
    fprintf(stderr, "c_api_cuda_test: %d checks failed\n", failures);
    return 1;
  }
  printf("c_api_cuda_test: ok\n");
  return 0;
}
