/* CPU kernels for the worker's decode step, called through ctypes (native/bindings.py).
 *
 * Two jobs that PyTorch's eager CPU ops do poorly at decode sizes:
 *  - ip_int8_linear: y = x @ W.T for int8 W, with each row of x quantized to int8 inside the call.
 *    The weight is stored once, at load time, in one layout every ISA reads front to back (16 output
 *    channels x 4 inputs per 64-byte block, shifted to uint8 by +128), so no call pays for a
 *    reorder; `torch._int_mm` reorders on every call and the row quantization alone took five eager
 *    ops (and on CPUs without VNNI it ran 10x slower than float32).
 *  - ip_paged_decode_attention: one query token per sequence against its KV blocks read where they
 *    lie in the paged cache, so no gather copies the context first.
 *
 * One source, built once per instruction set (native/build.py picks the best the CPU has, or the
 * one INFERPLANE_NATIVE_ISA names):
 *  - avx512-vnni (-march=x86-64-v4 -mavx512vnni): 16 floats a vector, vpdpbusd for int8.
 *  - avx2-vnni (-march=x86-64-v3 -mavxvnni): 8 floats a vector, the 256-bit vpdpbusd.
 *  - avx2 (-march=x86-64-v3: AVX2 + FMA, as on AMD Zen 2/3 and older Intel): 8 floats a vector;
 *    int8 products by vpmaddubsw/vpmaddwd with the sign moved onto the input (|w| * sign(x, w)),
 *    which keeps every pair sum within int16 (2 * 128 * 127 < 32768), so no product saturates.
 * The float kernels are written once over a small vector layer (vf_*) that each ISA defines.
 *
 * Threads: OpenMP. PyTorch's wheel carries its own libgomp.so.1; loaded after torch, this library
 * binds to that same runtime, so it shares torch's thread pool and torch.set_num_threads().
 * Everything is float32 in and out; integer accumulation is exact, so ip_int8_linear returns what
 * `torch._int_mm` of the same quantized operands, scaled the same way, returns, on every ISA.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#include <pthread.h>

#if defined(__x86_64__) && (defined(__AVX512F__) || defined(__AVX2__))
#include <immintrin.h>
#endif

#if defined(__x86_64__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define IP_AVX512 1
#define IP_AVX2 0
#elif defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
#define IP_AVX512 0
#define IP_AVX2 1
#else
#define IP_AVX512 0
#define IP_AVX2 0
#endif
#define IP_VECTOR (IP_AVX512 || IP_AVX2)

#if IP_AVX512 && defined(__AVX512VNNI__)
#define IP_INT8 1
#elif IP_AVX2
#define IP_INT8 1
#else
#define IP_INT8 0
#endif

/* IP_EMULATE_AVX_VNNI (a test build, native/build.py EMULATED_BUILDS): the AVX-VNNI code on a CPU
 * without AVX-VNNI, its one new instruction done by exact AVX2 operations (avx_dpbusd below). Why:
 * the machines this project is built and tested on have AVX-512 VNNI or plain AVX2, and QEMU 7.2
 * does not emulate the VEX vpdpbusd, so without it the AVX-VNNI build's tiles (the unsigned weight
 * with its correction, the 4-bit high nibbles multiplied in place) never ran anywhere. */
#if IP_AVX2 && (defined(__AVXVNNI__) || defined(IP_EMULATE_AVX_VNNI))
#define IP_AVX2_VNNI 1
#else
#define IP_AVX2_VNNI 0
#endif

#if IP_AVX2_VNNI
/* vpdpbusd: acc + the sum of each 32-bit lane's four unsigned-by-signed byte products, wrapping.
 * Emulated: even and odd bytes widened to 16 bits (zero- and sign-extended) and multiplied in pairs
 * by vpmaddwd, whose sums of two products (at most 2 * 255 * 128) are exact in 32 bits. */
static inline __m256i avx_dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    const __m256i u_even = _mm256_and_si256(u, _mm256_set1_epi16(0x00FF)), u_odd = _mm256_srli_epi16(u, 8);
    const __m256i s_even = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), s_odd = _mm256_srai_epi16(s, 8);
    const __m256i even = _mm256_madd_epi16(u_even, s_even), odd = _mm256_madd_epi16(u_odd, s_odd);
    return _mm256_add_epi32(acc, _mm256_add_epi32(even, odd));
#endif
}
#endif

/* ---------------------------------------------------------------- the float vector layer */

#if IP_AVX512
typedef __m512 vf;
typedef __m512i vi;
#define VF_WIDTH 16
static inline vf vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm512_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm512_loadu_ps(p); }
/* the first n (< VF_WIDTH) floats at p, zeros after them; reads nothing past p + n */
static inline vf vf_load_tail(const float *p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
static inline void vf_store(float *p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm512_abs_ps(a); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }   /* a * b + c */
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline vf vf_round(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vf_scale2(vf p, vf k) { return _mm512_scalef_ps(p, k); } /* p * 2^k, k integral */
static inline float vf_reduce_add(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vf_reduce_max(vf a) { return _mm512_reduce_max_ps(a); }
static inline vi vf_to_int(vf a) { return _mm512_cvtps_epi32(a); } /* round half to even */
#elif IP_AVX2
typedef __m256 vf;
typedef __m256i vi;
#define VF_WIDTH 8
static inline vf vf_zero(void) { return _mm256_setzero_ps(); }
static inline vf vf_set1(float a) { return _mm256_set1_ps(a); }
static inline vf vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vf vf_load_tail(const float *p, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), lanes));
}
static inline void vf_store(float *p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
static inline vf vf_fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
static inline vf vf_round(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* k within [-126, 127] here (exp clamps its input), so 2^k is a normal float built from its bits */
static inline vf vf_scale2(vf p, vf k) {
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
static inline float vf_reduce_add(vf a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float vf_reduce_max(vf a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline vi vf_to_int(vf a) { return _mm256_cvtps_epi32(a); }
#endif

#if IP_VECTOR
/* exp of a vector: Cephes-style range reduction and polynomial, about 1 ulp. libm's expf is scalar
 * without -ffast-math (which this file avoids: it would also change the quantization's rounding). */
static inline vf vf_exp(vf x) {
    x = vf_min(vf_max(x, vf_set1(-87.3f)), vf_set1(88.3f));
    const vf k = vf_round(vf_mul(x, vf_set1(1.44269504f)));
    vf r = vf_fnmadd(k, vf_set1(0.693359375f), x);
    r = vf_fnmadd(k, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    p = vf_fmadd(p, vf_mul(r, r), vf_add(r, vf_set1(1.0f)));
    return vf_scale2(p, k);
}
#endif

#define IP_FEATURE_INT8_LINEAR 1

/* ---------------------------------------------------------------- int8 linear */

#if IP_INT8

static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

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

/* Up to this many rows, the int8 and block kernels have every thread quantize all of them itself,
 * into its own scratch (below), so the matmul starts without waiting at a barrier for one thread's
 * quantize, and nothing is allocated per call. Why: a batch-1 decode step makes about 120 such calls,
 * each reading only 0.1-0.6 MB per thread; on cache-resident SmolLM2 linears this took a call from
 * 5.47 to 5.16 us. */
#define FEW_ROWS 4

#if IP_INT8
/* A thread's quantized rows, kept between calls (grown as needed, freed when the thread ends): the
 * values q [m, k], and per block of 32 inputs the block kernel's dx and sx (`scale`, `sum`) and two
 * half-block sums (`sums`); the int8 kernel keeps a row's scale in `scale` and its correction in
 * `sums`. */
typedef struct {
    int8_t *q;
    float *scale, *sum;
    int32_t *sums;
    int64_t values; /* room for m * k */
} row_scratch;
static pthread_key_t scratch_key;
static pthread_once_t scratch_key_once = PTHREAD_ONCE_INIT;

static void free_scratch(void *p) {
    row_scratch *s = (row_scratch *)p;
    free(s->q); free(s->scale); free(s->sum); free(s->sums); free(s);
}
static void make_scratch_key(void) { pthread_key_create(&scratch_key, free_scratch); }

/* This thread's scratch with room for m rows of k inputs (at least one block of 32 per row), or NULL
 * when out of memory. */
static row_scratch *thread_scratch(int64_t m, int64_t k) {
    pthread_once(&scratch_key_once, make_scratch_key);
    row_scratch *s = (row_scratch *)pthread_getspecific(scratch_key);
    if (!s) {
        s = (row_scratch *)calloc(1, sizeof(row_scratch));
        if (!s || pthread_setspecific(scratch_key, s) != 0) {
            free(s);
            return NULL;
        }
    }
    const int64_t values = m * (k < 32 ? 32 : k);
    if (values <= s->values) return s;
    free(s->q); free(s->scale); free(s->sum); free(s->sums);
    s->q = (int8_t *)malloc((size_t)(values + 64));
    s->scale = (float *)malloc(sizeof(float) * (size_t)(values / 32));
    s->sum = (float *)malloc(sizeof(float) * (size_t)(values / 32));
    s->sums = (int32_t *)malloc(sizeof(int32_t) * (size_t)(values / 16));
    s->values = (s->q && s->scale && s->sum && s->sums) ? values : 0;
    return s->values ? s : NULL;
}

/* Inside a kernel's parallel region: this thread's scratch for m rows of k, or NULL with *failed set
 * (the call then returns -2). */
static row_scratch *own_rows(int64_t m, int64_t k, int *failed) {
    row_scratch *own = thread_scratch(m, k);
    if (!own) {
#pragma omp atomic write
        *failed = 1;
    }
    return own;
}
#endif

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

/* ---------------------------------------------------------------- block linear (GGUF's own blocks) */

/* A GGUF weight in blocks of 32 inputs per output row, each a float16 scale d, a float16 minimum m
 * and 32 unsigned `bits`-bit values q: w = d * q + m. Bits 4 is GGUF's Q4_1 (and Q4_0, Q4_K exactly
 * or nearly turned into it, quant/gguf_blocks.py), bits 5 its Q5_1 (and Q5_0, Q5_K), bits 8 its Q8_0:
q + 128 with m = -128 d, which the kernel derives from d instead of reading it (1.0625 bytes a
weight, as the file; a fused group's Q4_0 and Q5_0 members move their values up the same way). The
input row
 * is quantized the same way llama.cpp does for this product (Q8_1): per block of 32, int8 values
 * with a scale dx and their scaled sum sx. Then
 *   sum_j w_j x_j = d * dx * sum_j q_j xq_j + m * sx,
 * an unsigned-by-signed byte dot product (vpdpbusd, or vpmaddubsw + vpmaddwd on plain AVX2: at most
 * 2 * 31 * 127 per pair, so nothing saturates; 8-bit values, up to 2 * 255 * 127 a pair, would, so
 * plain AVX2 takes them back to signed q and multiplies |q| by x with q's sign, as the int8 kernel
 * does, which sums d * dx * sum_j q_j xq_j with no minimum term), one float FMA per block and one
 * scalar FMA.
 *
 * Bits 6 is GGUF's Q6_K as the file has it: 6-bit values q, per half-block of 16 an int8 scale sc
 * and per row of a super-block of 256 a float16 d, w = d * sc * (q - 32). With s16 the sum of the
 * quantized inputs over a half-block,
 *   sum_j w_j x_j = d * sc * dx * (sum_j q_j xq_j - 32 * s16),
 * one float FMA per half-block (a pair is at most 2 * 63 * 127 = 16002: vpmaddubsw does not
 * saturate, and plain AVX2 widens every pair). */

#define IP_FEATURE_BLOCK_LINEAR 4
#define QB_BLOCK 32
/* The repacked layout: one 16-channel group's block of 32 inputs, the low nibbles, for 5 bits the
 * plane of fifth bits and for 6 two planes of the top two, then d and m (6 bits: sc and d); 8 bits:
 * the bytes themselves, then d alone. */
#define QB_VALUES_BYTES(bits) ((bits) == 8 ? 512 : (bits) == 6 ? 256 + 128 : (bits) == 5 ? 256 + 64 : 256)
#define QB_GROUP_BYTES(bits) (QB_VALUES_BYTES(bits) + ((bits) == 8 ? 32 : 64))
#define QB_Q8_MIN (-128.0f) /* 8 bits: m = -128 d */
#define QB_HIGH_AT 256
#define QB_SCALES_AT(bits) QB_VALUES_BYTES(bits)
#define QB_KNOWN_BITS(bits) ((bits) == 4 || (bits) == 5 || (bits) == 6 || (bits) == 8)

#if IP_INT8

/* Row x [k] -> q [k] int8 and, per block of 32, dx = max|x| / 127 and sx = dx * sum(q). */
static void quantize_row_blocks(const float *x, int64_t k, int8_t *q, float *dx, float *sx) {
    for (int64_t b = 0; b < k / QB_BLOCK; b++) {
        const float *xb = x + b * QB_BLOCK;
        vf amax = vf_zero();
#pragma GCC unroll 4
        for (int i = 0; i < QB_BLOCK; i += VF_WIDTH) amax = vf_max(amax, vf_abs(vf_load(xb + i)));
        const float d = vf_reduce_max(amax) / 127.0f;
        const vf inv = vf_set1(d > 0.0f ? 1.0f / d : 0.0f);
        int8_t *qb = q + b * QB_BLOCK;
        int32_t total = 0;
#if IP_AVX512
        for (int i = 0; i < QB_BLOCK; i += 16) {
            const __m512i v = vf_to_int(vf_mul(vf_load(xb + i), inv));
            total += _mm512_reduce_add_epi32(v);
            _mm_storeu_si128((__m128i *)(qb + i), _mm512_cvtsepi32_epi8(v));
        }
#else
        for (int i = 0; i < QB_BLOCK; i += 8) {
            const __m256i v = vf_to_int(vf_mul(vf_load(xb + i), inv));
            const __m128i halves = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            const __m128i bytes = _mm_packs_epi16(halves, halves);
            _mm_storel_epi64((__m128i *)(qb + i), bytes);
            const __m128i pair = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            const __m128i quad = _mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0x4E));
            total += _mm_cvtsi128_si32(_mm_add_epi32(quad, _mm_shuffle_epi32(quad, 0xB1)));
        }
#endif
        dx[b] = d;
        sx[b] = d * (float)total;
    }
}

/* The repacked layout (pack_blocks in Python), per group of 16 output channels and block b of 32 inputs:
 *   nibbles: 4 chunks of 64 bytes; byte i of chunk p holds the low 4 bits of value i of input step 2p
 *            in its low nibble and of step 2p + 1 in its high one, where a step is 4 inputs and
 *            value i = channel i / 4, input i % 4 (the int8 kernel's 16 x 4 order);
 *   fifth bits (5 bits only): 64 bytes; bit s of byte i is bit 4 of value i of step s;
 *   top bits (6 bits only): 2 planes of 64 bytes; bits 2t, 2t + 1 of byte i of plane h are bits 4
 *            and 5 of value i of step 4h + t;
 *   bytes (8 bits only, instead of all the above): 8 chunks of 64 bytes, byte i of chunk s value i of
 *            step s;
 *   d, m:    16 float16 scales, then 16 float16 minimums; for 6 bits instead 16 int8 sc of the first
 *            half-block, 16 of the second, then the 16 rows' float16 d; for 8 bits the 16 d alone.
 * So one vector op covers 8 (AVX2) or 16 (AVX-512) channels x 4 inputs, the scale is applied once
 * per block and channel vector, and 0.625 (4 bits), 0.75 (5 bits) or 1.0625 (8 bits) bytes a weight
 * are read. */

#if IP_AVX512
typedef __m512i vq;
#define Q4_LANES 16
static inline vq vq_load(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline vq vq_low4(vq v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
static inline vq vq_high4(vq v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
static inline vq vq_set1(int32_t a) { return _mm512_set1_epi32(a); }
static inline vq vq_zero(void) { return _mm512_setzero_si512(); }
static inline vq vq_or(vq a, vq b) { return _mm512_or_si512(a, b); }
static inline vq vq_sub(vq a, vq b) { return _mm512_sub_epi32(a, b); }
static inline vq vq_add(vq a, vq b) { return _mm512_add_epi32(a, b); }
static inline vf vf_load_i8(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline vq vq_shl16(vq v, int n) { return _mm512_slli_epi16(v, n); }
static inline vq vq_shr16(vq v, int n) { return _mm512_srli_epi16(v, n); }
static inline vq vq_and8(vq v, int mask) { return _mm512_and_si512(v, _mm512_set1_epi8((char)mask)); }
static inline vq vq_dot(vq acc, vq u, vq s) { return _mm512_dpbusd_epi32(acc, u, s); }
static inline vf vq_to_float(vq v) { return _mm512_cvtepi32_ps(v); }
static inline vq vq_sra32(vq v, int n) { return _mm512_srai_epi32(v, n); }
static inline vf vf_load_half(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
typedef __m256i vq;
#define Q4_LANES 8
static inline vq vq_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vq vq_low4(vq v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
static inline vq vq_high4(vq v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
static inline vq vq_set1(int32_t a) { return _mm256_set1_epi32(a); }
static inline vq vq_zero(void) { return _mm256_setzero_si256(); }
static inline vq vq_or(vq a, vq b) { return _mm256_or_si256(a, b); }
static inline vq vq_sub(vq a, vq b) { return _mm256_sub_epi32(a, b); }
static inline vq vq_add(vq a, vq b) { return _mm256_add_epi32(a, b); }
static inline vf vf_load_i8(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline vq vq_shl16(vq v, int n) { return _mm256_slli_epi16(v, n); }
static inline vq vq_shr16(vq v, int n) { return _mm256_srli_epi16(v, n); }
static inline vq vq_and8(vq v, int mask) { return _mm256_and_si256(v, _mm256_set1_epi8((char)mask)); }
static inline vq vq_dot(vq acc, vq u, vq s) {
#if IP_AVX2_VNNI
    return avx_dpbusd(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
static inline vf vq_to_float(vq v) { return _mm256_cvtepi32_ps(v); }
static inline vq vq_sra32(vq v, int n) { return _mm256_srai_epi32(v, n); }
static inline vf vf_load_half(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#endif

/* Bits from `from` up of every byte moved to bit 4 and masked: the fifth bit of a 5-bit value (mask
 * 0x10) or the top two of a 6-bit one (0x30). 16-bit shifts by at most 4 keep the bits that the
 * mask keeps within their own byte. */
static inline vq vq_bits_at4(vq v, int from, int mask) {
    return vq_and8(from < 4 ? vq_shl16(v, 4 - from) : vq_shr16(v, from - 4), mask);
}

/* Plain AVX2 sums vpmaddubsw pairs in int16 and widens them every few steps: a pair is at most
 * 2 * 15 * 127 = 3810 for 4-bit values, so a whole block's eight fit (30480 < 32768); for 5-bit ones
 * 2 * 31 * 127 = 7874, so four (31496) are widened at a time. 8-bit values are signed again there
 * (q = u ^ 0x80) and each pair, |q| * sign(x, q) at most 2 * 128 * 127 = 32512, widened at once. */
#if IP_AVX512 || IP_AVX2_VNNI
#define QB_INT16_SUMS 0
#else
#define QB_INT16_SUMS 1
#endif

/* Integer accumulators per row: with few rows, one chain of dependent vpdpbusd per row would make
 * the loop wait on their latency (batch-1 decode ran at a third of the memory bandwidth), so each
 * row spreads its steps over several independent chains, summed once per block. */
#define QB_CHAINS(mr) ((mr) == 1 ? 4 : (mr) == 2 ? 2 : 1)

/* The tile's MR rows of vector c's channels into out: each row's accumulator plus the bias (or
 * nothing). */
static inline __attribute__((always_inline)) void store_tile(const vf *facc, int mr, const float *bias, int c,
                                                             float *out, int64_t ldo) {
    const vf bv = bias ? vf_load(bias + c * Q4_LANES) : vf_zero();
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) vf_store(out + r * ldo + c * Q4_LANES, vf_add(facc[r], bv));
}

/* Q4_LANES channels (vector `c` of a 16-channel group) for MR quantized input rows; `bits` 4, 5 or 8
 * (a constant where inlined, so each case compiles to its own loop). */
static inline __attribute__((always_inline)) void qb_tile(
        const int8_t *q, const float *dx, const float *sx, int64_t k, int mr, const uint8_t *group, int c,
        const int bits, const float *bias, float *out, int64_t ldo) {
    const int64_t nb = k / QB_BLOCK;
    const int64_t group_bytes = QB_GROUP_BYTES(bits);
    const int scales_at = QB_SCALES_AT(bits);
    const int chains = QB_CHAINS(mr);
    vf facc[4];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) facc[r] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * group_bytes;
        vq iacc[4], total[4];
#if QB_INT16_SUMS
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) total[r] = vq_zero();
#endif
#pragma GCC unroll 4
        for (int a = 0; a < mr * chains; a++) iacc[a] = vq_zero();
        const vq high = bits == 5 ? vq_load(blk + QB_HIGH_AT + c * (Q4_LANES * 4)) : vq_zero();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            vq w0, w1;
            if (bits == 8) {
                w0 = vq_load(blk + 2 * p * 64 + c * (Q4_LANES * 4));
                w1 = vq_load(blk + (2 * p + 1) * 64 + c * (Q4_LANES * 4));
            } else {
                const vq raw = vq_load(blk + p * 64 + c * (Q4_LANES * 4));
                w0 = vq_low4(raw);
                w1 = vq_high4(raw);
            }
            if (bits == 5) {
                w0 = vq_or(w0, vq_bits_at4(high, 2 * p, 0x10));
                w1 = vq_or(w1, vq_bits_at4(high, 2 * p + 1, 0x10));
            }
#if QB_INT16_SUMS
            vq a0 = w0, a1 = w1;
            if (bits == 8) { /* the signed q in w0, w1 and |q| in a0, a1 */
                w0 = _mm256_xor_si256(w0, _mm256_set1_epi8((char)0x80));
                w1 = _mm256_xor_si256(w1, _mm256_set1_epi8((char)0x80));
                a0 = _mm256_abs_epi8(w0);
                a1 = _mm256_abs_epi8(w1);
            }
#endif
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = q + r * k + b * QB_BLOCK + p * 8;
                const int a = r * chains + p % chains;
                const vq x0 = vq_set1(load_i32(xr)), x1 = vq_set1(load_i32(xr + 4));
#if QB_INT16_SUMS
                if (bits == 8) { /* |q| times x with q's sign, each pair widened (int32 sums) */
                    iacc[a] = vq_add(iacc[a], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(x0, w0)),
                                                                _mm256_set1_epi16(1)));
                    iacc[a] = vq_add(iacc[a], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(x1, w1)),
                                                                _mm256_set1_epi16(1)));
                } else {
                    iacc[a] = _mm256_add_epi16(iacc[a], _mm256_maddubs_epi16(w0, x0));
                    iacc[a] = _mm256_add_epi16(iacc[a], _mm256_maddubs_epi16(w1, x1));
                }
#else
                iacc[a] = vq_dot(iacc[a], w0, x0);
                iacc[a] = vq_dot(iacc[a], w1, x1);
#endif
            }
#if QB_INT16_SUMS
            if (bits != 8 && (p == 3 || (bits == 5 && p == 1))) { /* each chain widened before its int16 sums can wrap */
#pragma GCC unroll 4
                for (int a = 0; a < mr * chains; a++) {
                    total[a / chains] = vq_add(total[a / chains], _mm256_madd_epi16(iacc[a], _mm256_set1_epi16(1)));
                    iacc[a] = vq_zero();
                }
            }
#endif
        }
        if (!QB_INT16_SUMS || bits == 8) { /* int32 chains: summed once per block */
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                total[r] = iacc[r * chains];
#pragma GCC unroll 4
                for (int j = 1; j < chains; j++) total[r] = vq_add(total[r], iacc[r * chains + j]);
            }
        }
        const vf dv = vf_load_half(blk + scales_at + c * Q4_LANES * 2);
        if (bits == 8 && QB_INT16_SUMS) { /* plain AVX2 summed the signed q: no minimum term */
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++)
                facc[r] = vf_fmadd(vq_to_float(total[r]), vf_mul(dv, vf_set1(dx[r * nb + b])), facc[r]);
            continue;
        }
        const vf mv = bits == 8 ? vf_mul(dv, vf_set1(QB_Q8_MIN)) : vf_load_half(blk + scales_at + 32 + c * Q4_LANES * 2);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) { /* the block's sum first: one add on the accumulator's chain */
            const vf block = vf_fmadd(vq_to_float(total[r]), vf_mul(dv, vf_set1(dx[r * nb + b])),
                                      vf_mul(mv, vf_set1(sx[r * nb + b])));
            facc[r] = vf_add(facc[r], block);
        }
    }
    store_tile(facc, mr, bias, c, out, ldo);
}

#if !QB_INT16_SUMS
/* Q4_LANES channels of 4-bit blocks for MR quantized input rows, where byte products sum in int32
 * (vpdpbusd). Each high nibble is multiplied where it lies, as 16 times its value (the byte masked
 * with 0xF0; 240 * 127 * 4 a lane fits), into its own accumulator, which is divided by 16 once per
 * block (exact: every product is a multiple of 16). Why: at batch 1 the kernel's arithmetic is
 * not far above the memory's pace (cache-resident SmolLM2 linears ran at about 115 GB/s against a
 * DRAM read of 60-65 GB/s on this project's EPYC), and the shift each high nibble took was one of
 * the loop's five vector operations per 64 bytes besides the dot products: one row of a 3072 x 576
 * weight took 6% less time (4 and 16 rows: unchanged). The low and high sums are each row's two
 * independent chains. The integer total is qb_tile's, so the result is the same bits. */
static inline __attribute__((always_inline)) void q4_tile(
        const int8_t *q, const float *dx, const float *sx, int64_t k, int mr, const uint8_t *group, int c,
        const float *bias, float *out, int64_t ldo) {
    const int64_t nb = k / QB_BLOCK;
    const int64_t group_bytes = QB_GROUP_BYTES(4);
    vf facc[4];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) facc[r] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * group_bytes;
        vq low[4], high[4];
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) low[r] = high[r] = vq_zero();
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) {
            const vq raw = vq_load(blk + p * 64 + c * (Q4_LANES * 4));
            const vq w0 = vq_and8(raw, 0x0F), w1 = vq_and8(raw, 0xF0);
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const int8_t *xr = q + r * k + b * QB_BLOCK + p * 8;
                low[r] = vq_dot(low[r], w0, vq_set1(load_i32(xr)));
                high[r] = vq_dot(high[r], w1, vq_set1(load_i32(xr + 4)));
            }
        }
        const vf dv = vf_load_half(blk + QB_SCALES_AT(4) + c * Q4_LANES * 2);
        const vf mv = vf_load_half(blk + QB_SCALES_AT(4) + 32 + c * Q4_LANES * 2);
#pragma GCC unroll 4
        for (int r = 0; r < mr; r++) {
            const vq total = vq_add(low[r], vq_sra32(high[r], 4));
            const vf block = vf_fmadd(vq_to_float(total), vf_mul(dv, vf_set1(dx[r * nb + b])),
                                      vf_mul(mv, vf_set1(sx[r * nb + b])));
            facc[r] = vf_add(facc[r], block);
        }
    }
    store_tile(facc, mr, bias, c, out, ldo);
}
#endif

/* Q4_LANES channels of 6-bit blocks (Q6_K's) for MR quantized input rows; s16 [mr, k / 16] the
 * rows' sums per half-block. */
static inline __attribute__((always_inline)) void q6_tile(
        const int8_t *q, const float *dx, const int32_t *s16, int64_t k, int mr, const uint8_t *group, int c,
        const float *bias, float *out, int64_t ldo) {
    const int64_t nb = k / QB_BLOCK;
    const int64_t group_bytes = QB_GROUP_BYTES(6);
    vf facc[4];
#pragma GCC unroll 4
    for (int r = 0; r < mr; r++) facc[r] = vf_zero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = group + b * group_bytes;
        const vf dv = vf_load_half(blk + QB_SCALES_AT(6) + 32 + c * Q4_LANES * 2);
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const vq top = vq_load(blk + QB_HIGH_AT + h * 64 + c * (Q4_LANES * 4));
            const int chains = mr <= 2 ? 2 : 1;
            vq iacc[4];
#pragma GCC unroll 4
            for (int a = 0; a < mr * chains; a++) iacc[a] = vq_zero();
#pragma GCC unroll 2
            for (int p = 2 * h; p < 2 * h + 2; p++) {
                const vq raw = vq_load(blk + p * 64 + c * (Q4_LANES * 4));
                const vq w0 = vq_or(vq_low4(raw), vq_bits_at4(top, 2 * (2 * p - 4 * h), 0x30));
                const vq w1 = vq_or(vq_high4(raw), vq_bits_at4(top, 2 * (2 * p + 1 - 4 * h), 0x30));
#pragma GCC unroll 4
                for (int r = 0; r < mr; r++) {
                    const int8_t *xr = q + r * k + b * QB_BLOCK + p * 8;
                    const int a = r * chains + p % chains;
                    iacc[a] = vq_dot(iacc[a], w0, vq_set1(load_i32(xr)));
                    iacc[a] = vq_dot(iacc[a], w1, vq_set1(load_i32(xr + 4)));
                }
            }
            const vf dsc = vf_mul(dv, vf_load_i8(blk + QB_SCALES_AT(6) + h * 16 + c * Q4_LANES));
#pragma GCC unroll 4
            for (int r = 0; r < mr; r++) {
                const vq sum = chains == 2 ? vq_add(iacc[2 * r], iacc[2 * r + 1]) : iacc[r];
                const vq centred = vq_sub(sum, vq_set1(32 * s16[r * (k / 16) + 2 * b + h]));
                facc[r] = vf_fmadd(vq_to_float(centred), vf_mul(dsc, vf_set1(dx[r * nb + b])), facc[r]);
            }
        }
    }
    store_tile(facc, mr, bias, c, out, ldo);
}

/* One row group of `mr` rows (a constant where inlined, to keep the accumulators in registers). */
static inline __attribute__((always_inline)) void qb_rows(
        const int8_t *q, const float *dx, const float *sx, const int32_t *s16, int64_t k, int mr,
        const uint8_t *group, int c, int bits, const float *bias, float *out, int64_t ldo) {
    if (bits == 6) q6_tile(q, dx, s16, k, mr, group, c, bias, out, ldo);
    else if (bits == 8) qb_tile(q, dx, sx, k, mr, group, c, 8, bias, out, ldo);
    else if (bits == 5) qb_tile(q, dx, sx, k, mr, group, c, 5, bias, out, ldo);
#if QB_INT16_SUMS
    else qb_tile(q, dx, sx, k, mr, group, c, 4, bias, out, ldo);
#else
    else q4_tile(q, dx, sx, k, mr, group, c, bias, out, ldo);
#endif
}

#endif /* IP_INT8 */

#if IP_INT8
/* Rows [0, m) of x quantized as the block kernel reads them: q, dx and sx per block of 32, and for
 * 6-bit weights (s16 not NULL) each half-block's sum. */
static void quantize_rows_blocks(const float *x, int64_t m0, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *dx,
                                 float *sx, int32_t *s16) {
    const int64_t nb = k / QB_BLOCK;
    for (int64_t i = m0; i < m; i++) {
        quantize_row_blocks(x + i * ldx, k, q + i * k, dx + i * nb, sx + i * nb);
        for (int64_t half = 0; s16 && half < 2 * nb; half++) {
            int32_t total = 0;
            for (int j = 0; j < 16; j++) total += q[i * k + half * 16 + j];
            s16[i * 2 * nb + half] = total;
        }
    }
}
#endif

/* x [m, k] float32 (rows ldx apart) @ W.T -> out [m, n] (rows ldo apart), W [n, k] as blocks of
 * `bits` (4, 5, 6 or 8) in the repacked layout above (pack_blocks in Python), bias [n] or NULL. Needs
 * k % 32 == 0, n % 16 == 0. Returns 0, -1 where this build has no such kernel (or bits is none of
 * those), -2 when out of memory. */
int ip_block_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int bits,
                    const float *bias, int64_t n, float *out, int64_t ldo) {
#if IP_INT8
    if (k % QB_BLOCK || n % 16 || !QB_KNOWN_BITS(bits)) return -1;
    const int64_t nb = k / QB_BLOCK;
    const int few = m <= FEW_ROWS;
    int8_t *q = NULL;
    float *dx = NULL, *sx = NULL;
    int32_t *s16 = NULL;
    if (!few) {
        q = (int8_t *)malloc((size_t)(m * k + 64));
        dx = (float *)malloc(sizeof(float) * (size_t)(m * nb));
        sx = (float *)malloc(sizeof(float) * (size_t)(m * nb));
        s16 = bits == 6 ? (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * 2 * nb)) : NULL;
        if (!q || !dx || !sx || (bits == 6 && !s16)) {
            free(q); free(dx); free(sx); free(s16);
            return -2;
        }
    }
    const int64_t per_group = 16 / Q4_LANES;
    const int64_t vectors = n / Q4_LANES;
    const int64_t group_bytes = QB_GROUP_BYTES(bits);
    int failed = 0;
#pragma omp parallel
    {
        const int8_t *tq = q;
        const float *tdx = dx, *tsx = sx;
        const int32_t *ts16 = s16;
        row_scratch *own = few ? own_rows(m, k, &failed) : NULL;
        const int ready = !few || own;
        if (own) {
            quantize_rows_blocks(x, 0, m, k, ldx, own->q, own->scale, own->sum, bits == 6 ? own->sums : NULL);
            tq = own->q, tdx = own->scale, tsx = own->sum, ts16 = bits == 6 ? own->sums : NULL;
        } else if (!few) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < m; i++) quantize_rows_blocks(x, i, i + 1, k, ldx, q, dx, sx, s16);
        }
#pragma omp for schedule(static) nowait
        for (int64_t v = 0; v < vectors; v++) {
            if (!ready) continue;
            const int64_t g = v / per_group;
            const int c = (int)(v % per_group);
            const uint8_t *group = w + g * nb * group_bytes;
            const float *bg = bias ? bias + g * 16 : NULL;
            for (int64_t r0 = 0; r0 < m; r0 += 4) {
                const int mr = (int)(m - r0 < 4 ? m - r0 : 4);
                const int8_t *qr = tq + r0 * k;
                const float *dr = tdx + r0 * nb, *sr = tsx + r0 * nb;
                const int32_t *hr = ts16 ? ts16 + r0 * 2 * nb : NULL;
                float *o = out + r0 * ldo + g * 16;
                switch (mr) { /* constant row counts keep the accumulators in registers */
                    case 4: qb_rows(qr, dr, sr, hr, k, 4, group, c, bits, bg, o, ldo); break;
                    case 3: qb_rows(qr, dr, sr, hr, k, 3, group, c, bits, bg, o, ldo); break;
                    case 2: qb_rows(qr, dr, sr, hr, k, 2, group, c, bits, bg, o, ldo); break;
                    default: qb_rows(qr, dr, sr, hr, k, 1, group, c, bits, bg, o, ldo); break;
                }
            }
        }
    }
    free(q); free(dx); free(sx); free(s16);
    return failed ? -2 : 0;
#else
    (void)x; (void)m; (void)k; (void)ldx; (void)w; (void)bits; (void)bias; (void)n; (void)out; (void)ldo;
    return -1;
#endif
}

/* IEEE half (little-endian bytes) -> float, without F16C: the dequantize runs on every build. */
static float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    float v;
    if (exp == 0) {
        v = ldexpf((float)mant, -24); /* subnormal (or zero) */
    } else if (exp == 31) {
        v = mant ? NAN : INFINITY;
    } else {
        v = ldexpf((float)(mant | 0x400u), (int)exp - 25);
    }
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    bits |= sign;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The repacked weight of `bits` (4, 5, 6 or 8) as float32 out [n, k]: for a float GEMM where many
 * rows (prefill) make that faster. 6 bits: (d * sc) * (q - 32), in gguf-py's order. */
void ip_block_dequantize(const uint8_t *w, int bits, int64_t n, int64_t k, float *out) {
    const int64_t nb = k / QB_BLOCK;
    const int64_t group_bytes = QB_GROUP_BYTES(bits);
    const int scales_at = QB_SCALES_AT(bits);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 16; g++) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w + (g * nb + b) * group_bytes;
            for (int ch = 0; ch < 16; ch++) {
                const float d = half_to_float(blk + scales_at + (bits == 6 ? 32 : 0) + 2 * ch);
                const float mn = bits == 6 ? 0.0f : bits == 8 ? QB_Q8_MIN * d : half_to_float(blk + scales_at + 32 + 2 * ch);
                float *o = out + (g * 16 + ch) * k + b * QB_BLOCK;
                for (int step = 0; step < 8; step++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = blk[(bits == 8 ? step : step / 2) * 64 + ch * 4 + j];
                        int v = bits == 8 ? byte : (step % 2 ? byte >> 4 : byte) & 0x0F;
                        if (bits == 5) v |= ((blk[QB_HIGH_AT + ch * 4 + j] >> step) & 1) << 4;
                        if (bits == 6) {
                            v |= ((blk[QB_HIGH_AT + (step / 4) * 64 + ch * 4 + j] >> (2 * (step % 4))) & 3) << 4;
                            const float dsc = d * (float)(int8_t)blk[scales_at + (step / 4) * 16 + ch];
                            o[step * 4 + j] = dsc * (float)(v - 32);
                        } else {
                            o[step * 4 + j] = (float)v * d + mn;
                        }
                    }
            }
        }
    }
}

/* ---------------------------------------------------------------- float32 linear (few rows) */

#define IP_FEATURE_F32_LINEAR 2

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

/* ---------------------------------------------------------------- paged decode attention */

/* The KV cache holds float32, or float16 (half the memory and the bytes each decode step reads; the
 * engine's kv_cache_dtype): converted on load and on store by F16C, rounding to nearest even as
 * PyTorch's .to(torch.float16) does. Builds without F16C report no half cache (ip_features). */
#if defined(__F16C__) && IP_VECTOR
#define IP_HALF_KV 1
static inline float kv_get(const void *cache, int64_t i, const int half) {
    return half ? _cvtsh_ss(((const uint16_t *)cache)[i]) : ((const float *)cache)[i];
}
static inline __m256 kv_load8(const void *cache, int64_t i, const int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)cache + i)))
                : _mm256_loadu_ps((const float *)cache + i);
}
/* n floats from src to the cache at element i */
static inline void kv_put(void *cache, int64_t i, const float *src, int64_t n, const int half) {
    if (!half) {
        memcpy((float *)cache + i, src, sizeof(float) * (size_t)n);
        return;
    }
    uint16_t *dst = (uint16_t *)cache + i;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm_storeu_si128((__m128i *)(dst + j), _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT));
    for (; j < n; j++) dst[j] = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
}
#else
#define IP_HALF_KV 0
static inline float kv_get(const void *cache, int64_t i, const int half) {
    (void)half;
    return ((const float *)cache)[i];
}
static inline void kv_put(void *cache, int64_t i, const float *src, int64_t n, const int half) {
    (void)half;
    memcpy((float *)cache + i, src, sizeof(float) * (size_t)n);
}
#if IP_VECTOR
static inline __m256 kv_load8(const void *cache, int64_t i, const int half) {
    (void)half;
    return _mm256_loadu_ps((const float *)cache + i);
}
#endif
#endif
#define IP_FEATURE_HALF_KV 8

/* s[t] <- exp(s[t] - top) for t < n; returns the sum. */
static float exp_shifted(float *s, int64_t n, float top) {
    float total = 0.0f;
    int64_t t = 0;
#if IP_VECTOR
    const vf vtop = vf_set1(top);
    vf sum = vf_zero();
    for (; t + VF_WIDTH <= n; t += VF_WIDTH) {
        const vf e = vf_exp(vf_sub(vf_load(s + t), vtop));
        vf_store(s + t, e);
        sum = vf_add(sum, e);
    }
    total = vf_reduce_add(sum);
#endif
    for (; t < n; t++) {
        s[t] = expf(s[t] - top);
        total += s[t];
    }
    return total;
}

/* Tokens ahead whose keys (values) a loop asks for while it works on the current ones. The rows lie
 * block by block across the cache and, when a layer's attention runs, the step's weights have
 * pushed them out of cache: read only as needed, each token's row waited for memory (a f16 cache,
 * SmolLM2's shapes, 2 threads, cold: 45k -> 26-38k cycles a call at 96 tokens, 128-148k -> 77-111k
 * at 330; at 1,000 tokens unchanged within noise). Prefetches change no value read. */
#define KV_AHEAD 16

/* Asks for the n elements of a cache row at element i (a hint: no fault, no value changes). */
static inline void kv_prefetch(const void *cache, int64_t i, int64_t n, const int half) {
    const char *at = (const char *)cache + i * (half ? 2 : 4);
    for (int64_t byte = 0; byte < n * (half ? 2 : 4); byte += 64) __builtin_prefetch(at + byte);
}

#if IP_VECTOR
/* Lane i of the result: the sum of a[i]'s eight lanes (eight dot products finished at once, where
 * one horizontal sum per product cost more than the product's own multiply-adds). */
static inline __m256 hsum8(const __m256 a[8]) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* o[0..NV*8) (first: from zero) += sum over tokens t < n of p[t] * v[at + offs[t] + j], 8 floats a
 * vector, kept in registers while the loop runs. Up to eight vectors (64 floats) at a time: each
 * accumulator takes one multiply-add per token, which waits for its previous one, so with four a token
 * cost four multiply-add latencies per 32 floats; eight chains keep both FMA units busy (the attention
 * call took 40% less time at 330 tokens, the same bits: each float still sums its tokens in order).
 * Storing the sums between calls and loading them again changes no bit either. Rows up to `ahead`
 * tokens on are asked for in advance (a later call's tokens too). */
static inline __attribute__((always_inline)) void weighted_sum(const float *p, const int64_t *offs, int64_t n,
                                                               int64_t ahead, const void *v, int64_t at, int first,
                                                               float *o, const int NV, const int half) {
    __m256 acc[8];
    for (int i = 0; i < NV; i++) acc[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * i);
    for (int64_t t = 0; t < n; t++) {
        if (t + KV_AHEAD < ahead) kv_prefetch(v, at + offs[t + KV_AHEAD], NV * 8, half);
        const __m256 w = _mm256_set1_ps(p[t]);
        const int64_t vt = at + offs[t];
        for (int i = 0; i < NV; i++) acc[i] = _mm256_fmadd_ps(w, kv_load8(v, vt + 8 * i, half), acc[i]);
    }
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(o + 8 * i, acc[i]);
}
#endif

/* Tokens whose values every query head of a task weighs before the next ones are read: their rows
 * (SmolLM2's 3 x 64 floats, Gemma 3's 256) stay in L1 while the heads that share them read them. One
 * pass per head over all tokens read each value row once per query head from wherever it was: past
 * the L2 at long contexts (SmolLM2, 8,192 tokens, 4 sequences on 2 threads: 12 GB/s of KV). */
#define V_CHUNK 32

/* One task: query heads [qa, qb) of one sequence (qs: its q [heads, d]) against len tokens, whose
 * K and V rows start at offs[t] elements into the caches (float16 where `half`). scores: (qb - qa) *
 * len floats of scratch. Exact softmax, unscaled: scores, their maximum, exp, then o gets the values
 * weighted by exp, V_CHUNK tokens at a time for every head, and stats[2 h], stats[2 h + 1] head h's
 * maximum score and sum of exp. The caller divides by the sum (scale_by_sums), or merges the parts
 * of one context first (merge_parts). Inlined once per cache type, so the inner loops test no flag. */
static inline __attribute__((always_inline)) void attend(
        const float *qs, int64_t qa, int64_t qb, int64_t group, int64_t d, const void *k_cache,
        const void *v_cache, const int64_t *offs, int64_t len, float scale, float softcap, float *scores, float *o,
        float *stats, const int half) {
    int64_t t0 = 0;
#if IP_VECTOR
    const int vectors = d % 8 == 0 && (IP_HALF_KV || !half); /* else the scalar loops do it all */
    if (vectors) {
        /* Eight tokens at a time: their keys stay in L1 while every query head of the task reads them. */
        for (; t0 + 8 <= len; t0 += 8) {
            if (t0 + KV_AHEAD + 8 <= len)
                for (int64_t kvh = qa / group; kvh <= (qb - 1) / group; kvh++)
                    for (int i = 0; i < 8; i++) kv_prefetch(k_cache, offs[t0 + KV_AHEAD + i] + kvh * d, d, half);
            for (int64_t qh = qa; qh < qb; qh++) {
                const float *qv = qs + qh * d;
                const int64_t head = (qh / group) * d;
                __m256 acc[8];
                for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
                for (int64_t j = 0; j < d; j += 8) {
                    const __m256 qj = _mm256_loadu_ps(qv + j);
                    for (int i = 0; i < 8; i++)
                        acc[i] = _mm256_fmadd_ps(qj, kv_load8(k_cache, offs[t0 + i] + head + j, half), acc[i]);
                }
                _mm256_storeu_ps(scores + (qh - qa) * len + t0, _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
            }
        }
    }
#endif
    for (int64_t t = t0; t < len; t++)
        for (int64_t qh = qa; qh < qb; qh++) {
            const float *qv = qs + qh * d;
            const int64_t at = offs[t] + (qh / group) * d;
            float total = 0.0f;
            for (int64_t j = 0; j < d; j++) total += qv[j] * kv_get(k_cache, at + j, half);
            scores[(qh - qa) * len + t] = total * scale;
        }
    if (softcap > 0.0f) /* Gemma 2: scores -> cap * tanh(scores / cap), before the softmax */
        for (int64_t i = 0; i < (qb - qa) * len; i++) scores[i] = tanhf(scores[i] / softcap) * softcap;
    for (int64_t qh = qa; qh < qb; qh++) {
        float *s = scores + (qh - qa) * len;
        float top = -INFINITY;
        for (int64_t t = 0; t < len; t++) top = s[t] > top ? s[t] : top;
        const float total = exp_shifted(s, len, top);
        stats[2 * (qh - qa)] = top;
        stats[2 * (qh - qa) + 1] = total;
        float *oh = o + qh * d;
        const int64_t head = (qh / group) * d;
        int64_t j = 0;
#if IP_VECTOR
        j = vectors ? d : 0; /* the vector heads run chunked below */
#endif
        for (; j < d; j++) {
            float total_j = 0.0f;
            for (int64_t t = 0; t < len; t++) total_j += s[t] * kv_get(v_cache, offs[t] + head + j, half);
            oh[j] = total_j;
        }
    }
#if IP_VECTOR
    if (vectors) {
        for (int64_t c0 = 0; c0 < len; c0 += V_CHUNK) {
            const int64_t n = len - c0 < V_CHUNK ? len - c0 : V_CHUNK;
            for (int64_t qh = qa; qh < qb; qh++) {
                const float *s = scores + (qh - qa) * len + c0;
                const int64_t head = (qh / group) * d;
                float *oh = o + qh * d;
                for (int64_t j = 0; j < d; j += 64) {
                    switch ((d - j) / 8) {  /* constant vector counts keep the sums in registers */
                        case 1: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 1, half); break;
                        case 2: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 2, half); break;
                        case 3: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 3, half); break;
                        case 4: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 4, half); break;
                        case 5: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 5, half); break;
                        case 6: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 6, half); break;
                        case 7: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 7, half); break;
                        default: weighted_sum(s, offs + c0, n, len - c0, v_cache, head + j, c0 == 0, oh + j, 8, half); break;
                    }
                }
            }
        }
        if (len == 0)
            for (int64_t qh = qa; qh < qb; qh++) memset(o + qh * d, 0, sizeof(float) * (size_t)d);
    }
#endif
}

/* Heads [qa, qb) of o divided by their sums of exp (stats as attend leaves them): the softmax's
 * 1/sum, one multiply a float, as it always was. */
static void scale_by_sums(float *o, const float *stats, int64_t qa, int64_t qb, int64_t d) {
    for (int64_t qh = qa; qh < qb; qh++) {
        const float total = stats[2 * (qh - qa) + 1];
        const float inv = total > 0.0f ? 1.0f / total : 0.0f;
        for (int64_t j = 0; j < d; j++) o[qh * d + j] *= inv;
    }
}

/* Parts of one context attended separately (stats as attend leaves them: per part and head the
 * maximum score and the sum of exp; po the parts' unscaled weighted sums [parts][heads][d]) into one
 * exact softmax: each part's sums scaled by exp(its maximum - the overall maximum). */
static void merge_parts(const float *po, const float *stats, int64_t parts, int64_t heads, int64_t d, int64_t h,
                        float *oh) {
    float top = -INFINITY;
    for (int64_t p = 0; p < parts; p++) top = stats[(p * heads + h) * 2] > top ? stats[(p * heads + h) * 2] : top;
    float total = 0.0f;
    for (int64_t j = 0; j < d; j++) oh[j] = 0.0f;
    for (int64_t p = 0; p < parts; p++) {
        const float *st = stats + (p * heads + h) * 2;
        if (st[1] == 0.0f) continue; /* an empty part */
        const float w = expf(st[0] - top);
        total += w * st[1];
        const float *src = po + (p * heads + h) * d;
        for (int64_t j = 0; j < d; j++) oh[j] += w * src[j];
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t j = 0; j < d; j++) oh[j] *= inv;
}

/* A context shorter than this per part is not split across threads (merging costs more than it saves). */
#define PART_MIN_TOKENS 64

/* q [b, heads, d] (rows q_stride apart) attends to its sequence's first context_lens[i] tokens in
 * k_cache / v_cache [blocks, block_size, kv_heads, d], found through block_tables [b, max_blocks].
 * out [b, heads, d] (rows out_stride apart). A task is one sequence and all its heads, so each
 * token's keys (and values) are read as one contiguous row of kv_heads * d floats (split by KV head,
 * threads each read a part of every row and the KV reads ran at half the memory bandwidth). With
 * fewer sequences than two per thread, a task is a part of one sequence's tokens (every head), and
 * the parts are merged after (merge_parts): each thread reads its own rows once, where a task per
 * query head made threads read the rows their heads share (all of them for Gemma 3's one KV head).
 * Contexts too short to split (PART_MIN_TOKENS) keep a task per query head, so that a batch of one
 * still keeps both threads busy (by KV head, three tasks on two threads left one idle a third of
 * the time). `window` > 0 (a sliding layer): each query reads only its context's last `window`
 * tokens. `softcap` > 0 (Gemma 2): scores become softcap * tanh(score / softcap) before the softmax. */
int ip_paged_decode_attention(const float *q, int64_t q_stride, int64_t b, int64_t heads, int64_t kv_heads,
                              int64_t d, const void *k_cache, const void *v_cache, int64_t block_size,
                              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                              float scale, float *out, int64_t out_stride, int half, int64_t window,
                              float softcap) {
    if (half && !IP_HALF_KV) return -1;
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * d;  /* floats per token in the cache */
    int64_t longest = 0;
    for (int64_t i = 0; i < b; i++) {
        const int64_t len = window > 0 && context_lens[i] > window ? window : context_lens[i];
        longest = len > longest ? len : longest;
    }
    const int64_t threads = omp_get_max_threads();
    int64_t splits = 1, parts = 1;
    if (b < 2 * threads) {
        parts = (2 * threads + b - 1) / b;
        if (parts > longest / PART_MIN_TOKENS) parts = longest / PART_MIN_TOKENS;
        if (parts < 2) {
            parts = 1;
            splits = heads;
        }
    }
    float *po = NULL, *pstats = NULL;
    if (parts > 1) {
        po = (float *)malloc(sizeof(float) * (size_t)(b * parts * heads * d));
        pstats = (float *)malloc(sizeof(float) * (size_t)(b * parts * heads * 2));
        if (!po || !pstats) {
            free(po); free(pstats);
            return -2;
        }
    }
    int failed = 0;
#pragma omp parallel
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(heads * longest + 8));
        float *sums = (float *)malloc(sizeof(float) * (size_t)(2 * heads)); /* a task's stats, unsplit */
        int64_t *offs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(longest + 1));
        if (!scores || !offs || !sums) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t offs_of = -1; /* the sequence whose token offsets offs holds */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < b * splits * parts; task++) {
            if (!scores || !offs || !sums) continue;
            const int64_t seq = task / (splits * parts), split = task / parts % splits, part = task % parts;
            const int64_t qa = split * heads / splits, qb = (split + 1) * heads / splits;
            /* a sliding layer's query (the last position) sees the last `window` positions only */
            const int64_t first = window > 0 && context_lens[seq] > window ? context_lens[seq] - window : 0;
            const int64_t len = context_lens[seq] - first;
            if (offs_of != seq) { /* once per sequence and thread, one division per block, not per token */
                const int64_t *table = block_tables + seq * max_blocks;
                for (int64_t t = 0, pos = first; t < len;) {
                    const int64_t within = pos % block_size, base = table[pos / block_size] * block_size + within;
                    const int64_t n = block_size - within < len - t ? block_size - within : len - t;
                    for (int64_t i = 0; i < n; i++) offs[t + i] = (base + i) * row;
                    t += n;
                    pos += n;
                }
                offs_of = seq;
            }
            const int64_t ta = part * len / parts, tb = (part + 1) * len / parts;
            float *o = parts > 1 ? po + (seq * parts + part) * heads * d : out + seq * out_stride;
            float *st = parts > 1 ? pstats + (seq * parts + part) * heads * 2 : sums;
            if (half)
                attend(q + seq * q_stride, qa, qb, group, d, k_cache, v_cache, offs + ta, tb - ta, scale, softcap,
                       scores, o, st, 1);
            else
                attend(q + seq * q_stride, qa, qb, group, d, k_cache, v_cache, offs + ta, tb - ta, scale, softcap,
                       scores, o, st, 0);
            if (parts == 1) scale_by_sums(o, st, qa, qb, d);
        }
        if (parts > 1 && !failed) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < b * heads; task++) {
                const int64_t seq = task / heads, h = task % heads;
                merge_parts(po + seq * parts * heads * d, pstats + seq * parts * heads * 2, parts, heads, d, h,
                            out + seq * out_stride + h * d);
            }
        }
        free(scores);
        free(offs);
        free(sums);
    }
    free(po); free(pstats);
    return failed ? -2 : 0;
}

/* ---------------------------------------------------------------- the small ops between the matmuls */

/* Rows i in [0, m) through `row_call` (a call naming i): serially below `threshold` rows, with no
 * OpenMP region at all (entering one cost about 0.4 us even where an if() clause made it serial: a
 * batch-1 step makes 4 to 8 of these calls per layer), else split statically over the threads. */
#define FOR_ROWS(m, threshold, row_call)                  \
    do {                                                  \
        if ((m) < (threshold)) {                          \
            for (int64_t i = 0; i < (m); i++) row_call;   \
        } else {                                          \
            _Pragma("omp parallel for schedule(static)")  \
            for (int64_t i = 0; i < (m); i++) row_call;   \
        }                                                 \
    } while (0)

/* Each of these replaces several eager PyTorch ops (RMSNorm alone was eight, about 45 us per call at
 * one row, where the arithmetic takes one or two). Rows are independent; threads only from 8 rows. */

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

/* gate_up [m, 2 * inter] (gate then up, as the fused projection lays them out) -> out [m, inter]:
 * silu(gate) * up. */
static inline void silu_mul_row(const float *gate_up, int64_t inter, float *out, int64_t i) {
    const float *g = gate_up + i * 2 * inter, *u = g + inter;
    float *o = out + i * inter;
    int64_t j = 0;
#if IP_VECTOR
    for (; j + VF_WIDTH <= inter; j += VF_WIDTH) {
        const vf gv = vf_load(g + j);
        const vf sig = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(vf_sub(vf_zero(), gv))));
        vf_store(o + j, vf_mul(sig, vf_load(u + j)));
    }
#endif
    for (; j < inter; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
}

void ip_silu_mul(const float *gate_up, int64_t m, int64_t inter, float *out) {
    FOR_ROWS(m, 8, silu_mul_row(gate_up, inter, out, i));
}

/* gate_up [m, 2 * inter] -> out [m, inter]: gelu(gate) * up with the tanh approximation (Gemma's
 * GeGLU), written as gate * sigmoid(2z), z = sqrt(2/pi) (gate + 0.044715 gate^3), which equals
 * 0.5 gate (1 + tanh(z)) and shares silu's vector exp. */
static inline void gelu_mul_row(const float *gate_up, int64_t inter, float *out, int64_t i) {
    const float c = 0.7978845608028654f, a = 0.044715f;
    const float *g = gate_up + i * 2 * inter, *u = g + inter;
    float *o = out + i * inter;
    int64_t j = 0;
#if IP_VECTOR
    for (; j + VF_WIDTH <= inter; j += VF_WIDTH) {
        const vf gv = vf_load(g + j);
        const vf z2 = vf_mul(vf_set1(-2.0f * c), vf_fmadd(vf_mul(vf_set1(a), gv), vf_mul(gv, gv), gv));
        const vf gelu = vf_div(gv, vf_add(vf_set1(1.0f), vf_exp(z2)));
        vf_store(o + j, vf_mul(gelu, vf_load(u + j)));
    }
#endif
    for (; j < inter; j++) {
        const float z = c * (g[j] + a * g[j] * g[j] * g[j]);
        o[j] = g[j] / (1.0f + expf(-2.0f * z)) * u[j];
    }
}

void ip_gelu_mul(const float *gate_up, int64_t m, int64_t inter, float *out) {
    FOR_ROWS(m, 8, gelu_mul_row(gate_up, inter, out, i));
}

/* A Mixture-of-Experts router's choice for each of m rows of logits [m, e]: softmax over the e
 * experts, the k most probable (the first of equal ones), most probable first, into ids [m, k] and
 * weights [m, k], renormalised to sum to 1 where `normalize` says so (Mixtral; Qwen3-MoE by
 * norm_topk_prob). The MoE layer's Python (model/moe.py) calls this on the CPU too, so the fused
 * decode and the layers op by op route with the same bits. Returns 0, -1 where k is not in [1, e],
 * -2 when out of memory. */
int ip_moe_route(const float *logits, int64_t m, int64_t e, int64_t k, int normalize, float *weights,
                 int64_t *ids) {
    if (k < 1 || k > e) return -1;
    float *probs = (float *)malloc(sizeof(float) * (size_t)e);
    unsigned char *taken = (unsigned char *)malloc((size_t)e);
    if (!probs || !taken) {
        free(probs); free(taken);
        return -2;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *row = logits + r * e;
        float top = row[0];
        for (int64_t j = 1; j < e; j++) top = row[j] > top ? row[j] : top;
        float total = 0.0f;
        for (int64_t j = 0; j < e; j++) {
            probs[j] = expf(row[j] - top);
            total += probs[j];
            taken[j] = 0;
        }
        for (int64_t j = 0; j < e; j++) probs[j] /= total;
        float chosen = 0.0f;
        for (int64_t t = 0; t < k; t++) {
            int64_t best = -1;
            for (int64_t j = 0; j < e; j++)
                if (!taken[j] && (best < 0 || probs[j] > probs[best])) best = j;
            taken[best] = 1;
            ids[r * k + t] = best;
            weights[r * k + t] = probs[best];
            chosen += probs[best];
        }
        for (int64_t t = 0; normalize && t < k; t++) weights[r * k + t] /= chosen;
    }
    free(probs); free(taken);
    return 0;
}

/* Row-wise argmax of x [m, n] (rows ldx apart) into out [m]: the first index of each row's largest
 * value, as torch.argmax returns it, and for a row holding a NaN the first NaN's (torch counts NaN
 * as largest). Greedy decoding takes one per sampled row: PyTorch's CPU argmax took 0.7 ms for 16
 * rows of a 49,152-token vocabulary, a max pass 0.04 ms. One vector pass finds the maximum and
 * notes NaNs, a second stops at the first lane equal to it. */
static void argmax_row(const float *x, int64_t n, int64_t ldx, int64_t *out, int64_t i) {
    const float *row = x + i * ldx;
    float top = -INFINITY;
    int nan = 0;
    int64_t j = 0;
#if IP_AVX512
    __m512 acc = _mm512_set1_ps(-INFINITY);
    __mmask16 unordered = 0;
    for (; j + 16 <= n; j += 16) {
        const __m512 v = _mm512_loadu_ps(row + j);
        acc = _mm512_max_ps(acc, v);
        unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    top = _mm512_reduce_max_ps(acc);
    nan = unordered != 0;
#elif IP_AVX2
    __m256 acc = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 v = _mm256_loadu_ps(row + j);
        acc = _mm256_max_ps(acc, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int l = 0; l < 8; l++) top = lanes[l] > top ? lanes[l] : top;
    nan = _mm256_movemask_ps(unordered) != 0;
#endif
    for (; j < n; j++) {
        if (row[j] != row[j]) nan = 1;
        else if (row[j] > top) top = row[j];
    }
    int64_t found = 0;
    if (nan) {
        while (row[found] == row[found]) found++;
    } else {
        j = 0;
#if IP_AVX512
        const __m512 want = _mm512_set1_ps(top);
        for (; j + 16 <= n; j += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), want, _CMP_EQ_OQ);
            if (hit) break;
        }
#elif IP_AVX2
        const __m256 want = _mm256_set1_ps(top);
        for (; j + 8 <= n; j += 8)
            if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), want, _CMP_EQ_OQ))) break;
#endif
        while (row[j] != top) j++;  /* the maximum is in this vector or the tail */
        found = j;
    }
    out[i] = found;
}

void ip_argmax_rows(const float *x, int64_t m, int64_t n, int64_t ldx, int64_t *out) {
    FOR_ROWS(m, 4, argmax_row(x, n, ldx, out, i));
}

/* qkv [t, heads + 2 * kv_heads, d], fused q|k|v rows: rotates q and k in place (x * cos + roll(x, d/2)
 * * signed_sin, the tables already looked up for each row's position: [t, d]) and copies k and v
 * into the caches [blocks, block_size, kv_heads, d] (float32, or float16 where f16) at flat slot
 * slots[r]. Returns 0, -1 for a float16 cache on a build without F16C. */
static inline void rope_store_row(float *qkv, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                                  const float *signed_sin, const int64_t *slots, void *k_cache, void *v_cache, int f16,
                                  int64_t r) {
    const int64_t width = (heads + 2 * kv_heads) * d, half = d / 2;
    float *row = qkv + r * width;
    const float *c = cos + r * d, *sn = signed_sin + r * d;
    for (int64_t h = 0; h < heads + kv_heads; h++) {
        float *x = row + h * d;
        float rotated[512];
        for (int64_t j = 0; j < half; j++) {
            rotated[j] = x[j] * c[j] + x[j + half] * sn[j];
            rotated[j + half] = x[j + half] * c[j + half] + x[j] * sn[j + half];
        }
        memcpy(x, rotated, sizeof(float) * (size_t)d);
    }
    kv_put(k_cache, slots[r] * kv_heads * d, row + heads * d, kv_heads * d, f16);
    kv_put(v_cache, slots[r] * kv_heads * d, row + (heads + kv_heads) * d, kv_heads * d, f16);
}

int ip_rope_store_kv(float *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                     const float *signed_sin, const int64_t *slots, void *k_cache, void *v_cache, int f16) {
    if (f16 && !IP_HALF_KV) return -1;
    FOR_ROWS(t, 8, rope_store_row(qkv, heads, kv_heads, d, cos, signed_sin, slots, k_cache, v_cache, f16, i));
    return 0;
}

/* Which of the kernels above this build has (the others return -1). */
int ip_features(void) {
    return (IP_INT8 ? IP_FEATURE_INT8_LINEAR | IP_FEATURE_BLOCK_LINEAR : 0) | (IP_VECTOR ? IP_FEATURE_F32_LINEAR : 0)
           | (IP_HALF_KV ? IP_FEATURE_HALF_KV : 0);
}

/* The instruction set this build's vector code uses: what the library was compiled for, so the
 * Python side can check it loaded what it asked for, and stats can say which kernels ran. */
const char *ip_isa(void) {
#if IP_AVX512 && IP_INT8
    return "avx512-vnni";
#elif IP_AVX512
    return "avx512";
#elif IP_AVX2_VNNI && !defined(__AVXVNNI__)
    return "avx2-vnni-emulated";
#elif IP_AVX2_VNNI
    return "avx2-vnni";
#elif IP_AVX2
    return "avx2";
#else
    return "generic";
#endif
}

/* ---------------------------------------------------------------- one whole decoder layer */

/* One of the layer's linears: packed int8 with per-channel scales s, or (s NULL) GGUF blocks of `bits`
 * (4, 5, 6 or 8), or (bits IP_FLOAT32_BITS) a float32 weight [n, k] (a MoE router, which cpu-int8
 * keeps in float32 as llama.cpp's files keep it). */
#define IP_FLOAT32_BITS 32
static int layer_linear(const float *x, int64_t b, int64_t k, int64_t ldx, const uint8_t *w, const float *s,
                        int64_t bits, const float *bias, int64_t n, float *out, int64_t ldo) {
    if (s) return ip_int8_linear(x, b, k, ldx, w, s, bias, n, out, ldo);
    if (bits == IP_FLOAT32_BITS) return ip_f32_linear(x, b, k, ldx, (const float *)w, bias, n, out, ldo);
    return ip_block_linear(x, b, k, ldx, w, (int)bits, bias, n, out, ldo);
}

/* One linear of a layer, as layer_linear reads it; n outputs; bias or NULL. */
typedef struct {
    const uint8_t *w;
    const float *s, *bias;
    int64_t bits, n;
} ip_linear;

/* A Mixture-of-Experts MLP (model/moe.py): the router (hidden -> n_experts) and each expert's fused
 * gate_up (hidden -> 2 * inter) and down (inter -> hidden) projections. */
typedef struct ip_moe {
    ip_linear router;
    const ip_linear *gate_up, *down;
    int64_t n_experts, top_k, inter, normalize;
} ip_moe;

static int run_linear(const float *x, int64_t b, int64_t k, const ip_linear *lin, float *out) {
    return layer_linear(x, b, k, k, lin->w, lin->s, lin->bits, lin->bias, lin->n, out, lin->n);
}

/* h [b, hidden] through the experts into delta [b, hidden], as SparseMoE.forward computes it: each
 * expert that any row chose runs once over its rows (in row order), its output scaled by the row's
 * weight, and the scaled outputs are added to a zeroed delta expert by expert in id order. The
 * product is stored before the add, as PyTorch's separate multiply and index_add_ round it. */
static int moe_mlp(const float *h, int64_t b, int64_t hidden, const ip_moe *M, int gelu, float *delta) {
    const int64_t e = M->n_experts, k = M->top_k, inter = M->inter;
    float *logits = (float *)malloc(sizeof(float) * (size_t)(b * e));
    float *weights = (float *)malloc(sizeof(float) * (size_t)(b * k));
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(b * k));
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)b);
    float *row_weight = (float *)malloc(sizeof(float) * (size_t)b);
    float *x = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    float *gate_up = (float *)malloc(sizeof(float) * (size_t)(b * 2 * inter));
    float *act = (float *)malloc(sizeof(float) * (size_t)(b * inter));
    float *y = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    int rc = (!logits || !weights || !ids || !rows || !row_weight || !x || !gate_up || !act || !y) ? -2 : 0;
    if (rc == 0) rc = run_linear(h, b, hidden, &M->router, logits);
    if (rc == 0) rc = ip_moe_route(logits, b, e, k, (int)M->normalize, weights, ids);
    if (rc == 0) memset(delta, 0, sizeof(float) * (size_t)(b * hidden));
    for (int64_t expert = 0; rc == 0 && expert < e; expert++) {
        int64_t count = 0;
        for (int64_t r = 0; r < b; r++)
            for (int64_t t = 0; t < k; t++)
                if (ids[r * k + t] == expert) {
                    rows[count] = r;
                    row_weight[count++] = weights[r * k + t];
                }
        if (count == 0) continue;
        for (int64_t i = 0; i < count; i++) memcpy(x + i * hidden, h + rows[i] * hidden, sizeof(float) * (size_t)hidden);
        rc = run_linear(x, count, hidden, &M->gate_up[expert], gate_up);
        if (rc != 0) break;
        if (gelu) ip_gelu_mul(gate_up, count, inter, act);
        else ip_silu_mul(gate_up, count, inter, act);
        rc = run_linear(act, count, inter, &M->down[expert], y);
        for (int64_t i = 0; rc == 0 && i < count; i++) {
            float *yr = y + i * hidden;
            for (int64_t j = 0; j < hidden; j++) yr[j] *= row_weight[i];
        }
        for (int64_t i = 0; rc == 0 && i < count; i++) {
            float *d = delta + rows[i] * hidden;
            const float *yr = y + i * hidden;
            for (int64_t j = 0; j < hidden; j++) d[j] += yr[j];
        }
    }
    free(logits); free(weights); free(ids); free(rows); free(row_weight); free(x); free(gate_up); free(act); free(y);
    return rc;
}

/* One decoder layer's weights and KV cache, as ip_decode_layers reads them: the four linears (qkv, o,
 * gate_up, down) each as packed int8 with per-channel scales s, or (s NULL) GGUF blocks of bits[i]
 * (4, 5, 6 or 8, ip_block_linear); biases may be
 * NULL. The Llama block has norm1 (attention input) and norm2 (MLP input). Gemma adds: q_norm and
 * k_norm over each head before the rotation, and a sandwich of norms, where norm2 norms the attention
 * output, norm3 is the MLP's input norm and norm4 norms the MLP's output (NULL where a family has
 * none). A sliding layer has its window, its KV addressed through the window view (its own pool)
 * and, in Gemma 3, its own rope tables. Python builds an array of these once
 * (model/fused_decode.py), so a decode step passes one pointer for the whole model. */
typedef struct {
    const float *norm1, *norm2;
    const uint8_t *w[4];
    const float *s[4];
    const float *bias[4];
    void *k_cache, *v_cache;  /* float32, or float16 where ip_decode_layers' `half` says so */
    const float *q_norm, *k_norm, *norm3, *norm4;
    int64_t window;  /* > 0: attends to the last `window` tokens only */
    int64_t view;    /* the ip_attn_view its KV is addressed by: 0 the main pool, 1 the window pool */
    int64_t rope;    /* the ip_rope it rotates by: 0 the model's, 1 the sliding layers' own */
    int64_t bits[4]; /* where s[i] is NULL: the bits of linear i's blocks */
    float softcap;   /* > 0: attention scores soft-capped (Gemma 2), cap * tanh(score / cap) */
    const struct ip_moe *moe; /* non-NULL: the MLP is these experts (w[2], w[3] unused) */
} ip_layer_weights;

/* Where a step's KV goes and is read from, for the layers of one pool: each row's slot, its block
 * table [b, max_blocks] and context length. */
typedef struct {
    const int64_t *slots, *block_tables, *context_lens;
    int64_t max_blocks;
} ip_attn_view;

/* One rope's cos and signed sin tables for each row's position, [b, d]. */
typedef struct {
    const float *cos, *signed_sin;
} ip_rope;

/* A decoder layer for b decode rows (one new token per sequence): the kernels above in the order the
 * model's Python calls them, so the result is the same bits. x [b, hidden] (contiguous) becomes
 * x + attn, then + mlp, in place. h, wide, narrow and delta are scratch rows the caller owns. */
static int decode_layer(float *x, int64_t b, int64_t hidden, const ip_layer_weights *L, float eps,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const ip_rope *ropes,
                        const ip_attn_view *views, int64_t block_size, float scale, int half, int gelu,
                        float *h, float *wide, float *narrow, float *delta) {
    const int64_t qkv_width = (heads + 2 * kv_heads) * d;
    const ip_attn_view *view = views + L->view;
    const ip_rope *rope = ropes + L->rope;
    ip_rms_norm(x, NULL, b, hidden, L->norm1, eps, h);
    int rc = layer_linear(h, b, hidden, hidden, L->w[0], L->s[0], L->bits[0], L->bias[0], qkv_width, wide, qkv_width);
    if (rc == 0 && L->q_norm) {
        for (int64_t r = 0; r < b; r++) {  /* each head's row normed in place, as Attention._head_norms */
            float *row = wide + r * qkv_width;
            ip_rms_norm(row, NULL, heads, d, L->q_norm, eps, row);
            ip_rms_norm(row + heads * d, NULL, kv_heads, d, L->k_norm, eps, row + heads * d);
        }
    }
    if (rc == 0) {
        rc = ip_rope_store_kv(wide, b, heads, kv_heads, d, rope->cos, rope->signed_sin, view->slots, L->k_cache,
                              L->v_cache, half);
    }
    if (rc == 0) {
        rc = ip_paged_decode_attention(wide, qkv_width, b, heads, kv_heads, d, L->k_cache, L->v_cache, block_size,
                                       view->block_tables, view->max_blocks, view->context_lens, scale, narrow,
                                       heads * d, half, L->window, L->softcap);
    }
    if (rc == 0) rc = layer_linear(narrow, b, heads * d, heads * d, L->w[1], L->s[1], L->bits[1], L->bias[1], hidden, delta, hidden);
    if (rc == 0) {
        if (L->norm3) {  /* Gemma: the attention output normed, then x += it and the MLP's own input norm */
            ip_rms_norm(delta, NULL, b, hidden, L->norm2, eps, delta);
            ip_rms_norm(x, delta, b, hidden, L->norm3, eps, h);
        } else {
            ip_rms_norm(x, delta, b, hidden, L->norm2, eps, h);  /* x += attn; h = norm(x) */
        }
        if (L->moe) rc = moe_mlp(h, b, hidden, L->moe, gelu, delta);
        else rc = layer_linear(h, b, hidden, hidden, L->w[2], L->s[2], L->bits[2], L->bias[2], 2 * inter, wide, 2 * inter);
    }
    if (rc == 0 && !L->moe) {
        if (gelu) ip_gelu_mul(wide, b, inter, narrow);
        else ip_silu_mul(wide, b, inter, narrow);
        rc = layer_linear(narrow, b, inter, inter, L->w[3], L->s[3], L->bits[3], L->bias[3], hidden, delta, hidden);
    }
    if (rc == 0) {
        if (L->norm4) ip_rms_norm(delta, NULL, b, hidden, L->norm4, eps, delta);
        for (int64_t i = 0; i < b * hidden; i++) x[i] += delta[i];
    }
    return rc;
}

/* What may follow the last layer in the same call (model/llama.py's final norm and head, as
 * forward_and_logits runs them op by op): x normed in place by `norm` (NULL: left as the last layer's
 * output), then, where head.w is set, logits [b, head.n] = x @ head (the kernel head.s/bits name)
 * and, where argmax is set, each row's argmax of them (ip_argmax_rows: what greedy sampling takes,
 * read while the logits are still in cache; Gemma 3's are 1 MB a row). */
typedef struct {
    const float *norm;
    float eps;
    ip_linear head;
    float *logits;
    int64_t *argmax;
} ip_decode_tail;

/* What the first layer reads, looked up inside the call where `inputs` is given: each row's token
 * embedding (times `scale` where it is not 0, Gemma's multiplier as float32) into x, and each rope's
 * rows for the step's positions from its whole tables [max_positions, d]. Why: done in PyTorch
 * before the call, the three lookups (an embedding and two indexings) ran with caches the last
 * step's weights had swept, about 0.09 ms of SmolLM2's batch-1 step and 0.2 ms of Gemma 3's; the
 * copies are the same values. */
typedef struct {
    const int64_t *token_ids, *positions;
    const float *embedding; /* [vocab, hidden] */
    float scale;
    const float *cos[2], *signed_sin[2]; /* the model's rope, then the sliding layers' own (or again the model's) */
    int64_t vocab, max_positions;        /* the tables' rows: an id or position outside them is refused (-3) */
} ip_decode_inputs;

/* x [b, hidden] and each rope's rows [b, d] (into rows [4, b, d]: cos and signed sin of the model's
 * rope, then of the sliding layers') as `inputs` names them; -3 (nothing written) where a token id or
 * position is outside its table, else 0. */
static int look_up_inputs(const ip_decode_inputs *inputs, int64_t b, int64_t hidden, int64_t d, float *x, float *rows,
                          ip_rope looked_up[2]) {
    for (int64_t r = 0; r < b; r++)
        if (inputs->token_ids[r] < 0 || inputs->token_ids[r] >= inputs->vocab || inputs->positions[r] < 0
            || inputs->positions[r] >= inputs->max_positions)
            return -3;
    for (int64_t r = 0; r < b; r++) {
        const float *e = inputs->embedding + inputs->token_ids[r] * hidden;
        float *xr = x + r * hidden;
        if (inputs->scale != 0.0f)
            for (int64_t j = 0; j < hidden; j++) xr[j] = e[j] * inputs->scale;
        else
            memcpy(xr, e, sizeof(float) * (size_t)hidden);
    }
    for (int rope = 0; rope < 2; rope++) {
        float *cos = rows + 2 * rope * b * d, *sin = cos + b * d;
        for (int64_t r = 0; r < b; r++) {
            memcpy(cos + r * d, inputs->cos[rope] + inputs->positions[r] * d, sizeof(float) * (size_t)d);
            memcpy(sin + r * d, inputs->signed_sin[rope] + inputs->positions[r] * d, sizeof(float) * (size_t)d);
        }
        looked_up[rope].cos = cos;
        looked_up[rope].signed_sin = sin;
    }
    return 0;
}

/* n_layers consecutive decoder layers for b decode rows, one call per decode step instead of ~10 per
 * layer: from Python each call cost tens of microseconds of argument handling, which for SmolLM2 at
 * batch 1 was a third of the step. Every layer reads the step's rope tables and attention view its
 * entry names (ropes[2], views[2]: the model's and the sliding layers'). `gelu`: the MLP is GeGLU
 * (tanh), else SwiGLU. `tail` (or NULL): the final norm and head after the last layer; each PyTorch
 * op between two C calls ran with caches the weights had just swept (SmolLM2's final norm took
 * 0.15 ms after the layers, 0.02 ms warm), so the step's ends run here too. `inputs` (or NULL):
 * x and the rope rows are looked up here (ropes is then not read). Returns 0, -1 where this build has
 * no int8 kernel, -2 when out of memory, -3 where a token id or position is outside its table (x and
 * the caches untouched). */
int ip_decode_layers(float *x, int64_t b, int64_t hidden, const ip_layer_weights *layers, int64_t n_layers,
                     float eps, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const ip_rope *ropes,
                     const ip_attn_view *views, int64_t block_size, float scale, int half, int gelu,
                     const ip_decode_tail *tail, const ip_decode_inputs *inputs) {
    if (!(ip_features() & IP_FEATURE_INT8_LINEAR)) return -1;
    const int64_t qkv_width = (heads + 2 * kv_heads) * d;
    const int64_t widest = qkv_width > 2 * inter ? qkv_width : 2 * inter;
    float *h = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    float *wide = (float *)malloc(sizeof(float) * (size_t)(b * widest));
    float *narrow = (float *)malloc(sizeof(float) * (size_t)(b * (inter > heads * d ? inter : heads * d)));
    float *delta = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    float *rows = inputs ? (float *)malloc(sizeof(float) * (size_t)(4 * b * d)) : NULL; /* the ropes' rows */
    int rc = (!h || !wide || !narrow || !delta || (inputs && !rows)) ? -2 : 0;
    ip_rope looked_up[2];
    if (rc == 0 && inputs) {
        rc = look_up_inputs(inputs, b, hidden, d, x, rows, looked_up);
        ropes = looked_up;
    }
    for (int64_t l = 0; rc == 0 && l < n_layers; l++)
        rc = decode_layer(x, b, hidden, layers + l, eps, heads, kv_heads, d, inter, ropes, views, block_size, scale,
                          half, gelu, h, wide, narrow, delta);
    free(h); free(wide); free(narrow); free(delta); free(rows);
    if (rc == 0 && tail && tail->norm) ip_rms_norm(x, NULL, b, hidden, tail->norm, tail->eps, x);
    if (rc == 0 && tail && tail->head.w) rc = run_linear(x, b, hidden, &tail->head, tail->logits);
    if (rc == 0 && tail && tail->head.w && tail->argmax)
        ip_argmax_rows(tail->logits, b, tail->head.n, tail->head.n, tail->argmax);
    return rc;
}

/* Up to `steps` greedy decode steps of b rows in one call: ip_decode_layers, then each row's argmax
 * becomes its next token, at the next position, in the next slot of the block its first token went
 * to, with one more token of context in each pool's view. tokens [steps, b] gets each step's argmax.
 * The call ends after the first step in which any row's token is one of stop_ids [n_stop] (a stop
 * token or EOS of some row): single steps would run without that row from there on, and the attention
 * splits a context by the number of rows, so the other rows' next steps are not this call's to run.
 * Needs `inputs` (the call looks the tokens up) and a tail with the head and argmax; every step's
 * slot must lie in the block the row's first token went to (the caller keeps a burst inside it, so
 * no block is allocated or freed in it): -4 where one would not, nothing of that step written.
 * Returns the steps run (>= 1), or a negative error (-2 or -4 here, or ip_decode_layers'). Why: a
 * batch-1 step's Python (scheduling, the step's inputs, appending the token) took 0.27-0.33 ms of
 * SmolLM2's 2.5 ms step, and each step's C call started with caches the Python had disturbed; here
 * the engine's Python runs once per burst. ropes: not read (the rows are looked up). */
int ip_decode_steps(float *x, int64_t b, int64_t hidden, const ip_layer_weights *layers, int64_t n_layers,
                    float eps, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const ip_attn_view *views,
                    int64_t block_size, float scale, int half, int gelu, const ip_decode_tail *tail,
                    const ip_decode_inputs *inputs, int64_t steps, const int64_t *stop_ids, int64_t n_stop,
                    int64_t *tokens) {
    if (!inputs || !tail || !tail->head.w || !tail->argmax || steps < 1) return -4;
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(6 * b));
    if (!ids) return -2;
    int64_t *positions = ids + b, *slots = ids + 2 * b, *lens = ids + 4 * b; /* slots and lens: per view */
    ip_decode_inputs looked = *inputs;
    ip_attn_view own[2];
    memcpy(ids, inputs->token_ids, sizeof(int64_t) * (size_t)b);
    memcpy(positions, inputs->positions, sizeof(int64_t) * (size_t)b);
    for (int v = 0; v < 2; v++) {
        own[v] = views[v];
        memcpy(slots + v * b, views[v].slots, sizeof(int64_t) * (size_t)b);
        memcpy(lens + v * b, views[v].context_lens, sizeof(int64_t) * (size_t)b);
        own[v].slots = slots + v * b;
        own[v].context_lens = lens + v * b;
    }
    looked.token_ids = ids;
    looked.positions = positions;
    int rc = 0;
    int64_t s = 0;
    for (; rc == 0 && s < steps; s++) {
        if (s > 0) {
            for (int64_t r = 0; rc == 0 && r < b; r++) {
                for (int v = 0; v < 2; v++) {
                    /* the new token's place in the view, in the block of the burst's first token (which
                     * its table holds, so no width check is needed) */
                    const int64_t at = lens[v * b + r];
                    if (at / block_size != (at - s) / block_size) {
                        rc = -4;
                        break;
                    }
                }
            }
            if (rc != 0) break;
            for (int64_t r = 0; r < b; r++) {
                ids[r] = tail->argmax[r];
                positions[r] += 1;
                for (int v = 0; v < 2; v++) {
                    const int64_t at = lens[v * b + r]++;
                    const int64_t block = own[v].block_tables[r * own[v].max_blocks + at / block_size];
                    slots[v * b + r] = block * block_size + at % block_size;
                }
            }
        }
        rc = ip_decode_layers(x, b, hidden, layers, n_layers, eps, heads, kv_heads, d, inter, NULL, own, block_size,
                              scale, half, gelu, tail, &looked);
        if (rc != 0) break;
        memcpy(tokens + s * b, tail->argmax, sizeof(int64_t) * (size_t)b);
        int stopped = 0;
        for (int64_t r = 0; r < b && !stopped; r++)
            for (int64_t i = 0; i < n_stop && !stopped; i++) stopped = tail->argmax[r] == stop_ids[i];
        if (stopped) {
            s++;
            break;
        }
    }
    free(ids);
    return rc != 0 ? rc : (int)s;
}
