/* int8 linear: y = x @ W.T for a per-channel int8 W packed once at load time (pack_int8_weight),
 * each row of x quantized to int8 inside the call (kernels.c says why and how on each ISA).
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"
#include "row_scratch.h"

#if IP_INT8

/* Row m of x -> int8 q[m, :] with scale[m] = max|x[m, :]| / 127 and comp[m] = 128 * sum(q[m, :]).
 * The division (not a multiply by the reciprocal) and round-half-even match quantize_rows in Python. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *scale, int32_t *comp) {
    vf amax = vf_zero();
    int64_t i = 0;
    for (; i + VF_WIDTH <= k; i += VF_WIDTH) amax = vf_max(amax, vf_abs(vf_load(x + i)));
    float m = vf_reduce_max(amax);
    for (; i < k; i++) m = fmaxf(m, fabsf(x[i]));
    const float s = fmaxf(m, 1e-12f) / 127.0f;
    const vf sv = vf_set1(s);
    int32_t total = 0;
    i = 0;
#if IP_AVX512
    __m512i sum = _mm512_setzero_si512();
    for (; i + 16 <= k; i += 16) {
        const __m512i v = vf_to_int(vf_div(vf_load(x + i), sv));
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
    total = _mm512_reduce_add_epi32(sum);
#else
    __m256i sum = _mm256_setzero_si256();
    for (; i + 8 <= k; i += 8) {
        const __m256i v = vf_to_int(vf_div(vf_load(x + i), sv));
        sum = _mm256_add_epi32(sum, v);
        const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        _mm_storel_epi64((__m128i *)(q + i), _mm_packs_epi16(halves, halves));
    }
    int32_t lanes[8];
    _mm256_storeu_si256((__m256i *)lanes, sum);
    for (int j = 0; j < 8; j++) total += lanes[j];
#endif
    for (; i < k; i++) {
        const int32_t v = (int32_t)nearbyintf(x[i] / s);
        q[i] = (int8_t)v;
        total += v;
    }
    *scale = s;
    *comp = 128 * total;
}

#if IP_AVX512
/* One tile: MR rows of x against NR blocks of 16 output channels. The weight blocks are consecutive
 * in the packed layout, each 16 * k bytes: [k / 4][16 channels][4 inputs], as uint8 (w + 128).
 * vpdpbusd multiplies unsigned by signed bytes; (w + 128) * q summed over k is w.q + comp[m]. */
static inline __attribute__((always_inline)) void int8_tile(
        const int8_t *q, int64_t k, const float *xscale, const int32_t *xcomp, int mr,
        const uint8_t *w, const float *wscale, const float *bias, int nr, float *out, int64_t ldo) {
    __m512i acc[16][4];
    const int64_t k4 = k / 4;
#pragma GCC unroll 16
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int c = 0; c < nr; c++) acc[r][c] = _mm512_setzero_si512();
    for (int64_t kk = 0; kk < k4; kk++) {
        __m512i wv[4];
#pragma GCC unroll 4
        for (int c = 0; c < nr; c++) wv[c] = _mm512_loadu_si512((const void *)(w + c * 16 * k + kk * 64));
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            const __m512i xv = _mm512_set1_epi32(load_i32(q + r * k + kk * 4));
#pragma GCC unroll 4
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < nr; c++) {
        const __m512 sv = _mm512_loadu_ps(wscale + c * 16);
        const __m512 bv = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
#pragma GCC unroll 16
        for (int r = 0; r < mr; r++) {
            __m512 y = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][c], _mm512_set1_epi32(xcomp[r])));
            y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_set1_ps(xscale[r])), sv);
            if (bias) y = _mm512_add_ps(y, bv);
            _mm512_storeu_ps(out + r * ldo + c * 16, y);
        }
    }
}

/* Rows [m0, m) of one column group (nr blocks): tiles of 16 rows one block at a time, then 8 rows
 * two blocks at a time, then 4/2/1 rows all nr blocks at a time (few rows: memory-bound, so more
 * weight streams in flight). */
static void int8_column_group(const int8_t *q, int64_t m, int64_t k, const float *xscale, const int32_t *xcomp,
                              const uint8_t *w, const float *wscale, const float *bias, int nr,
                              float *out, int64_t ldo) {
    int64_t r = 0;
    const int64_t wblock = 16 * k;
    for (; r + 16 <= m; r += 16)
        for (int c = 0; c < nr; c++)
            int8_tile(q + r * k, k, xscale + r, xcomp + r, 16, w + c * wblock, wscale + c * 16,
                      bias ? bias + c * 16 : NULL, 1, out + r * ldo + c * 16, ldo);
    if (r + 8 <= m) {
        for (int c = 0; c < nr; c += 2) {
            if (c + 2 <= nr)
                int8_tile(q + r * k, k, xscale + r, xcomp + r, 8, w + c * wblock, wscale + c * 16,
                          bias ? bias + c * 16 : NULL, 2, out + r * ldo + c * 16, ldo);
            else
                int8_tile(q + r * k, k, xscale + r, xcomp + r, 8, w + c * wblock, wscale + c * 16,
                          bias ? bias + c * 16 : NULL, 1, out + r * ldo + c * 16, ldo);
        }
        r += 8;
    }
#define IP_SMALL_TILE(MR)                                                                             \
    if (r + MR <= m) {                                                                                \
        if (nr == 4)                                                                                  \
            int8_tile(q + r * k, k, xscale + r, xcomp + r, MR, w, wscale, bias, 4, out + r * ldo, ldo); \
        else                                                                                          \
            for (int c = 0; c < nr; c++)                                                              \
                int8_tile(q + r * k, k, xscale + r, xcomp + r, MR, w + c * wblock, wscale + c * 16,   \
                          bias ? bias + c * 16 : NULL, 1, out + r * ldo + c * 16, ldo);               \
        r += MR;                                                                                      \
    }
    IP_SMALL_TILE(4)
    IP_SMALL_TILE(2)
    IP_SMALL_TILE(1)
#undef IP_SMALL_TILE
}

#else /* AVX2 */

/* One tile: MR rows of x against NB blocks of 16 output channels, each block read as two 32-byte
 * halves (channels 0-7, then 8-15, four inputs each) of the same packed layout as AVX-512's.
 * With AVX-VNNI, vpdpbusd as above (w + 128 unsigned, comp subtracted). Without it, the signed
 * weight w = (w + 128) ^ 0x80 is split into |w| (unsigned) and its sign, which moves onto x:
 * vpmaddubsw(|w|, sign(x, w)) = w * x summed in pairs, then vpmaddwd by 1 widens to int32. */
static inline __attribute__((always_inline)) void int8_tile(
        const int8_t *q, int64_t k, const float *xscale, const int32_t *xcomp, int mr,
        const uint8_t *w, const float *wscale, const float *bias, int nb, float *out, int64_t ldo) {
    __m256i acc[4][4];
    const int nv = 2 * nb;
    const int64_t k4 = k / 4;
#if !IP_AVX2_VNNI
    (void)xcomp; /* signed products need no correction */
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i flip = _mm256_set1_epi8((char)0x80);
#endif
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++)
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) acc[r][c] = _mm256_setzero_si256();
    for (int64_t kk = 0; kk < k4; kk++) {
        __m256i wv[4];
#if !IP_AVX2_VNNI
        __m256i aw[4];
#endif
#pragma GCC unroll 4
        for (int c = 0; c < nv; c++) {
            wv[c] = _mm256_loadu_si256((const __m256i *)(w + (c / 2) * 16 * k + kk * 64 + (c % 2) * 32));
#if !IP_AVX2_VNNI
            wv[c] = _mm256_xor_si256(wv[c], flip);
            aw[c] = _mm256_abs_epi8(wv[c]);
#endif
        }
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const __m256i xv = _mm256_set1_epi32(load_i32(q + r * k + kk * 4));
#pragma GCC unroll 4
            for (int c = 0; c < nv; c++) {
#if IP_AVX2_VNNI
                acc[r][c] = avx_dpbusd(acc[r][c], wv[c], xv);
#else
                const __m256i pairs = _mm256_maddubs_epi16(aw[c], _mm256_sign_epi8(xv, wv[c]));
                acc[r][c] = _mm256_add_epi32(acc[r][c], _mm256_madd_epi16(pairs, ones));
#endif
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < nv; c++) {
        const __m256 sv = _mm256_loadu_ps(wscale + c * 8);
        const __m256 bv = bias ? _mm256_loadu_ps(bias + c * 8) : _mm256_setzero_ps();
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
#if IP_AVX2_VNNI
            const __m256i exact = _mm256_sub_epi32(acc[r][c], _mm256_set1_epi32(xcomp[r]));
#else
            const __m256i exact = acc[r][c];
#endif
            __m256 y = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(exact), _mm256_set1_ps(xscale[r])), sv);
            if (bias) y = _mm256_add_ps(y, bv);
            _mm256_storeu_ps(out + r * ldo + c * 8, y);
        }
    }
}

/* Rows of one column group (nr blocks): four rows one block at a time (16 accumulators of the 16
 * registers AVX2 has would spill), then two, then a last row two blocks at a time. */
static void int8_column_group(const int8_t *q, int64_t m, int64_t k, const float *xscale, const int32_t *xcomp,
                              const uint8_t *w, const float *wscale, const float *bias, int nr,
                              float *out, int64_t ldo) {
    const int64_t wblock = 16 * k;
    int64_t r = 0;
#define IP_ROWS_ONE_BLOCK(MR)                                                                       \
    for (; r + MR <= m; r += MR)                                                                    \
        for (int c = 0; c < nr; c++)                                                                \
            int8_tile(q + r * k, k, xscale + r, xcomp + r, MR, w + c * wblock, wscale + c * 16,     \
                      bias ? bias + c * 16 : NULL, 1, out + r * ldo + c * 16, ldo);
    IP_ROWS_ONE_BLOCK(4)
    IP_ROWS_ONE_BLOCK(2)
#undef IP_ROWS_ONE_BLOCK
    if (r < m)
        for (int c = 0; c < nr; c += 2) {
            if (c + 2 <= nr)
                int8_tile(q + r * k, k, xscale + r, xcomp + r, 1, w + c * wblock, wscale + c * 16,
                          bias ? bias + c * 16 : NULL, 2, out + r * ldo + c * 16, ldo);
            else
                int8_tile(q + r * k, k, xscale + r, xcomp + r, 1, w + c * wblock, wscale + c * 16,
                          bias ? bias + c * 16 : NULL, 1, out + r * ldo + c * 16, ldo);
        }
}

#endif /* AVX-512 or AVX2 */
#endif /* IP_INT8 */

/* x [m, k] float32 (rows ldx apart) -> out [m, n] float32 (rows ldo apart).
 * w: the packed weight (pack_int8_weight in Python), wscale [n] per-channel scales, bias [n] or NULL.
 * Needs k % 4 == 0 and n % 16 == 0. Returns 0, or -1 where this build has no such kernel. */
int ip_int8_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, const float *wscale,
                   const float *bias, int64_t n, float *out, int64_t ldo) {
#if IP_INT8
    const int few = m <= FEW_ROWS; /* as the block kernel: each thread quantizes the rows itself */
    int8_t *q = NULL;
    float *xscale = NULL;
    int32_t *xcomp = NULL;
    if (!few) {
        q = (int8_t *)malloc((size_t)(m * k + 64));
        xscale = (float *)malloc(sizeof(float) * (size_t)m);
        xcomp = (int32_t *)malloc(sizeof(int32_t) * (size_t)m);
        if (!q || !xscale || !xcomp) {
            free(q); free(xscale); free(xcomp);
            return -2;
        }
    }
    const int64_t blocks = n / 16;
    const int nr = (blocks % 4 == 0) ? 4 : 1;
    const int64_t groups = blocks / nr;
    int failed = 0;
#pragma omp parallel
    {
        const int8_t *tq = q;
        const float *tscale = xscale;
        const int32_t *tcomp = xcomp;
        row_scratch *own = few ? own_rows(m, k, &failed) : NULL;
        const int ready = !few || own;
        if (own) {
            for (int64_t i = 0; i < m; i++) quantize_row(x + i * ldx, k, own->q + i * k, own->scale + i, own->sums + i);
            tq = own->q, tscale = own->scale, tcomp = own->sums;
        } else if (!few) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) quantize_row(x + i * ldx, k, q + i * k, xscale + i, xcomp + i);
        }
#pragma omp for schedule(static) nowait
        for (int64_t g = 0; g < groups; g++) {
            if (!ready) continue;
            const int64_t col = g * nr * 16;
            int8_column_group(tq, m, k, tscale, tcomp, w + col * k, wscale + col, bias ? bias + col : NULL, nr,
                              out + col, ldo);
        }
    }
    free(q); free(xscale); free(xcomp);
    return failed ? -2 : 0;
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)wscale; (void)bias; (void)n; (void)out; (void)ldo;
    return -1;
#endif
}

/* The packed weight back to float32 out [n, k], row-major: out[i, j] = (w[i, j] - 128) * wscale[i]. Where
 * a CPU's float32 GEMM beats ip_int8_linear for many rows (prefill; measured at start-up), the
 * layer multiplies by this instead: writing n * k floats costs far less than such a product. */
void ip_int8_dequantize(const uint8_t *w, int64_t n, int64_t k, const float *wscale, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *block = w + (i / 16) * 16 * k + (i % 16) * 4;
        const float s = wscale[i];
        float *o = out + i * k;
        for (int64_t kk = 0; kk < k / 4; kk++)
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) o[kk * 4 + j] = (float)((int)block[kk * 64 + j] - 128) * s;
    }
}
