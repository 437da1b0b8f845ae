#include "mlp.h"

int mlp_param_ndim(int unit, int param) { (void)unit; return param == 0 ? 2 : 1; }

void mlp_param_shape(int unit, int param, int64_t shape[2]) {
  const int64_t rows = unit == 0 ? MLP_HIDDEN : MLP_OUT;
  const int64_t cols = unit == 0 ? MLP_IN : MLP_HIDDEN;
  shape[0] = rows;
  shape[1] = param == 0 ? cols : 1;
}

int64_t mlp_param_numel(int unit, int param) {
  int64_t s[2];
  mlp_param_shape(unit, param, s);
  return param == 0 ? s[0] * s[1] : s[0];
}

/* A value in [-0.5, 0.5) from a 32-bit integer hash of the inputs. */
static float hash_unit(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  uint32_t h = 2166136261u;
  const uint32_t v[4] = {a, b, c, d};
  for (int i = 0; i < 4; ++i) {
    h ^= v[i];
    h *= 16777619u;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
  }
  return (float)(h >> 8) / 16777216.0f - 0.5f;
}

float mlp_init(int unit, int param, int64_t i) {
  return 0.6f * hash_unit(1u + (uint32_t)unit, 7u + (uint32_t)param, (uint32_t)i, 99u);
}

void mlp_batch(int rank, int step, int micro_batch, float* x, float* t) {
  const uint32_t key = (uint32_t)(rank * 1000 + step * 10 + micro_batch);
  for (int i = 0; i < MLP_BATCH * MLP_IN; ++i) x[i] = 2.0f * hash_unit(key, 1u, (uint32_t)i, 5u);
  for (int i = 0; i < MLP_BATCH * MLP_OUT; ++i) t[i] = hash_unit(key, 2u, (uint32_t)i, 5u);
}

void mlp_forward1(mlp_acts* a, const float* w1, const float* b1) {
  for (int b = 0; b < MLP_BATCH; ++b) {
    for (int j = 0; j < MLP_HIDDEN; ++j) {
      float s = b1[j];
      for (int i = 0; i < MLP_IN; ++i) s += a->x[b * MLP_IN + i] * w1[j * MLP_IN + i];
      a->hpre[b * MLP_HIDDEN + j] = s;
      a->h[b * MLP_HIDDEN + j] = s > 0.0f ? s : 0.0f;
    }
  }
}

float mlp_forward2(mlp_acts* a, const float* w2, const float* b2) {
  float loss = 0.0f;
  for (int b = 0; b < MLP_BATCH; ++b) {
    for (int o = 0; o < MLP_OUT; ++o) {
      float s = b2[o];
      for (int j = 0; j < MLP_HIDDEN; ++j) s += a->h[b * MLP_HIDDEN + j] * w2[o * MLP_HIDDEN + j];
      a->y[b * MLP_OUT + o] = s;
      const float d = s - a->t[b * MLP_OUT + o];
      loss += 0.5f * d * d;
    }
  }
  return loss / (float)(MLP_BATCH * MLP_OUT);
}

void mlp_backward2(mlp_acts* a, const float* w2, float* dw2, float* db2) {
  for (int k = 0; k < MLP_BATCH * MLP_HIDDEN; ++k) a->dh[k] = 0.0f;
  for (int b = 0; b < MLP_BATCH; ++b) {
    for (int o = 0; o < MLP_OUT; ++o) {
      const float dy = (a->y[b * MLP_OUT + o] - a->t[b * MLP_OUT + o]) / (float)(MLP_BATCH * MLP_OUT);
      db2[o] += dy;
      for (int j = 0; j < MLP_HIDDEN; ++j) {
        dw2[o * MLP_HIDDEN + j] += dy * a->h[b * MLP_HIDDEN + j];
        a->dh[b * MLP_HIDDEN + j] += dy * w2[o * MLP_HIDDEN + j];
      }
    }
  }
}

void mlp_backward1(const mlp_acts* a, float* dw1, float* db1) {
  for (int b = 0; b < MLP_BATCH; ++b) {
    for (int j = 0; j < MLP_HIDDEN; ++j) {
      const float g = a->hpre[b * MLP_HIDDEN + j] > 0.0f ? a->dh[b * MLP_HIDDEN + j] : 0.0f;
      db1[j] += g;
      for (int i = 0; i < MLP_IN; ++i) dw1[j * MLP_IN + i] += g * a->x[b * MLP_IN + i];
    }
  }
}

void gpt_tokens(int rank, int step, int vocab, int32_t* inputs, int32_t* targets) {
  int32_t seq[GPT_BATCH * (GPT_SEQ + 1)];
  for (int i = 0; i < GPT_BATCH * (GPT_SEQ + 1); ++i) {
    const float u = hash_unit((uint32_t)rank, (uint32_t)step, (uint32_t)i, 11u) + 0.5f;
    /* A skewed distribution over a small part of the vocabulary, so that a few steps learn. */
    int32_t t = (int32_t)(u * u * 64.0f);
    seq[i] = t < vocab ? t : vocab - 1;
  }
  for (int b = 0; b < GPT_BATCH; ++b) {
    for (int t = 0; t < GPT_SEQ; ++t) {
      inputs[b * GPT_SEQ + t] = seq[b * (GPT_SEQ + 1) + t];
      targets[b * GPT_SEQ + t] = seq[b * (GPT_SEQ + 1) + t + 1];
    }
  }
}
