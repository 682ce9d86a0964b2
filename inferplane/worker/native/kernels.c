/* CPU kernels for the worker's decode step, called through ctypes (native/__init__.py).
 *
 * Two jobs that PyTorch's eager CPU ops do poorly at decode sizes:
 *  - ip_int8_linear: y = x @ W.T for int8 W, with each row of x quantized to int8 inside the call.
 *    The weight is stored once, at load time, in a layout the AVX-512 VNNI loop reads front to back
 *    (16 output channels x 4 inputs per 64-byte vector, shifted to uint8 by +128), so no call pays
 *    for a reorder; `torch._int_mm` reorders on every call and the row quantization alone took five
 *    eager ops.
 *  - ip_paged_decode_attention: one query token per sequence against its KV blocks read where they
 *    lie in the paged cache, so no gather copies the context first.
 *
 * Threads: OpenMP. PyTorch's wheel carries its own libgomp.so.1; loaded after torch, this library
 * binds to that same runtime, so it shares torch's thread pool and torch.set_num_threads().
 * Everything is float32 in and out; integer accumulation is exact, so ip_int8_linear returns what
 * `torch._int_mm` of the same quantized operands, scaled the same way, returns.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define IP_HAVE_VNNI 1
#define IP_HAVE_VNNI_INCLUDED 1
#include <immintrin.h>
#else
#define IP_HAVE_VNNI 0
#endif

#define IP_FEATURE_INT8_LINEAR 1

int ip_features(void) {
    return IP_HAVE_VNNI ? IP_FEATURE_INT8_LINEAR : 0;
}

/* ---------------------------------------------------------------- int8 linear */

#if IP_HAVE_VNNI

/* Row m of x -> int8 q[m, :] with scale[m] = max|x[m, :]| / 127 and comp[m] = 128 * sum(q[m, :]).
 * The division (not a multiply by the reciprocal) and round-half-even match quantize_rows in Python. */
static void quantize_row(const float *x, int64_t k, int8_t *q, float *scale, int32_t *comp) {
    __m512 amax = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    float m = _mm512_reduce_max_ps(amax);
    for (; i < k; i++) m = fmaxf(m, fabsf(x[i]));
    float s = fmaxf(m, 1e-12f) / 127.0f;
    __m512 sv = _mm512_set1_ps(s);
    __m512i sum = _mm512_setzero_si512();
    for (i = 0; i + 16 <= k; i += 16) {
        __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(x + i), sv));  /* nearest-even */
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128((__m128i *)(q + i), _mm512_cvtsepi32_epi8(v));
    }
    int32_t total = _mm512_reduce_add_epi32(sum);
    for (; i < k; i++) {
        int32_t v = (int32_t)nearbyintf(x[i] / s);
        q[i] = (int8_t)v;
        total += v;
    }
    *scale = s;
    *comp = 128 * total;
}

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
            __m512i xv = _mm512_set1_epi32(*(const int32_t *)(q + r * k + kk * 4));
#pragma GCC unroll 4
            for (int c = 0; c < nr; c++) acc[r][c] = _mm512_dpbusd_epi32(acc[r][c], wv[c], xv);
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < nr; c++) {
        __m512 sv = _mm512_loadu_ps(wscale + c * 16);
        __m512 bv = bias ? _mm512_loadu_ps(bias + c * 16) : _mm512_setzero_ps();
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

#endif /* IP_HAVE_VNNI */

/* x [m, k] float32 (rows ldx apart) -> out [m, n] float32 (rows ldo apart).
 * w: the packed weight (pack_int8_weight in Python), wscale [n] per-channel scales, bias [n] or NULL.
 * Needs k % 4 == 0 and n % 16 == 0. Returns 0, or -1 where this build has no such kernel. */
int ip_int8_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, const float *wscale,
                   const float *bias, int64_t n, float *out, int64_t ldo) {
#if IP_HAVE_VNNI
    int8_t *q = (int8_t *)malloc((size_t)(m * k + 64));
    float *xscale = (float *)malloc(sizeof(float) * (size_t)m);
    int32_t *xcomp = (int32_t *)malloc(sizeof(int32_t) * (size_t)m);
    if (!q || !xscale || !xcomp) {
        free(q); free(xscale); free(xcomp);
        return -2;
    }
    const int64_t blocks = n / 16;
    const int nr = (blocks % 4 == 0) ? 4 : 1;
    const int64_t groups = blocks / nr;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; i++) quantize_row(x + i * ldx, k, q + i * k, xscale + i, xcomp + i);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t col = g * nr * 16;
            int8_column_group(q, m, k, xscale, xcomp, w + col * k, wscale + col, bias ? bias + col : NULL, nr,
                              out + col, ldo);
        }
    }
    free(q); free(xscale); free(xcomp);
    return 0;
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)wscale; (void)bias; (void)n; (void)out; (void)ldo;
    return -1;
#endif
}

/* ---------------------------------------------------------------- paged decode attention */

#if defined(__x86_64__) && defined(__AVX512F__)
#define IP_HAVE_AVX512 1
#ifndef IP_HAVE_VNNI_INCLUDED
#include <immintrin.h>
#endif
#else
#define IP_HAVE_AVX512 0
#endif

/* s[t] <- exp(s[t] - top) for t < n; returns the sum. The AVX-512 path uses a Cephes-style
 * polynomial (about 1 ulp; libm's expf is scalar without -ffast-math, and the softmax was a third
 * of the kernel's time). */
static float exp_shifted(float *s, int64_t n, float top) {
    float total = 0.0f;
    int64_t t = 0;
#if IP_HAVE_AVX512
    const __m512 vtop = _mm512_set1_ps(top), lo = _mm512_set1_ps(-87.3f), log2e = _mm512_set1_ps(1.44269504f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f), ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __m512 sum = _mm512_setzero_ps();
    for (; t + 16 <= n; t += 16) {
        __m512 x = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), vtop), lo);
        __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        __m512 r = _mm512_fnmadd_ps(k, ln2_hi, x);
        r = _mm512_fnmadd_ps(k, ln2_lo, r);
        __m512 p = _mm512_set1_ps(1.9875691500e-4f);
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
        p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
        __m512 e = _mm512_scalef_ps(p, k);
        _mm512_storeu_ps(s + t, e);
        sum = _mm512_add_ps(sum, e);
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    return total;
}

static inline float dot(const float *a, const float *b, int64_t d) {
#if IP_HAVE_AVX512
    if (d % 16 == 0) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
        for (int64_t j = 16; j < d; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + j), _mm512_loadu_ps(b + j), acc);
        return _mm512_reduce_add_ps(acc);
    }
#endif
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < d; j++) total += a[j] * b[j];
    return total;
}

/* q [b, heads, d] (rows q_stride apart) attends to its sequence's first context_lens[i] tokens in
 * k_cache / v_cache [blocks, block_size, kv_heads, d], found through block_tables [b, max_blocks].
 * out [b, heads, d] (rows out_stride apart). Grouped-query: the heads / kv_heads query heads of a
 * KV head are done together, so each key and value is read once per group. Exact softmax in two
 * passes over a per-thread score buffer. */
int ip_paged_decode_attention(const float *q, int64_t q_stride, int64_t b, int64_t heads, int64_t kv_heads,
                              int64_t d, const float *k_cache, const float *v_cache, int64_t block_size,
                              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                              float scale, float *out, int64_t out_stride) {
    const int64_t group = heads / kv_heads;
    int64_t longest = 0;
    for (int64_t i = 0; i < b; i++) longest = context_lens[i] > longest ? context_lens[i] : longest;
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(group * longest + 1));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(group * d));
        if (!scores || !acc) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t task = 0; task < b * kv_heads; task++) {
            if (!scores || !acc) continue;
            const int64_t seq = task / kv_heads, kvh = task % kv_heads;
            const int64_t len = context_lens[seq];
            const int64_t *table = block_tables + seq * max_blocks;
            const float *qs = q + seq * q_stride + kvh * group * d;
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const float *key = k_cache + (slot * kv_heads + kvh) * d;
                for (int64_t g = 0; g < group; g++) scores[g * len + t] = dot(qs + g * d, key, d) * scale;
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * len;
                float top = -INFINITY;
                for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
                const float total = exp_shifted(s, len, top);
                const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * (size_t)(group * d));
            for (int64_t t = 0; t < len; t++) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                const float *value = v_cache + (slot * kv_heads + kvh) * d;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * len + t];
                    float *a = acc + g * d;
#pragma omp simd
                    for (int64_t j = 0; j < d; j++) a[j] += p * value[j];
                }
            }
            for (int64_t g = 0; g < group; g++)
                memcpy(out + seq * out_stride + (kvh * group + g) * d, acc + g * d, sizeof(float) * (size_t)d);
        }
        free(scores);
        free(acc);
    }
    return failed ? -2 : 0;
}
