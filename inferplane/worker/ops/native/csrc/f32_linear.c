/* float32 linear for few rows and a tall weight (an output head, a MoE router).
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"

#if IP_VECTOR
/* MR rows of x against NR weight rows, each output a dot product over k: the weight is read in its
 * own row-major layout (no packed copy: a tied head shares its bytes with the embedding), each
 * vector of it used by MR rows of x while in a register. */
static inline __attribute__((always_inline)) void f32_tile(const float *x, int64_t ldx, int mr, const float *w,
                                                           int64_t k, int nr, const float *bias, float *out,
                                                           int64_t ldo) {
    vf acc[8][8];
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int c = 0; c < nr; c++) acc[r][c] = vf_zero();
    int64_t j = 0;
    for (; j + VF_WIDTH <= k; j += VF_WIDTH) {
        vf wv[8];
#pragma GCC unroll 8
        for (int c = 0; c < nr; c++) wv[c] = vf_load(w + c * k + j);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const vf xv = vf_load(x + r * ldx + j);
#pragma GCC unroll 8
            for (int c = 0; c < nr; c++) acc[r][c] = vf_fmadd(xv, wv[c], acc[r][c]);
        }
    }
    if (j < k) {
        vf wv[8];
#pragma GCC unroll 8
        for (int c = 0; c < nr; c++) wv[c] = vf_load_tail(w + c * k + j, k - j);
#pragma GCC unroll 8
        for (int r = 0; r < mr; r++) {
            const vf xv = vf_load_tail(x + r * ldx + j, k - j);
#pragma GCC unroll 8
            for (int c = 0; c < nr; c++) acc[r][c] = vf_fmadd(xv, wv[c], acc[r][c]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 8
        for (int c = 0; c < nr; c++) out[r * ldo + c] = vf_reduce_add(acc[r][c]) + (bias ? bias[c] : 0.0f);
}
#endif

/* out [m, n] (rows ldo apart) = x [m, k] (rows ldx apart) @ w[n, k].T + bias. Meant for few rows
 * and a tall weight (an output head), where the GEMM libraries block poorly. Needs n % 8 == 0.
 * Tiles keep the accumulators in registers: 32 vector registers with AVX-512, 16 with AVX2.
 * Returns 0, or -1 where this build has no such kernel. */
int ip_f32_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *w, const float *bias, int64_t n,
                  float *out, int64_t ldo) {
#if IP_VECTOR
    const int64_t groups = n / 8;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t col = g * 8;
        const float *wg = w + col * k;
        const float *bg = bias ? bias + col : NULL;
        int64_t r = 0;
#if IP_AVX512
        for (; r + 8 <= m; r += 8)
            for (int c = 0; c < 8; c += 2)
                f32_tile(x + r * ldx, ldx, 8, wg + c * k, k, 2, bg ? bg + c : NULL, out + r * ldo + col + c, ldo);
#endif
        for (; r + 4 <= m; r += 4)
            for (int c = 0; c < 8; c += (IP_AVX512 ? 4 : 2))
                f32_tile(x + r * ldx, ldx, 4, wg + c * k, k, IP_AVX512 ? 4 : 2, bg ? bg + c : NULL,
                         out + r * ldo + col + c, ldo);
        if (r + 2 <= m) {
            for (int c = 0; c < 8; c += (IP_AVX512 ? 8 : 4))
                f32_tile(x + r * ldx, ldx, 2, wg + c * k, k, IP_AVX512 ? 8 : 4, bg ? bg + c : NULL,
                         out + r * ldo + col + c, ldo);
            r += 2;
        }
        if (r < m)
            for (int c = 0; c < 8; c += (IP_AVX512 ? 8 : 4))
                f32_tile(x + r * ldx, ldx, 1, wg + c * k, k, IP_AVX512 ? 8 : 4, bg ? bg + c : NULL,
                         out + r * ldo + col + c, ldo);
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)bias; (void)n; (void)out; (void)ldo;
    return -1;
#endif
}
