// The model's layers as free functions, forward and backward written by hand (llm.c style).
//
// Shapes: T = rows (this rank's local tokens, padding included), D = model width, F = SwiGLU
// width, V = vocab, heads/hd = heads and head dim of a RoPE'd tensor. Activations are
// row-major and contiguous, [T, ...]. A weight W that maps `in` features to `out` features is
// stored [in, out], so Y = X @ W. Backward functions add (+=) into parameter gradients and,
// where said, into input gradients: a parameter or a residual used twice sums its gradients.
// Internal to cpattn_train (not installed).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace cpattn::train {

// C[m, n] = beta * C + op(A) @ op(B), cblas_sgemm: A is stored [m, k] ([k, m] when ta), B
// [k, n] ([n, k] when tb), all row-major and contiguous. The linear layer's forward is
// matmul(x, w, y, T, out, in, false, false, 0); its backward dW += x^T dy is
// matmul(x, dy, dw, in, out, T, true, false, 1) and dx = dy W^T is
// matmul(dy, w, dx, T, in, out, false, true, beta).
void matmul(const float* a, const float* b, float* c, int64_t m, int64_t n, int64_t k, bool ta, bool tb,
            float beta);

// Sets BLAS's thread count (OpenBLAS; a no-op for a BLAS without that control).
void set_blas_threads(int threads);

// out[t] = wte[tokens[t]]. wte: [V, D]; out: [T, D].
void embedding_forward(float* out, const float* wte, std::span<const int64_t> tokens, int D);
// dwte[tokens[t]] += dout[t]. dout: [T, D].
void embedding_backward(float* dwte, const float* dout, std::span<const int64_t> tokens, int D);

// out[t] = x[t] * rstd[t] * g, rstd[t] = 1 / sqrt(mean(x[t]^2) + eps). x, out: [T, D]; g: [D];
// rstd: [T].
void rmsnorm_forward(float* out, float* rstd, const float* x, const float* g, int64_t T, int D, float eps);
// dx += d(out)/dx^T dout, dg += d(out)/dg^T dout (x, rstd, g as in the forward).
//   dx_i = r g_i dout_i - x_i r^3 / D * sum_j g_j dout_j x_j
void rmsnorm_backward(float* dx, float* dg, const float* dout, const float* x, const float* rstd,
                      const float* g, int64_t T, int D);

// RoPE tables for T tokens at `positions`: cos_t, sin_t [T, hd/2], angle pos * theta^(-2i/hd).
void rope_tables(std::vector<float>& cos_t, std::vector<float>& sin_t, std::span<const int64_t> positions,
                 int hd, float theta);
// Rotary embedding in place, half-split pairs (i, i + hd/2) rotated by the tables' angles.
// x: [T, heads, hd]. inverse: rotate back (the backward of a rotation is the opposite one).
void rope(float* x, const float* cos_t, const float* sin_t, int64_t T, int heads, int hd, bool inverse);

// Hidden dropout on local rows, keyed by global position (sequence parallel): x[t, j] is
// scaled by 1 / (1 - p), or set to 0 when dropped, the decision of attention dropout's
// generator cpattn::dropout_keep(seed, site, doc[t], pos[t], j, p) (site in the head's place,
// the feature j in the key position's), so a row draws the same mask on whichever rank holds
// it, given its document and its position in the document. Rows with doc[t] < 0 (padding) are
// left as they are. x: [T, D]; doc, pos: [T]. Its own backward: the same call on the gradient.
void dropout_rows(float* x, std::span<const int64_t> doc, std::span<const int64_t> pos, int D, float p,
                  uint64_t seed, int64_t site);

// SwiGLU's gate: h = silu(a) * b, elementwise over n = T * F values.
void swiglu_forward(float* h, const float* a, const float* b, int64_t n);
// da = dh * b * silu'(a), db = dh * silu(a) (written).
void swiglu_backward(float* da, float* db, const float* dh, const float* a, const float* b, int64_t n);

// Cross-entropy of rows with a label (kIgnoreIndex: skipped). logits: [T, V], in place: each
// labeled row becomes its softmax probabilities (what the backward needs). Returns the sum of
// the labeled rows' losses (nats) and counts them in `scored`.
double cross_entropy_forward(float* logits, std::span<const int64_t> labels, int V, int64_t& scored);
// dlogits = (p - onehot(y)) / total on labeled rows, 0 elsewhere, in place over the
// forward's probabilities. total: the labeled rows of the whole batch (all ranks).
void cross_entropy_backward(float* logits, std::span<const int64_t> labels, int V, int64_t total);

}  // namespace cpattn::train
