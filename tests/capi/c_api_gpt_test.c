/* Drives the bundled GPT ("nano", FULL_SHARD, 2 ranks) through the C API: a few training steps
 * whose losses and gradient norms are bitwise the C++ API's (c_api_reference's gpt_nano.bin),
 * the memory report, a checkpoint saved and loaded into a model initialised differently (its
 * forward-only loss is then bitwise the trained model's), and a safetensors export.
 *
 *   c_api_gpt_test REF_DIR WORK_DIR threads
 *   c_api_gpt_test REF_DIR WORK_DIR mpi      (under mpirun -np 2) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "check.h"
#include "fsdp/c_api.h"
#include "mlp.h"

typedef struct job {
  const float* ref; /* GPT_REF_FLOATS */
  const char* work_dir;
} job;

static fsdp_error* mismatch(int rank, const char* what, int index, float got, float want) {
  char text[300];
  snprintf(text, sizeof text,
           "gpt nano, rank %d: %s[%d] is %.9g through the C API but %.9g through the C++ API", rank,
           what, index, got, want);
  return fsdp_error_create(FSDP_CODE_INTERNAL, text);
}

static fsdp_error* make_model(fsdp_backend* backend, fsdp_world* world, uint64_t seed,
                              fsdp_model** model) {
  fsdp_sharding_options o;
  fsdp_sharding_options_init(&o);
  o.max_grad_norm = 1.0f;
  fsdp_model_options m;
  fsdp_model_options_init(&m);
  m.config = "nano";
  m.batch_size = GPT_BATCH;
  m.seq_len = GPT_SEQ;
  m.seed = seed;
  return fsdp_model_create(backend, world, &o, &m, model);
}

static fsdp_error* run(fsdp_world* world, fsdp_backend* backend, const job* j, int rank) {
  fsdp_model* model = NULL;
  CHECK(make_model(backend, world, 1337, &model));
  int vocab = 0, block = 0;
  int64_t params = 0;
  fsdp_error* e = fsdp_model_info(model, &vocab, &block, &params);
  int32_t inputs[GPT_BATCH * GPT_SEQ], targets[GPT_BATCH * GPT_SEQ];
  const float* ref = j->ref + rank * (2 * GPT_STEPS + 1);
  for (int step = 0; step < GPT_STEPS && e == NULL; ++step) {
    gpt_tokens(rank, step, vocab, inputs, targets);
    float loss = 0;
    e = fsdp_model_forward_backward(model, inputs, targets, GPT_BATCH * GPT_SEQ, &loss);
    if (e == NULL && memcmp(&loss, &ref[step], sizeof loss) != 0) {
      e = mismatch(rank, "loss", step, loss, ref[step]);
    }
    fsdp_step_stats stats;
    stats.struct_size = sizeof stats;
    if (e == NULL) e = fsdp_model_step(model, GPT_LR, &stats);
    const float norm = (float)stats.grad_norm;
    if (e == NULL && memcmp(&norm, &ref[GPT_STEPS + step], sizeof norm) != 0) {
      e = mismatch(rank, "grad_norm", step, norm, ref[GPT_STEPS + step]);
    }
  }
  fsdp_runtime* rt = NULL;
  if (e == NULL) e = fsdp_model_runtime(model, &rt);
  fsdp_memory_report mem;
  mem.struct_size = sizeof mem;
  if (e == NULL) e = fsdp_runtime_memory(rt, &mem);
  if (e == NULL && (mem.param_shard_bytes <= 0 || mem.optimizer_bytes != 2 * mem.param_shard_bytes ||
                    mem.peak_bytes < mem.param_shard_bytes + mem.grad_shard_bytes)) {
    e = fsdp_error_create(FSDP_CODE_INTERNAL, "fsdp_runtime_memory: implausible report");
  }
  /* A model's runtime is the model's: destroying it is ignored, and it keeps working. */
  fsdp_runtime_destroy(rt);
  int64_t steps = 0;
  if (e == NULL) e = fsdp_runtime_steps(rt, &steps);
  if (e == NULL && steps != GPT_STEPS) {
    e = fsdp_error_create(FSDP_CODE_INTERNAL, "fsdp_runtime_steps: wrong count");
  }
  char ckpt[1024], export_path[1024];
  snprintf(ckpt, sizeof ckpt, "%s/checkpoint", j->work_dir);
  snprintf(export_path, sizeof export_path, "%s/model.safetensors", j->work_dir);
  if (e == NULL) e = fsdp_checkpoint_save(rt, ckpt, 1);
  if (e == NULL) e = fsdp_safetensors_export(rt, export_path, FSDP_DTYPE_F32);
  gpt_tokens(rank, GPT_STEPS, vocab, inputs, targets);
  float trained = 0;
  if (e == NULL) e = fsdp_model_forward(model, inputs, targets, GPT_BATCH * GPT_SEQ, &trained);
  if (e == NULL && memcmp(&trained, &ref[2 * GPT_STEPS], sizeof trained) != 0) {
    e = mismatch(rank, "forward-only loss", 0, trained, ref[2 * GPT_STEPS]);
  }
  fsdp_model_destroy(model);
  /* Another initialisation, then the checkpoint: the same parameters, the same loss. */
  fsdp_model* other = NULL;
  if (e == NULL) e = make_model(backend, world, 7, &other);
  fsdp_runtime* other_rt = NULL;
  float fresh = 0, loaded = 0;
  int64_t step = -1;
  if (e == NULL) e = fsdp_model_runtime(other, &other_rt);
  if (e == NULL) e = fsdp_model_forward(other, inputs, targets, GPT_BATCH * GPT_SEQ, &fresh);
  if (e == NULL) e = fsdp_checkpoint_load(other_rt, ckpt, 1, &step);
  if (e == NULL) e = fsdp_model_forward(other, inputs, targets, GPT_BATCH * GPT_SEQ, &loaded);
  if (e == NULL && (step != GPT_STEPS || memcmp(&loaded, &trained, sizeof loaded) != 0 ||
                    fresh == trained)) {
    e = mismatch(rank, "loss after fsdp_checkpoint_load", (int)step, loaded, trained);
  }
  /* The safetensors export holds the trained parameters too. */
  if (e == NULL) e = fsdp_safetensors_import(other_rt, export_path, 0);
  if (e == NULL) e = fsdp_model_forward(other, inputs, targets, GPT_BATCH * GPT_SEQ, &loaded);
  if (e == NULL && memcmp(&loaded, &trained, sizeof loaded) != 0) {
    e = mismatch(rank, "loss after fsdp_safetensors_import", 0, loaded, trained);
  }
  fsdp_model_destroy(other);
  return e;
}

static fsdp_error* body(fsdp_world* world, void* user) {
  const job* j = (const job*)user;
  int rank = 0;
  CHECK(fsdp_world_rank(world, &rank));
  fsdp_backend* backend = NULL;
  CHECK(fsdp_backend_create("cpu", NULL, 0, rank, &backend));
  fsdp_error* e = run(world, backend, j, rank);
  fsdp_backend_destroy(backend);
  return e;
}

int main(int argc, char** argv) {
  if (argc != 4 || (strcmp(argv[3], "threads") != 0 && strcmp(argv[3], "mpi") != 0)) {
    fprintf(stderr, "usage: %s REF_DIR WORK_DIR threads|mpi\n", argv[0]);
    return 2;
  }
  char path[1024];
  snprintf(path, sizeof path, "%s/gpt_nano.bin", argv[1]);
  static float ref[GPT_REF_FLOATS];
  FILE* f = fopen(path, "rb");
  if (f == NULL || fread(ref, sizeof(float), GPT_REF_FLOATS, f) != GPT_REF_FLOATS) {
    fprintf(stderr, "c_api_gpt_test: cannot read %s (run c_api_reference first)\n", path);
    return 1;
  }
  fclose(f);
  mkdir(argv[2], 0755);
  job j = {ref, argv[2]};
  fsdp_error* e = NULL;
  int rank = 0;
  if (strcmp(argv[3], "mpi") == 0) {
    fsdp_world* world = NULL;
    e = fsdp_world_create_mpi(NULL, &world);
    int size = 0;
    if (e == NULL) e = fsdp_world_rank(world, &rank);
    if (e == NULL) e = fsdp_world_size(world, &size);
    if (e == NULL && size != GPT_RANKS) {
      e = fsdp_error_create(FSDP_CODE_INVALID_ARGUMENT, "run it under mpirun -np 2");
    }
    if (e == NULL) {
      fsdp_error* local = body(world, &j);
      e = fsdp_world_agree(world, local);
      fsdp_error_destroy(local);
    }
    fsdp_world_destroy(world);
    if (e == NULL && rank == 0) {
      printf("ok gpt nano (mpi): %d steps bitwise the C++ API's; checkpoint and safetensors "
             "round trips\n", GPT_STEPS);
    }
    /* 0, or the error printed and the job aborted (every process ends at once). */
    const int rc = fsdp_mpi_finish(e, "c_api_gpt_test");
    fsdp_error_destroy(e);
    return rc;
  } else {
    e = fsdp_run_threads(GPT_RANKS, NULL, body, &j);
  }
  if (e != NULL) {
    fprintf(stderr, "FAILED: %s\n", fsdp_error_message(e));
    fsdp_error_destroy(e);
    return 1;
  }
  if (rank == 0) {
    printf("ok gpt nano (%s): %d steps bitwise the C++ API's; checkpoint and safetensors "
           "round trips\n", argv[3], GPT_STEPS);
  }
  return 0;
}
