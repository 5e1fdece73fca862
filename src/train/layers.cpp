// The model's layers (layers.hpp): plain loops in a fixed order, so that every rank and every
// run computes bitwise the same values; matrix products go to cblas_sgemm.
#include "layers.hpp"

#include <cpattn/attention.hpp>
#include <cpattn/plan.hpp>

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

// OpenBLAS's thread control, when the BLAS in use is OpenBLAS (weak: absent elsewhere).
extern "C" void openblas_set_num_threads(int) __attribute__((weak));

namespace cpattn::train {

void matmul(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k, bool ta, bool tb,
            float beta) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, a,
              static_cast<int>(ta ? m : k), b, static_cast<int>(tb ? k : n), beta, c,
              static_cast<int>(n));
}

void set_blas_threads(int threads) {
  if (openblas_set_num_threads != nullptr) openblas_set_num_threads(threads);
}

void embedding_forward(float* out, const float* wte, std::span<const int64_t> tokens, int D) {
  for (std::size_t t = 0; t < tokens.size(); ++t)
    std::memcpy(out + static_cast<int64_t>(t) * D, wte + tokens[t] * D, sizeof(float) * D);
}

void embedding_backward(float* dwte, const float* dout, std::span<const int64_t> tokens, int D) {
  for (std::size_t t = 0; t < tokens.size(); ++t) {
    float* g = dwte + tokens[t] * D;
    const float* d = dout + static_cast<int64_t>(t) * D;
    for (int i = 0; i < D; ++i) g[i] += d[i];
  }
}

void rmsnorm_forward(float* out, float* rstd, const float* x, const float* g, int64_t T, int D, float eps) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    float ss = 0.0f;
    for (int i = 0; i < D; ++i) ss += xt[i] * xt[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
    rstd[t] = r;
    float* ot = out + t * D;
    for (int i = 0; i < D; ++i) ot[i] = xt[i] * r * g[i];
  }
}

void rmsnorm_backward(float* dx, float* dg, const float* dout, const float* x, const float* rstd,
                      const float* g, int64_t T, int D) {
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x + t * D;
    const float* dt = dout + t * D;
    float* dxt = dx + t * D;
    const float r = rstd[t];
    float dot = 0.0f;
    for (int i = 0; i < D; ++i) dot += g[i] * dt[i] * xt[i];
    const float c = r * r * r * dot / static_cast<float>(D);
    for (int i = 0; i < D; ++i) {
      dxt[i] += r * g[i] * dt[i] - xt[i] * c;
      dg[i] += dt[i] * xt[i] * r;
    }
  }
}

void rope_tables(std::vector<float>& cos_t, std::vector<float>& sin_t, std::span<const int64_t> positions,
                 int hd, float theta) {
  const int half = hd / 2;
  const auto T = static_cast<int64_t>(positions.size());
  std::vector<double> inv_freq(half);
  for (int i = 0; i < half; ++i) inv_freq[i] = std::pow(static_cast<double>(theta), -2.0 * i / hd);
  cos_t.resize(T * half);
  sin_t.resize(T * half);
  for (int64_t t = 0; t < T; ++t)
    for (int i = 0; i < half; ++i) {
      const double ang = static_cast<double>(positions[t]) * inv_freq[i];
      cos_t[t * half + i] = static_cast<float>(std::cos(ang));
      sin_t[t * half + i] = static_cast<float>(std::sin(ang));
    }
}

void dropout_rows(float* x, std::span<const int64_t> doc, std::span<const int64_t> pos, int D, float p,
                  uint64_t seed, int64_t site) {
  const float scale = 1.0f / (1.0f - p);
  for (std::size_t t = 0; t < doc.size(); ++t) {
    if (doc[t] < 0) continue;
    float* row = x + static_cast<int64_t>(t) * D;
    for (int j = 0; j < D; ++j) row[j] = dropout_keep(seed, site, doc[t], pos[t], j, p) ? row[j] * scale : 0.0f;
  }
}

void rope(float* x, const float* cos_t, const float* sin_t, int64_t T, int heads, int hd, bool inverse) {
  const int half = hd / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_t + t * half;
    const float* s = sin_t + t * half;
    for (int h = 0; h < heads; ++h) {
      float* v = x + (t * heads + h) * hd;
      for (int i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        const float si = inverse ? -s[i] : s[i];
        v[i] = x1 * c[i] - x2 * si;
        v[i + half] = x1 * si + x2 * c[i];
      }
    }
  }
}

namespace {
float silu(float a) { return a / (1.0f + std::exp(-a)); }
}  // namespace

void swiglu_forward(float* h, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = silu(a[i]) * b[i];
}

void swiglu_backward(float* da, float* db, const float* dh, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = 1.0f / (1.0f + std::exp(-a[i]));
    const float sl = a[i] * s;
    db[i] = dh[i] * sl;
    da[i] = dh[i] * b[i] * s * (1.0f + a[i] * (1.0f - s));
  }
}

double cross_entropy_forward(float* logits, std::span<const int64_t> labels, int V, int64_t& scored) {
  double loss_sum = 0;
  scored = 0;
  for (std::size_t t = 0; t < labels.size(); ++t) {
    const int64_t y = labels[t];
    if (y == kIgnoreIndex) continue;
    float* row = logits + static_cast<int64_t>(t) * V;
    float mx = row[0];
    for (int j = 1; j < V; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j] - mx));
    const double lse = static_cast<double>(mx) + std::log(sum);
    loss_sum += lse - static_cast<double>(row[y]);
    for (int j = 0; j < V; ++j) row[j] = static_cast<float>(std::exp(static_cast<double>(row[j]) - lse));
    ++scored;
  }
  return loss_sum;
}

void cross_entropy_backward(float* logits, std::span<const int64_t> labels, int V, int64_t total) {
  const float inv = 1.0f / static_cast<float>(total);
  for (std::size_t t = 0; t < labels.size(); ++t) {
    float* row = logits + static_cast<int64_t>(t) * V;
    const int64_t y = labels[t];
    if (y == kIgnoreIndex) {
      std::fill(row, row + V, 0.0f);
      continue;
    }
    row[y] -= 1.0f;
    for (int j = 0; j < V; ++j) row[j] *= inv;
  }
}

}  // namespace cpattn::train
