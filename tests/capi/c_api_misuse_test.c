/* The C API under misuse, as a fuzzer would feed it: NULL, destroyed, foreign and made-up
 * handles, wrong sizes and values, and hooks in the wrong order. Every call must come back with
 * an error of the expected code (never a crash; ASan checks the rest), and the runtime must stay
 * usable after each refused call. Then callers built against an older header: argument structs
 * shorter than this library's (fields added later keep their defaults, the bytes beyond the
 * caller's struct are never read) and output structs that are never written past their size. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fsdp/c_api.h"

static int failures = 0;
static int checks = 0;

/* Takes `e` over; expects `code` (FSDP_CODE_OK: no error) and, when not NULL, `needle` in the
 * message. */
static void expect(fsdp_error* e, fsdp_code code, const char* needle, const char* what, int line) {
  ++checks;
  const fsdp_code got = fsdp_error_code(e);
  const char* message = fsdp_error_message(e);
  if (got != code || (needle != NULL && strstr(message, needle) == NULL)) {
    ++failures;
    fprintf(stderr, "line %d: %s: expected code %d%s%s, got %d: \"%s\"\n", line, what, (int)code,
            needle != NULL ? " with " : "", needle != NULL ? needle : "", (int)got, message);
  }
  fsdp_error_destroy(e);
}
#define EXPECT(call, code, needle) expect((call), (code), (needle), #call, __LINE__)
#define EXPECT_OK(call) expect((call), FSDP_CODE_OK, NULL, #call, __LINE__)
#define INVALID FSDP_CODE_INVALID_ARGUMENT
#define ORDER FSDP_CODE_FAILED_PRECONDITION

static fsdp_error* init_ones(void* user, int unit, int param, int64_t begin, int64_t end,
                             float* out) {
  (void)user, (void)unit, (void)param;
  for (int64_t i = begin; i < end; ++i) out[i - begin] = 1.0f;
  return NULL;
}

static fsdp_error* init_fails(void* user, int unit, int param, int64_t begin, int64_t end,
                              float* out) {
  (void)user, (void)unit, (void)param, (void)begin, (void)end, (void)out;
  return fsdp_error_create(FSDP_CODE_DATA_LOSS, "init_fails: the initial values are gone");
}

/* A runtime of one unit (w [4, 3], b [4]) over `world`. */
static fsdp_runtime* make_runtime(fsdp_backend* backend, fsdp_world* world,
                                  const fsdp_sharding_options* o) {
  fsdp_runtime* rt = NULL;
  EXPECT_OK(fsdp_runtime_create(backend, world, o, &rt));
  static const int64_t w_shape[2] = {4, 3}, b_shape[1] = {4};
  fsdp_param p[2];
  fsdp_param_init(&p[0]);
  fsdp_param_init(&p[1]);
  p[0].name = "w";
  p[0].shape = w_shape;
  p[0].ndim = 2;
  p[1].name = "b";
  p[1].shape = b_shape;
  p[1].ndim = 1;
  EXPECT_OK(fsdp_runtime_register_unit(rt, "unit", p, 2, NULL));
  return rt;
}

/* One misuse that the runtime refuses, which fails the runtime and its world: on a world, a
 * backend and a runtime of their own. */
#define NUM_FATAL_CASES 9
static void fatal_case(int c) {
  fsdp_thread_group* group = NULL;
  fsdp_world* world = NULL;
  fsdp_backend* backend = NULL;
  EXPECT_OK(fsdp_thread_group_create(1, NULL, &group));
  EXPECT_OK(fsdp_thread_group_take_rank(group, 0, &world));
  EXPECT_OK(fsdp_backend_create("cpu", NULL, 0, 0, &backend));
  fsdp_runtime* rt = NULL;
  if (c == 0) { /* a dimension of 0 */
    EXPECT_OK(fsdp_runtime_create(backend, world, NULL, &rt));
    fsdp_param p;
    fsdp_param_init(&p);
    const int64_t shape[2] = {4, 0};
    p.name = "w";
    p.shape = shape;
    p.ndim = 2;
    EXPECT(fsdp_runtime_register_unit(rt, "u", &p, 1, NULL), INVALID, "every dimension");
  } else if (c == 1) { /* init fails */
    rt = make_runtime(backend, world, NULL);
    EXPECT(fsdp_runtime_finalize(rt, init_fails, NULL), FSDP_CODE_DATA_LOSS, "gone");
  } else {
    rt = make_runtime(backend, world, NULL);
    fsdp_unit_view v;
    v.struct_size = sizeof v;
    if (c == 2) {
      EXPECT(fsdp_pre_forward(rt, 0, &v), ORDER, NULL); /* before finalize */
    } else if (c == 3) {
      EXPECT(fsdp_step(rt, 0.1f, NULL), ORDER, NULL);
    } else {
      EXPECT_OK(fsdp_runtime_finalize(rt, init_ones, NULL));
      if (c == 4) EXPECT(fsdp_pre_backward(rt, 0, &v), ORDER, NULL);
      if (c == 5) EXPECT(fsdp_post_forward(rt, 0), ORDER, NULL);
      if (c == 6) EXPECT(fsdp_finish_backward(rt), ORDER, NULL);
      if (c == 7) {
        EXPECT(fsdp_runtime_finalize(rt, init_ones, NULL), ORDER, NULL);
      }
      if (c == 8) {
        EXPECT_OK(fsdp_pre_forward(rt, 0, &v));
        EXPECT(fsdp_pre_forward(rt, 0, &v), ORDER, NULL); /* twice */
      }
    }
  }
  fsdp_runtime_destroy(rt);
  fsdp_backend_destroy(backend);
  fsdp_world_destroy(world);
  fsdp_thread_group_destroy(group);
}

static fsdp_error* misuse(fsdp_world* world, void* user) {
  (void)user;
  /* ---- errors and versions ---- */
  EXPECT(NULL, FSDP_CODE_OK, "");
  fsdp_error* e = fsdp_error_create(FSDP_CODE_OK, NULL);
  EXPECT(e, FSDP_CODE_UNKNOWN, "");
  EXPECT(fsdp_error_create((fsdp_code)99, "x"), FSDP_CODE_UNKNOWN, "x");
  fsdp_error_destroy(NULL);
  if (strstr(fsdp_version_string(), "libfsdp") == NULL) ++failures;

  /* ---- NULL, made-up, foreign and destroyed handles ---- */
  int rank = -1, n = 0;
  EXPECT(fsdp_world_rank(NULL, &rank), INVALID, "world is NULL");
  EXPECT(fsdp_world_rank(world, NULL), INVALID, "rank is NULL");
  EXPECT(fsdp_world_rank((fsdp_world*)(uintptr_t)0x1000, &rank), INVALID, "not a live fsdp_world");
  EXPECT_OK(fsdp_world_rank(world, &rank));
  EXPECT(fsdp_backend_create(NULL, NULL, 0, rank, NULL), INVALID, "is NULL");
  fsdp_backend* backend = NULL;
  EXPECT(fsdp_backend_create("tpu9000", NULL, 0, rank, &backend), INVALID, "tpu9000");
  EXPECT(fsdp_backend_create("cpu", NULL, 3, rank, &backend), INVALID, "options is NULL");
  fsdp_key_value bad_key = {"no_such_key", "1"};
  fsdp_error* bad = fsdp_backend_create("cpu", &bad_key, 1, rank, &backend);
  if (bad == NULL) {
    ++failures;
    fprintf(stderr, "an unknown backend option was accepted\n");
    fsdp_backend_destroy(backend);
  }
  fsdp_error_destroy(bad);
  fsdp_key_value null_value = {"threads", NULL};
  EXPECT(fsdp_backend_create("cpu", &null_value, 1, rank, &backend), INVALID, "NULL key or value");
  fsdp_backend* dead = NULL;
  EXPECT_OK(fsdp_backend_create("cpu", NULL, 0, rank, &dead));
  fsdp_backend_destroy(dead);
  fsdp_backend_destroy(dead); /* twice: ignored */
  int is_host = 0;
  EXPECT(fsdp_backend_is_host(dead, &is_host), INVALID, "not a live fsdp_backend");
  /* New backends never take a destroyed one's address: the stale handle stays an error. */
  fsdp_backend* fresh[8];
  for (int i = 0; i < 8; ++i) {
    EXPECT_OK(fsdp_backend_create("cpu", NULL, 0, rank, &fresh[i]));
    if (fresh[i] == dead) ++failures;
  }
  EXPECT(fsdp_backend_is_host(dead, &is_host), INVALID, "not a live fsdp_backend");
  for (int i = 0; i < 8; ++i) fsdp_backend_destroy(fresh[i]);
  EXPECT_OK(fsdp_backend_create("cpu", NULL, 0, rank, &backend));
  EXPECT(fsdp_backend_is_host((const fsdp_backend*)world, &is_host), INVALID,
         "is an fsdp_world, not an fsdp_backend");
  fsdp_runtime* not_runtime = (fsdp_runtime*)backend;
  EXPECT(fsdp_pre_forward(not_runtime, 0, NULL), INVALID, "not an fsdp_runtime");
  fsdp_runtime_destroy(not_runtime); /* a backend passed as a runtime: ignored */
  fsdp_world_destroy((fsdp_world*)backend); /* likewise */
  EXPECT_OK(fsdp_backend_is_host(backend, &is_host));
  char small[4];
  size_t length = 0;
  EXPECT(fsdp_backend_name(backend, NULL, 8, &length), INVALID, "buffer is NULL");
  EXPECT_OK(fsdp_backend_name(backend, small, sizeof small, &length));
  if (length != 3 || strcmp(small, "cpu") != 0) ++failures;
  EXPECT_OK(fsdp_backend_names(NULL, 0, &length));
  if (length == 0) ++failures;
  int devices = 0;
  EXPECT_OK(fsdp_backend_device_count("cpu", NULL, 0, &devices));
  if (devices != -1) ++failures;
  EXPECT(fsdp_backend_device_count("tpu9000", NULL, 0, &devices), INVALID, "tpu9000");
  EXPECT(fsdp_backend_device_count("cpu", NULL, 0, NULL), INVALID, "devices is NULL");
  /* Adopted memory: on cpu the caller's host memory, read and written through the view. */
  float mine[4] = {1, 2, 3, 4}, back[4] = {0, 0, 0, 0};
  fsdp_view adopted;
  adopted.struct_size = sizeof adopted;
  EXPECT_OK(fsdp_backend_wrap_native_memory(backend, mine, 4, FSDP_DTYPE_F32, &adopted));
  EXPECT_OK(fsdp_view_copy_to_host(backend, &adopted, back, 16));
  if (adopted.host != mine || adopted.count != 4 || back[3] != 4.0f) ++failures;
  EXPECT(fsdp_backend_wrap_native_memory(backend, NULL, 4, FSDP_DTYPE_F32, &adopted), INVALID,
         "pointer is NULL");
  fsdp_backend* sim = NULL;
  EXPECT_OK(fsdp_backend_create("sim", NULL, 0, rank, &sim));
  EXPECT(fsdp_backend_wrap_native_memory(sim, mine, 4, FSDP_DTYPE_F32, &adopted),
         FSDP_CODE_UNIMPLEMENTED, "sim backend cannot adopt");
  fsdp_backend_destroy(sim);
  void* stream = NULL;
  EXPECT(fsdp_backend_native_stream(backend, 0, &stream), FSDP_CODE_UNIMPLEMENTED, "cpu");
  EXPECT(fsdp_backend_native_stream(backend, 2, &stream), INVALID, "stream is 2");

  /* ---- options ---- */
  fsdp_sharding_options o;
  fsdp_sharding_options_init(&o);
  fsdp_runtime* rt = NULL;
  o.struct_size = 0;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "struct_size is 0");
  fsdp_sharding_options_init(&o);
  o.strategy = (fsdp_strategy)17;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "strategy is 17");
  fsdp_sharding_options_init(&o);
  o.param_dtype = (fsdp_dtype)-3;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "param_dtype is -3");
  fsdp_sharding_options_init(&o);
  o.optimizer = (fsdp_optimizer)9;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "optimizer is 9");
  fsdp_sharding_options_init(&o);
  o.nonfinite = (fsdp_nonfinite)-1;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "nonfinite is -1");
  fsdp_sharding_options_init(&o);
  o.offload = (fsdp_offload)3;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "offload is 3");
  fsdp_sharding_options_init(&o);
  o.max_prefetch_units = -1;
  EXPECT(fsdp_runtime_create(backend, world, &o, &rt), INVALID, "max_prefetch_units");
  fsdp_sharding_options_init(&o);
  EXPECT(fsdp_runtime_create(NULL, world, &o, &rt), INVALID, "backend is NULL");

  /* ---- registration and finalize ---- */
  /* A refused registration or hook fails the runtime and its world on every rank (peers must not
   * wait for a rank that stopped): each of these cases gets a world of its own. */
  for (int c = 0; c < NUM_FATAL_CASES; ++c) fatal_case(c);
  EXPECT_OK(fsdp_runtime_create(backend, world, NULL, &rt)); /* NULL options: the defaults */
  fsdp_param p;
  fsdp_param_init(&p);
  EXPECT(fsdp_runtime_register_unit(rt, "u", &p, 1, NULL), INVALID, "name is NULL");
  p.name = "w";
  p.ndim = 2;
  EXPECT(fsdp_runtime_register_unit(rt, "u", &p, 1, NULL), INVALID, "NULL shape");
  p.ndim = 9;
  EXPECT(fsdp_runtime_register_unit(rt, "u", &p, 1, NULL), INVALID, "ndim 9");
  EXPECT(fsdp_runtime_register_unit(rt, "u", NULL, 2, NULL), INVALID, "params is NULL");
  EXPECT(fsdp_runtime_register_unit(rt, NULL, &p, 1, NULL), INVALID, "name is NULL");
  fsdp_runtime_destroy(rt);
  rt = make_runtime(backend, world, NULL);
  EXPECT_OK(fsdp_runtime_finalize(rt, init_ones, NULL));

  /* ---- hooks: units out of range, wrong sizes ---- */
  fsdp_unit_view v;
  v.struct_size = sizeof v;
  EXPECT(fsdp_pre_forward(rt, 5, &v), FSDP_CODE_OUT_OF_RANGE, "unit 5 does not exist");
  EXPECT(fsdp_pre_forward(rt, -1, &v), FSDP_CODE_OUT_OF_RANGE, NULL);
  v.struct_size = 0; /* refused before the hook runs: the same call then succeeds */
  EXPECT(fsdp_pre_forward(rt, 0, &v), INVALID, "struct_size is 0");
  v.struct_size = sizeof v;
  EXPECT_OK(fsdp_pre_forward(rt, 0, &v));
  if (v.numel != 16 || v.params.count != 16 || v.params.host == NULL || v.grads.count != 0 ||
      ((const float*)v.params.host)[15] != 1.0f) {
    ++failures;
    fprintf(stderr, "pre_forward's view is wrong\n");
    return NULL;
  }
  float host[16];
  EXPECT(fsdp_view_copy_to_host(backend, &v.params, host, 15 * 4), INVALID, "bytes is 60");
  fsdp_view forged = v.params;
  forged.count = 1 << 30;
  EXPECT(fsdp_view_copy_to_host(backend, &forged, host, (int64_t)4 << 30), INVALID,
         "does not fit its allocation");
  forged = v.params;
  forged.offset = -8;
  EXPECT(fsdp_view_copy_to_host(backend, &forged, host, 64), INVALID, NULL);
  forged = v.params;
  forged.dtype = (fsdp_dtype)77;
  EXPECT(fsdp_view_copy_to_host(backend, &forged, host, 64), INVALID, "dtype is 77");
  EXPECT(fsdp_view_copy_to_host(backend, NULL, host, 64), INVALID, "view is NULL");
  EXPECT_OK(fsdp_view_copy_to_host(backend, &v.params, host, 64));
  EXPECT_OK(fsdp_post_forward(rt, 0));
  EXPECT_OK(fsdp_pre_backward(rt, 0, &v));
  if (v.grads.host == NULL || v.grads.count != 16) {
    ++failures;
    fprintf(stderr, "pre_backward's view is wrong\n");
    return NULL;
  }
  for (int i = 0; i < 16; ++i) ((float*)v.grads.host)[i] += 0.5f;
  EXPECT_OK(fsdp_post_backward(rt, 0));
  EXPECT_OK(fsdp_finish_backward(rt));
  fsdp_step_stats stats;
  stats.struct_size = 1;
  EXPECT(fsdp_step(rt, 0.1f, &stats), INVALID, "struct_size is 1");
  stats.struct_size = sizeof stats;
  EXPECT_OK(fsdp_step(rt, 0.1f, &stats));
  if (stats.step != 1 || stats.grad_norm != 2.0) { /* sqrt(16 * 0.25) */
    ++failures;
    fprintf(stderr, "step %lld, norm %g\n", (long long)stats.step, stats.grad_norm);
  }
  float gathered[16];
  EXPECT(fsdp_runtime_gather_unit(rt, 0, gathered, 15), INVALID, "capacity is 15");
  EXPECT(fsdp_runtime_gather_unit(rt, 0, NULL, 16), INVALID, "out is NULL");
  EXPECT_OK(fsdp_runtime_gather_unit(rt, 0, gathered, 16));
  EXPECT(fsdp_runtime_unit_param(rt, 0, 2, NULL, NULL, NULL, 0, NULL), INVALID, "index 2");
  EXPECT(fsdp_runtime_unit_param(rt, 1, 0, NULL, NULL, NULL, 0, NULL), FSDP_CODE_OUT_OF_RANGE,
         "unit 1");
  EXPECT(fsdp_set_activation_bytes(rt, -5), INVALID, NULL);
  EXPECT_OK(fsdp_runtime_num_units(rt, &n));
  if (n != 1) ++failures;

  /* ---- checkpoints, planner ---- */
  EXPECT(fsdp_checkpoint_load(rt, "/nonexistent/checkpoint", 1, NULL), FSDP_CODE_NOT_FOUND, NULL);
  EXPECT(fsdp_checkpoint_save(rt, NULL, 0), INVALID, "dir is NULL");
  EXPECT(fsdp_safetensors_export(rt, "/tmp/x.safetensors", (fsdp_dtype)42), INVALID, "dtype");
  fsdp_plan_request req;
  fsdp_plan_request_init(&req);
  req.model = "gpt5";
  fsdp_memory_plan plan;
  plan.struct_size = sizeof plan;
  EXPECT(fsdp_plan_memory(&req, &plan), INVALID, "gpt5");
  req.model = "nano";
  req.world_size = 0;
  EXPECT(fsdp_plan_memory(&req, &plan), INVALID, NULL);
  EXPECT(fsdp_plan_memory(NULL, &plan), INVALID, "request is NULL");

  /* ---- bundled models ---- */
  fsdp_model* model = NULL;
  fsdp_model_options mo;
  fsdp_model_options_init(&mo);
  mo.config = "nano";
  mo.batch_size = 1;
  mo.seq_len = 8;
  EXPECT_OK(fsdp_model_create(backend, world, NULL, &mo, &model));
  int32_t tokens[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  EXPECT(fsdp_model_forward_backward(model, tokens, tokens, 7, NULL), INVALID, "count is 7");
  tokens[3] = 1 << 20;
  EXPECT(fsdp_model_forward_backward(model, tokens, tokens, 8, NULL), INVALID, "token 3");
  tokens[3] = 4;
  EXPECT(fsdp_model_forward_backward(model, tokens, NULL, 8, NULL), INVALID, "targets is NULL");
  fsdp_runtime* model_rt = NULL;
  EXPECT_OK(fsdp_model_runtime(model, &model_rt));
  fsdp_model_destroy(model);
  EXPECT(fsdp_runtime_steps(model_rt, NULL), INVALID, "not a live fsdp_runtime");

  /* ---- destruction in the wrong order: deferred, never a crash ---- */
  fsdp_backend_destroy(backend); /* the runtime still uses it */
  EXPECT(fsdp_backend_is_host(backend, &is_host), INVALID, "not a live");
  EXPECT_OK(fsdp_pre_forward(rt, 0, &v)); /* the runtime keeps working */
  EXPECT_OK(fsdp_post_forward(rt, 0));
  EXPECT_OK(fsdp_finish_forward_only(rt));
  fsdp_runtime_destroy(rt); /* frees the backend too */
  fsdp_runtime_destroy(rt);
  EXPECT(fsdp_step(rt, 0.1f, NULL), INVALID, "not a live fsdp_runtime");
  return NULL;
}

/* ---- callers built against an older header ---------------------------------------------- */
static fsdp_error* older(fsdp_world* world, void* user) {
  (void)user;
  int rank = 0;
  EXPECT_OK(fsdp_world_rank(world, &rank));
  fsdp_backend* backend = NULL;
  EXPECT_OK(fsdp_backend_create("cpu", NULL, 0, rank, &backend));
  /* The options as a caller built before `offload` was added passes them: struct_size stops
   * before it, and the bytes after are not the caller's (0xFF here: an invalid offload kind and
   * a budget of -1 if they were read). */
  unsigned char* buffer = (unsigned char*)malloc(sizeof(fsdp_sharding_options) + 64);
  memset(buffer, 0xFF, sizeof(fsdp_sharding_options) + 64);
  fsdp_sharding_options current;
  fsdp_sharding_options_init(&current);
  current.strategy = FSDP_NO_SHARD;
  const size_t old_size = offsetof(fsdp_sharding_options, offload);
  memcpy(buffer, &current, old_size);
  ((fsdp_sharding_options*)buffer)->struct_size = old_size;
  fsdp_runtime* rt = make_runtime(backend, world, (const fsdp_sharding_options*)buffer);
  free(buffer);
  EXPECT_OK(fsdp_runtime_finalize(rt, init_ones, NULL));
  /* A longer struct (a caller built against a newer header): the fields this library knows. */
  unsigned char* longer = (unsigned char*)calloc(1, sizeof(fsdp_sharding_options) + 32);
  memcpy(longer, &current, sizeof current);
  ((fsdp_sharding_options*)longer)->struct_size = sizeof(fsdp_sharding_options) + 32;
  fsdp_runtime* rt2 = make_runtime(backend, world, (const fsdp_sharding_options*)longer);
  free(longer);
  EXPECT_OK(fsdp_runtime_finalize(rt2, init_ones, NULL));
  fsdp_runtime_destroy(rt2);

  /* Output structs written only up to the caller's struct_size. */
  struct {
    fsdp_unit_view view;
    unsigned char canary[64];
  } out;
  memset(&out, 0xAB, sizeof out);
  out.view.struct_size = offsetof(fsdp_unit_view, grads);
  EXPECT_OK(fsdp_pre_forward(rt, 0, &out.view));
  const unsigned char* grads_bytes = (const unsigned char*)&out.view.grads;
  for (size_t i = 0; i < sizeof out.view.grads; ++i) {
    if (grads_bytes[i] != 0xAB) {
      ++failures;
      fprintf(stderr, "fsdp_pre_forward wrote past an older caller's fsdp_unit_view\n");
      break;
    }
  }
  if (out.view.struct_size != offsetof(fsdp_unit_view, grads) || out.view.numel != 16) {
    ++failures;
  }
  EXPECT_OK(fsdp_post_forward(rt, 0));
  EXPECT_OK(fsdp_pre_backward(rt, 0, NULL));
  EXPECT_OK(fsdp_post_backward(rt, 0));
  EXPECT_OK(fsdp_finish_backward(rt));
  struct {
    fsdp_step_stats stats;
    unsigned char canary[64];
  } st;
  memset(&st, 0xCD, sizeof st);
  st.stats.struct_size = offsetof(fsdp_step_stats, loss_scale);
  EXPECT_OK(fsdp_step(rt, 0.1f, &st.stats));
  const unsigned char* tail = (const unsigned char*)&st.stats.loss_scale;
  if (tail[0] != 0xCD || st.stats.step != 1) {
    ++failures;
    fprintf(stderr, "fsdp_step wrote past an older caller's fsdp_step_stats\n");
  }
  fsdp_memory_report mem;
  mem.struct_size = sizeof mem;
  EXPECT_OK(fsdp_runtime_memory(rt, &mem));
  if (mem.host_offload_bytes != 0 || mem.offloaded_units != 0 || mem.param_shard_bytes != 64) {
    ++failures;
    fprintf(stderr, "an older caller's options were not read as such (offload %lld bytes)\n",
            (long long)mem.host_offload_bytes);
  }
  fsdp_runtime_destroy(rt);
  fsdp_backend_destroy(backend);
  return NULL;
}

/* Rank 1 fails before a collective that ranks 0 and 2 enter. */
static fsdp_error* gives_up(fsdp_world* world, void* user) {
  (void)user;
  int rank = 0;
  fsdp_error* e = fsdp_world_rank(world, &rank);
  if (e != NULL) return e;
  if (rank == 1) return fsdp_error_create(FSDP_CODE_DATA_LOSS, "rank 1 gives up");
  return fsdp_world_host_layout(world, NULL, NULL);
}

int main(void) {
  fsdp_error* e = fsdp_run_threads(1, NULL, misuse, NULL);
  EXPECT(e, FSDP_CODE_OK, NULL);
  e = fsdp_run_threads(2, NULL, older, NULL);
  EXPECT(e, FSDP_CODE_OK, NULL);
  /* Worlds. */
  EXPECT(fsdp_run_threads(0, NULL, misuse, NULL), INVALID, NULL);
  EXPECT(fsdp_run_threads(2, NULL, NULL, NULL), INVALID, "body is NULL");
  fsdp_thread_group* group = NULL;
  EXPECT_OK(fsdp_thread_group_create(2, NULL, &group));
  fsdp_world* w0 = NULL;
  EXPECT_OK(fsdp_thread_group_take_rank(group, 0, &w0));
  EXPECT(fsdp_thread_group_take_rank(group, 0, &w0), FSDP_CODE_FAILED_PRECONDITION, NULL);
  EXPECT(fsdp_thread_group_take_rank(group, 2, &w0), INVALID, NULL);
  int first = -1, count = 0;
  EXPECT_OK(fsdp_thread_group_ranks(group, &first, &count));
  if (first != 0 || count != 2) {
    fprintf(stderr, "FAILED: fsdp_thread_group_ranks of a 2-thread group: %d, %d\n", first, count);
    ++failures;
  }
  EXPECT(fsdp_thread_group_ranks(group, NULL, &count), INVALID, NULL);
  EXPECT(fsdp_thread_group_ranks(NULL, &first, &count), INVALID, NULL);
  EXPECT(fsdp_run_mpi_threads(2, NULL, NULL, NULL), INVALID, "body is NULL");
  EXPECT(fsdp_mpi_thread_group_create(2, NULL, NULL), INVALID, NULL);
  fsdp_thread_group_destroy(group);
  int size = 0;
  EXPECT_OK(fsdp_world_size(w0, &size)); /* outlives its group */
  fsdp_world_destroy(w0);
  /* A failing rank body: its error is the call's, and its peer's collective fails with it at
   * once rather than at the timeout (an hour here). */
  fsdp_world_options wo;
  fsdp_world_options_init(&wo);
  wo.timeout_seconds = 3600;
  EXPECT(fsdp_run_threads(3, &wo, gives_up, NULL), FSDP_CODE_DATA_LOSS, "rank 1 gives up");
  if (failures == 0) {
    printf("c_api_misuse_test: %d checks passed\n", checks);
    return 0;
  }
  fprintf(stderr, "c_api_misuse_test: %d of %d checks failed\n", failures, checks);
  return 1;
}
