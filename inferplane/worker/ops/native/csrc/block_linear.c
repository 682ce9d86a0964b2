/* Block linear: y = x @ W.T for a weight in GGUF's own blocks (4, 5, 6 or 8 bits), repacked once at
 * load time (pack_blocks), read without widening it to int8 or float first.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"
#include "row_scratch.h"

/* A GGUF weight in blocks of 32 inputs per output row, each a float16 scale d, a float16 minimum m
 * and 32 unsigned `bits`-bit values q: w = d * q + m. Bits 4 is GGUF's Q4_1 (and Q4_0, Q4_K exactly
 * or nearly turned into it, quant/gguf_blocks.py), bits 5 its Q5_1 (and Q5_0, Q5_K), bits 8 its Q8_0:
 * q + 128 with m = -128 d, which the kernel derives from d instead of reading it (1.0625 bytes a
 * weight, as the file; a fused group's Q4_0 and Q5_0 members move their values up the same way). The
 * input row is quantized the same way llama.cpp does for this product (Q8_1): per block of 32, int8
 * values with a scale dx and their scaled sum sx. Then
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
