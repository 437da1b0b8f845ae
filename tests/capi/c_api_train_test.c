/* Trains the two-layer perceptron of mlp.h through the C API (include/fsdp/c_api.h), compiled
 * as C11 and linked with libfsdp.so only, and compares every rank's losses and gradient norms
 * and the final parameters with the C++ API's run of the same configuration (c_api_reference's
 * file), bit for bit.
 *
 *   c_api_train_test REF_DIR threads [BACKEND]  every configuration of mlp_run.h, ranks as threads
 *   c_api_train_test REF_DIR mpi                 under mpirun -np 2: the 2-rank configurations
 *   c_api_train_test REF_DIR mpi_threads         under mpirun -np 2: 2 ranks as threads per
 *                                                process (fsdp_run_mpi_threads), the 4-rank ones
 *   c_api_train_test REF_DIR mpi_split           under mpirun -np 4: the processes split in two
 *                                                halves, each a world of its own over its half's
 *                                                communicator (fsdp_world_create_mpi_comm)
 *
 * On a backend without host pointers (sim) the test reads and writes the hooks' views through
 * fsdp_view_copy_to_host / fsdp_view_copy_from_host, as a framework on a device would. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fsdp/c_api.h"
#include "mlp_run.h"
#ifdef CAPI_TEST_MPI
#include <mpi.h>
#endif

typedef struct job {
  const mlp_config* cfg;
  const char* backend;
  const float* ref; /* MLP_REF_FLOATS(cfg->world) */
} job;

/* A unit's gathered parameters and gradient as host arrays: the views' own memory on a host
 * backend, else copies. */
typedef struct host_unit {
  float params[MLP_UNIT0 > MLP_UNIT1 ? MLP_UNIT0 : MLP_UNIT1];
  float grads[MLP_UNIT0 > MLP_UNIT1 ? MLP_UNIT0 : MLP_UNIT1];
  const float* p;
  float* g;
} host_unit;

static fsdp_error* to_host(fsdp_backend* b, const fsdp_unit_view* v, host_unit* h) {
  h->p = (const float*)v->params.host;
  h->g = (float*)v->grads.host;
  if (h->p == NULL) {
    CHECK(fsdp_view_copy_to_host(b, &v->params, h->params, v->params.count * 4));
    h->p = h->params;
  }
  if (h->g == NULL && v->grads.count > 0) {
    CHECK(fsdp_view_copy_to_host(b, &v->grads, h->grads, v->grads.count * 4));
    h->g = h->grads;
  }
  return NULL;
}

static fsdp_error* grads_back(fsdp_backend* b, const fsdp_unit_view* v, const host_unit* h) {
  if (v->grads.host == NULL) {
    CHECK(fsdp_view_copy_from_host(b, &v->grads, h->grads, v->grads.count * 4));
  }
  return NULL;
}

static fsdp_error* init_param(void* user, int unit, int param, int64_t begin, int64_t end,
                              float* out) {
  (void)user;
  for (int64_t i = begin; i < end; ++i) out[i - begin] = mlp_init(unit, param, i);
  return NULL;
}

static fsdp_error* mismatch(const job* j, int rank, const char* what, int index, float got,
                            float want) {
  char text[400];
  snprintf(text, sizeof text,
           "%s on %s, rank %d: %s[%d] is %.9g through the C API but %.9g through the C++ API",
           j->cfg->name, j->backend, rank, what, index, got, want);
  return fsdp_error_create(FSDP_CODE_INTERNAL, text);
}

static fsdp_error* train(fsdp_world* world, void* user) {
  const job* j = (const job*)user;
  int rank = 0, size = 0;
  CHECK(fsdp_world_rank(world, &rank));
  CHECK(fsdp_world_size(world, &size));
  if (size != j->cfg->world) {
    return fsdp_error_create(FSDP_CODE_INVALID_ARGUMENT, "the world has the wrong size");
  }
  fsdp_backend* backend = NULL;
  CHECK(fsdp_backend_create(j->backend, NULL, 0, rank, &backend));
  fsdp_sharding_options o;
  fsdp_sharding_options_init(&o);
  o.strategy = (fsdp_strategy)j->cfg->strategy;
  o.hybrid_shard_size = j->cfg->hybrid_shard_size;
  o.max_grad_norm = 0.07f;  /* clips steps 0 and 3 */
  fsdp_runtime* rt = NULL;
  fsdp_error* e = fsdp_runtime_create(backend, world, &o, &rt);
  if (e != NULL) {
    fsdp_backend_destroy(backend);
    return e;
  }
  static const char* names[2][2] = {{"w1", "b1"}, {"w2", "b2"}};
  static const char* units[2] = {"layer1", "layer2"};
  int64_t shapes[2][2][2];
  for (int u = 0; u < 2 && e == NULL; ++u) {
    fsdp_param params[2];
    for (int p = 0; p < 2; ++p) {
      fsdp_param_init(&params[p]);
      mlp_param_shape(u, p, shapes[u][p]);
      params[p].name = names[u][p];
      params[p].shape = shapes[u][p];
      params[p].ndim = mlp_param_ndim(u, p);
    }
    int index = -1;
    e = fsdp_runtime_register_unit(rt, units[u], params, 2, &index);
    if (e == NULL && index != u) e = fsdp_error_create(FSDP_CODE_INTERNAL, "unit index");
  }
  if (e == NULL) e = fsdp_runtime_finalize(rt, init_param, NULL);
  int64_t bias[2] = {0, 0};
  for (int u = 0; u < 2 && e == NULL; ++u) {
    int64_t numel = 0;
    char name[8];
    e = fsdp_runtime_unit_param(rt, u, 1, &bias[u], &numel, name, sizeof name, NULL);
    if (e == NULL && (strcmp(name, names[u][1]) != 0 || numel != mlp_param_numel(u, 1))) {
      e = fsdp_error_create(FSDP_CODE_INTERNAL, "fsdp_runtime_unit_param: wrong name or size");
    }
  }
  static mlp_acts acts[8];
  static host_unit h0s[8], h1s[8];
  mlp_acts* a = &acts[rank];
  host_unit* h0 = &h0s[rank];
  host_unit* h1 = &h1s[rank];
  const float* ref_losses = j->ref + rank * MLP_LOSSES;
  const float* ref_norms = j->ref + j->cfg->world * MLP_LOSSES + rank * MLP_STEPS;
  for (int step = 0; step < MLP_STEPS && e == NULL; ++step) {
    for (int m = 0; m < MLP_MICRO_BATCHES && e == NULL; ++m) {
      fsdp_unit_view v0, v1;
      v0.struct_size = sizeof v0;
      v1.struct_size = sizeof v1;
      mlp_batch(rank, step, m, a->x, a->t);
      float loss = 0;
#define RUN(call)              \
  if (e == NULL) e = (call);   \
  if (e != NULL) break
      do {
        RUN(fsdp_set_sync_gradients(rt, m == MLP_MICRO_BATCHES - 1));
        RUN(fsdp_pre_forward(rt, 0, &v0));
        RUN(to_host(backend, &v0, h0));
        mlp_forward1(a, h0->p, h0->p + bias[0]);
        RUN(fsdp_post_forward(rt, 0));
        RUN(fsdp_pre_forward(rt, 1, &v1));
        RUN(to_host(backend, &v1, h1));
        loss = mlp_forward2(a, h1->p, h1->p + bias[1]);
        RUN(fsdp_post_forward(rt, 1));
        RUN(fsdp_pre_backward(rt, 1, &v1));
        RUN(to_host(backend, &v1, h1));
        mlp_backward2(a, h1->p, h1->g, h1->g + bias[1]);
        RUN(grads_back(backend, &v1, h1));
        RUN(fsdp_post_backward(rt, 1));
        RUN(fsdp_pre_backward(rt, 0, &v0));
        RUN(to_host(backend, &v0, h0));
        mlp_backward1(a, h0->g, h0->g + bias[0]);
        RUN(grads_back(backend, &v0, h0));
        RUN(fsdp_post_backward(rt, 0));
        RUN(fsdp_finish_backward(rt));
      } while (0);
#undef RUN
      const int k = step * MLP_MICRO_BATCHES + m;
      if (e == NULL && memcmp(&loss, &ref_losses[k], sizeof loss) != 0) {
        e = mismatch(j, rank, "loss", k, loss, ref_losses[k]);
      }
    }
    fsdp_step_stats stats;
    stats.struct_size = sizeof stats;
    if (e == NULL) e = fsdp_step(rt, MLP_LR, &stats);
    if (e == NULL && stats.step != step + 1) {
      e = fsdp_error_create(FSDP_CODE_INTERNAL, "fsdp_step: wrong step count");
    }
    const float norm = (float)stats.grad_norm;
    if (e == NULL && memcmp(&norm, &ref_norms[step], sizeof norm) != 0) {
      e = mismatch(j, rank, "grad_norm", step, norm, ref_norms[step]);
    }
  }
  float* final_params = (float*)malloc(sizeof(float) * (MLP_UNIT0 + MLP_UNIT1));
  if (e == NULL) e = fsdp_runtime_gather_unit(rt, 0, final_params, MLP_UNIT0);
  if (e == NULL) e = fsdp_runtime_gather_unit(rt, 1, final_params + MLP_UNIT0, MLP_UNIT1);
  const float* ref_params = j->ref + j->cfg->world * (MLP_LOSSES + MLP_STEPS);
  for (int i = 0; i < MLP_UNIT0 + MLP_UNIT1 && e == NULL; ++i) {
    if (memcmp(&final_params[i], &ref_params[i], sizeof(float)) != 0) {
      e = mismatch(j, rank, "parameter", i, final_params[i], ref_params[i]);
    }
  }
  free(final_params);
  fsdp_runtime_destroy(rt);
  fsdp_backend_destroy(backend);
  return e;
}

static float* read_ref(const char* dir, const mlp_config* cfg) {
  char path[1024];
  snprintf(path, sizeof path, "%s/%s.bin", dir, cfg->name);
  const size_t n = (size_t)MLP_REF_FLOATS(cfg->world);
  float* ref = (float*)malloc(n * sizeof(float));
  FILE* f = fopen(path, "rb");
  if (ref == NULL || f == NULL || fread(ref, sizeof(float), n, f) != n) {
    fprintf(stderr, "c_api_train_test: cannot read %s (run c_api_reference first)\n", path);
    if (f != NULL) fclose(f);
    free(ref);
    return NULL;
  }
  fclose(f);
  return ref;
}

/* Under mpirun -np 2: each process plays 2 ranks as threads of one 4-rank world; the 4-rank
 * configurations, every rank compared with the C++ API's run (also on its thread). */
static int run_mpi_threads(const char* dir) {
  enum { kThreads = 2 };
  int failures = 0, runs = 0, rank0 = 0;
  for (int c = 0; c < MLP_NUM_CONFIGS; ++c) {
    const mlp_config* cfg = &kMlpConfigs[c];
    if (cfg->world != 4) continue;
    job j = {cfg, "cpu", read_ref(dir, cfg)};
    if (j.ref == NULL) return 1;
    /* Every process learns whether a rank anywhere failed: a failing rank aborts the world. */
    fsdp_error* e = fsdp_run_mpi_threads(kThreads, NULL, train, &j);
    free((void*)j.ref);
    ++runs;
    if (e != NULL) {
      ++failures;
      fprintf(stderr, "FAILED %s (mpi_threads): %s\n", cfg->name, fsdp_error_message(e));
      fsdp_error_destroy(e);
    }
  }
  /* Which process holds world rank 0: the one whose group starts there. */
  fsdp_thread_group* g = NULL;
  fsdp_error* e = fsdp_mpi_thread_group_create(kThreads, NULL, &g);
  int first = -1, count = 0;
  if (e == NULL) e = fsdp_thread_group_ranks(g, &first, &count);
  if (e != NULL) {
    fprintf(stderr, "FAILED fsdp_mpi_thread_group_create: %s\n", fsdp_error_message(e));
    fsdp_error_destroy(e);
    ++failures;
  } else if (count != kThreads || first % kThreads != 0) {
    fprintf(stderr, "FAILED fsdp_thread_group_ranks: first %d, count %d\n", first, count);
    ++failures;
  }
  /* A rank outside the process is refused; each rank is taken once. */
  fsdp_world* w = NULL;
  if (g != NULL) {
    fsdp_error* outside = fsdp_thread_group_take_rank(g, (first + kThreads) % 4, &w);
    if (outside == NULL || fsdp_error_code(outside) != FSDP_CODE_INVALID_ARGUMENT) {
      fprintf(stderr, "FAILED: another process's rank was not refused\n");
      ++failures;
    }
    fsdp_error_destroy(outside);
    fsdp_error* mine = fsdp_thread_group_take_rank(g, first, &w);
    fsdp_error* again = fsdp_thread_group_take_rank(g, first, &w);
    if (mine != NULL || again == NULL) {
      fprintf(stderr, "FAILED: taking rank %d once and again\n", first);
      ++failures;
    }
    fsdp_error_destroy(mine);
    fsdp_error_destroy(again);
    int size = 0;
    if (w != NULL && (fsdp_world_size(w, &size) != NULL || size != 4)) {
      fprintf(stderr, "FAILED: the taken world's size is %d, not 4\n", size);
      ++failures;
    }
    fsdp_world_destroy(w);
    fsdp_thread_group_destroy(g);
  }
  rank0 = first == 0;
  if (failures == 0 && rank0) {
    printf("ok %d configurations (2 processes under mpirun x 2 ranks as threads, cpu): %d steps, "
           "losses, norms and parameters bitwise the C++ API's; the group's ranks and refusals\n",
           runs, MLP_STEPS);
  }
  fsdp_mpi_shutdown();
  return failures == 0 && runs > 0 ? 0 : 1;
}

int main(int argc, char** argv) {
  if (argc < 3 || (strcmp(argv[2], "threads") != 0 && strcmp(argv[2], "mpi") != 0 &&
                   strcmp(argv[2], "mpi_split") != 0 && strcmp(argv[2], "mpi_threads") != 0)) {
    fprintf(stderr, "usage: %s REF_DIR threads [BACKEND] | mpi | mpi_split | mpi_threads\n",
            argv[0]);
    return 2;
  }
  if (strcmp(argv[2], "mpi_threads") == 0) return run_mpi_threads(argv[1]);
  if (fsdp_api_version() != FSDP_C_API_VERSION) {
    fprintf(stderr, "c_api_train_test: header %d, library %u (%s)\n", FSDP_C_API_VERSION,
            fsdp_api_version(), fsdp_version_string());
    return 1;
  }
  const int split = strcmp(argv[2], "mpi_split") == 0;
  const int mpi = split || strcmp(argv[2], "mpi") == 0;
  const char* backend = argc > 3 ? argv[3] : "cpu";
  fsdp_world* world = NULL;
  int rank = 0, size = 1;
#ifdef CAPI_TEST_MPI
  MPI_Comm half = MPI_COMM_NULL;
  if (split) {
    /* The program's own MPI, as a framework that uses MPI itself would have it. */
    int provided = 0, world_rank = 0;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_split(MPI_COMM_WORLD, world_rank / 2, world_rank, &half);
  }
#else
  if (split) {
    fprintf(stderr, "c_api_train_test: built without MPI\n");
    return 1;
  }
#endif
  if (mpi) {
#ifdef CAPI_TEST_MPI
    fsdp_error* e = split ? fsdp_world_create_mpi_comm(&half, NULL, &world)
                          : fsdp_world_create_mpi(NULL, &world);
#else
    fsdp_error* e = fsdp_world_create_mpi(NULL, &world);
#endif
    if (e == NULL) e = fsdp_world_rank(world, &rank);
    if (e == NULL) e = fsdp_world_size(world, &size);
    if (e != NULL) {
      fprintf(stderr, "c_api_train_test: %s\n", fsdp_error_message(e));
      fsdp_error_destroy(e);
      return 1;
    }
  }
  int failures = 0, runs = 0;
  for (int c = 0; c < MLP_NUM_CONFIGS; ++c) {
    const mlp_config* cfg = &kMlpConfigs[c];
    if (mpi && cfg->world != size) continue;
    job j = {cfg, backend, read_ref(argv[1], cfg)};
    if (j.ref == NULL) return 1;
    fsdp_error* e = mpi ? train(world, &j) : fsdp_run_threads(cfg->world, NULL, train, &j);
    if (mpi) {
      fsdp_error* agreed = fsdp_world_agree(world, e);
      fsdp_error_destroy(e);
      e = agreed;
    }
    free((void*)j.ref);
    ++runs;
    if (e != NULL) {
      ++failures;
      fprintf(stderr, "FAILED %s (%s, %s): %s\n", cfg->name, mpi ? "mpi" : "threads", backend,
              fsdp_error_message(e));
      fsdp_error_destroy(e);
    } else if (rank == 0) {
      printf("ok %s (%s, %s): %d steps, losses, norms and parameters bitwise the C++ API's\n",
             cfg->name,
             split ? "processes under mpirun, a world per half of a split"
                   : mpi ? "processes under mpirun" : "threads",
             backend, MLP_STEPS);
    }
  }
  if (mpi) {
    fsdp_world_destroy(world);
    fsdp_mpi_shutdown();
  }
#ifdef CAPI_TEST_MPI
  if (split) {
    MPI_Comm_free(&half);
    MPI_Finalize();
  }
#endif
  if (runs == 0) {
    fprintf(stderr, "c_api_train_test: no configuration has %d ranks\n", size);
    return 1;
  }
  return failures == 0 ? 0 : 1;
}
