/* What every part of the kernels shares: the C headers, the instruction set this build's code is
 * written for (IP_AVX512, IP_AVX2, IP_AVX2_VNNI, IP_INT8, IP_VECTOR: from the compiler's flags, which
 * native/build.py ISA_BUILDS sets), the float vector layer (vf_*) each ISA defines and the float
 * kernels are written over, and FOR_ROWS, how the small row-wise ops spread rows over threads. */
#ifndef IP_COMMON_H
#define IP_COMMON_H

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

/* Four bytes at p as one int32, wherever p is aligned: what the int8 and block kernels broadcast, four
 * inputs at a time. */
static inline int32_t load_i32(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Each small op between the matmuls (norm.c, activation.c, argmax.c, rope.c) replaces several eager
 * PyTorch ops (RMSNorm alone was eight, about 45 us per call at one row, where the arithmetic takes
 * one or two). Rows are independent; threads only from 8 rows (argmax: 4). */

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

#endif /* IP_COMMON_H */
