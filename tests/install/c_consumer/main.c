/* Fits one unit's parameters to a target through libfsdp's C API, FULL_SHARD on 2 ranks as
 * threads: the loss 0.5 |w - t|^2 must fall. Prints "c_consumer: ok" at the end. */
#include <stdio.h>

#include <fsdp/c_api.h>

#define N 10

static fsdp_error* init(void* user, int unit, int param, int64_t begin, int64_t end, float* out) {
  (void)user, (void)unit, (void)param;
  for (int64_t i = begin; i < end; ++i) out[i - begin] = 0.0f;
  return NULL;
}

#define TRY(call)                          \
  do {                                     \
    e = (call);                            \
    if (e != NULL) goto done;              \
  } while (0)

static fsdp_error* rank_main(fsdp_world* world, void* user) {
  float* losses = (float*)user;
  fsdp_error* e = NULL;
  fsdp_backend* backend = NULL;
  fsdp_runtime* rt = NULL;
  int rank = 0;
  TRY(fsdp_world_rank(world, &rank));
  TRY(fsdp_backend_create("cpu", NULL, 0, rank, &backend));
  fsdp_sharding_options o;
  fsdp_sharding_options_init(&o);
  o.weight_decay = 0.0f;
  TRY(fsdp_runtime_create(backend, world, &o, &rt));
  const int64_t shape[1] = {N};
  fsdp_param p;
  fsdp_param_init(&p);
  p.name = "w";
  p.shape = shape;
  p.ndim = 1;
  TRY(fsdp_runtime_register_unit(rt, "fit", &p, 1, NULL));
  TRY(fsdp_runtime_finalize(rt, init, NULL));
  for (int step = 0; step < 20; ++step) {
    fsdp_unit_view v;
    v.struct_size = sizeof v;
    TRY(fsdp_pre_forward(rt, 0, &v));
    const float* w = (const float*)v.params.host;
    float loss = 0;
    for (int i = 0; i < N; ++i) loss += 0.5f * (w[i] - (float)i) * (w[i] - (float)i);
    TRY(fsdp_post_forward(rt, 0));
    TRY(fsdp_pre_backward(rt, 0, &v));
    w = (const float*)v.params.host;
    float* g = (float*)v.grads.host;
    for (int i = 0; i < N; ++i) g[i] += w[i] - (float)i;
    TRY(fsdp_post_backward(rt, 0));
    TRY(fsdp_finish_backward(rt));
    TRY(fsdp_step(rt, 0.5f, NULL));
    if (rank == 0) losses[step] = loss;
  }
done:
  fsdp_runtime_destroy(rt);
  fsdp_backend_destroy(backend);
  return e;
}

int main(void) {
  printf("c_consumer: %s\n", fsdp_version_string());
  if ((fsdp_api_version() >> 16) != FSDP_C_API_VERSION_MAJOR) return 1;
  float losses[20] = {0};
  fsdp_error* e = fsdp_run_threads(2, NULL, rank_main, losses);
  if (e != NULL) {
    fprintf(stderr, "c_consumer: %s\n", fsdp_error_message(e));
    fsdp_error_destroy(e);
    return 1;
  }
  printf("c_consumer: loss %.4f -> %.4f\n", losses[0], losses[19]);
  if (!(losses[19] < 0.5f * losses[0])) return 1;
  printf("c_consumer: ok\n");
  return 0;
}
