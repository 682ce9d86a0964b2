/* RMSNorm, with the residual add before it.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"

/* x += delta (the residual add) where delta is given, then out = x / sqrt(mean(x^2) + eps) * weight. */
static inline void rms_norm_row(float *x, const float *delta, int64_t k, const float *weight, float eps, float *out, int64_t i) {
    float *xr = x + i * k;
    float *o = out + i * k;
    if (delta) {
        const float *dr = delta + i * k;
#pragma omp simd
        for (int64_t j = 0; j < k; j++) xr[j] += dr[j];
    }
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t j = 0; j < k; j++) squares += xr[j] * xr[j];
    const float inv = 1.0f / sqrtf(squares / (float)k + eps);
#pragma omp simd
    for (int64_t j = 0; j < k; j++) o[j] = weight[j] * (xr[j] * inv);
}

void ip_rms_norm(float *x, const float *delta, int64_t m, int64_t k, const float *weight, float eps, float *out) {
    FOR_ROWS(m, 8, rms_norm_row(x, delta, k, weight, eps, out, i));
}
