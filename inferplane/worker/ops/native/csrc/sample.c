/* Sampling a token per row from temperature-scaled, top-k / top-p / min-p filtered logits, without
 * sorting the vocabulary.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone.
 *
 * What PyTorch's path did per sampled row (engine/sampling.py's reference): sort the whole
 * vocabulary (49k or 262k entries), softmax, cumulative sum, one exponential draw per entry from the
 * request's generator. Here, per row:
 *  1. the maximum m (one vector pass);
 *  2. top-k: the k-th largest logit, by a min-heap of k values over the row (a pass that mostly
 *     compares against the heap's top), quickselect on a copy for k above HEAP_K;
 *     min-p: every logit below m + T ln(min_p) is out (its probability is below min_p x the top's);
 *  3. the weights w = exp((l - m) / T) of what survives, and their sum W (a vector pass);
 *  4. top-p: the nucleus is the smallest set of best tokens whose mass reaches top_p x W: a
 *     histogram of the weights by their top bits finds the bucket it ends in, and only that
 *     bucket's tokens are sorted (nucleus_draw);
 *  5. one uniform u in (0, 1] per row (the caller's, drawn from the request's own key and the
 *     token's position: the same draws whatever shares the batch) picks the token whose cumulative
 *     weight first reaches u x W': inverse-CDF sampling, exact for the filtered distribution.
 * Sums in double, so a 262k-entry row adds up without losing its tail. */
#include <float.h>

#include "common.h"
#include "kernels.h"

#define HEAP_K 1024  /* top-k above this: quickselect on a copy instead of a heap */
#define SORT_CANDIDATES 4096  /* top-p: a crossing bucket with more tokens than this is split again */

typedef struct {
    float w;
    int32_t id;
} ip_weighted;

static void heap_sift_down(float *heap, int64_t k, int64_t i) {
    for (;;) {
        int64_t smallest = i, l = 2 * i + 1, r = l + 1;
        if (l < k && heap[l] < heap[smallest]) smallest = l;
        if (r < k && heap[r] < heap[smallest]) smallest = r;
        if (smallest == i) return;
        const float t = heap[i];
        heap[i] = heap[smallest];
        heap[smallest] = t;
        i = smallest;
    }
}

/* The k-th largest of row[0..n) (1 <= k < n), NaN-free input. */
static float kth_largest(const float *row, int64_t n, int64_t k, float *scratch) {
    if (k <= HEAP_K) {
        float heap[HEAP_K];
        for (int64_t j = 0; j < k; j++) heap[j] = row[j];
        for (int64_t j = k / 2 - 1; j >= 0; j--) heap_sift_down(heap, k, j);
        for (int64_t j = k; j < n; j++) {
            if (row[j] > heap[0]) {
                heap[0] = row[j];
                heap_sift_down(heap, k, 0);
            }
        }
        return heap[0];
    }
    /* Quickselect (Hoare) for the element of rank k - 1 in descending order. */
    memcpy(scratch, row, (size_t)n * sizeof(float));
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        const float pivot = scratch[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (scratch[i] > pivot) i++;
            while (scratch[j] < pivot) j--;
            if (i <= j) {
                const float t = scratch[i];
                scratch[i] = scratch[j];
                scratch[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else break;
    }
    return scratch[want];
}

static int by_weight_descending(const void *a, const void *b) {
    const float x = ((const ip_weighted *)a)->w, y = ((const ip_weighted *)b)->w;
    return (x < y) - (x > y);
}

/* A positive float's bits order as the float does: its top bits bucket weights by size. */
static inline uint32_t weight_bits(float w) {
    uint32_t bits;
    memcpy(&bits, &w, sizeof bits);
    return bits;
}

/* Mask of the lanes of v at or above `low` (a NaN is below), one bit a lane. */
#if IP_AVX512
static inline uint32_t lanes_at_least(vf v, vf low) { return _mm512_cmp_ps_mask(v, low, _CMP_GE_OQ); }
static inline vf keep_lanes(vf v, uint32_t mask) { return _mm512_maskz_mov_ps((__mmask16)mask, v); }
#elif IP_AVX2
static inline uint32_t lanes_at_least(vf v, vf low) {
    return (uint32_t)_mm256_movemask_ps(_mm256_cmp_ps(v, low, _CMP_GE_OQ));
}
static inline vf keep_lanes(vf v, uint32_t mask) {
    const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)mask), bits), bits);
    return _mm256_and_ps(v, _mm256_castsi256_ps(set));
}
#endif

/* The tokens whose weight is at least `low` (and above 0), in vocabulary order, into cand; their count. */
static int64_t gather_at_least(const float *w, int64_t n, float low, ip_weighted *cand) {
    int64_t c = 0, j = 0;
#if IP_VECTOR
    const vf vlow = vf_set1(low > 0.0f ? low : FLT_MIN);
    for (; j + VF_WIDTH <= n; j += VF_WIDTH) {
        uint32_t mask = lanes_at_least(vf_load(w + j), vlow);
        while (mask) {
            const int q = __builtin_ctz(mask);
            cand[c++] = (ip_weighted){w[j + q], (int32_t)(j + q)};
            mask &= mask - 1;
        }
    }
#endif
    for (; j < n; j++)
        if (w[j] > 0.0f && w[j] >= low) cand[c++] = (ip_weighted){w[j], (int32_t)j};
    return c;
}

/* The top-p draw over weights w [n] (0: out) summing to `total` (kept of them above 0): the nucleus
 * is the smallest set of the heaviest tokens whose weight reaches top_p x total, found without
 * sorting the row. Every token below (1 - top_p) x total / kept is outside it (all of them together
 * weigh less than the tail the nucleus leaves out, and each has only lighter tokens after it), so
 * only the tokens above that bound are gathered, in vocabulary order. A histogram of their weights
 * by the top bits (exponent and 3 mantissa bits: 1,024 buckets, a factor of 1.09 apart) says which
 * bucket the nucleus ends in: every token of the buckets above is in it, and only that bucket's
 * tokens are sorted (where they are more than SORT_CANDIDATES, a flat row, a second histogram by the
 * next 12 bits narrows them first). Then the draw at `u`, by inverse CDF over the nucleus in
 * vocabulary order, as the torch path's cumulative sum over the masked row draws. */
static int64_t nucleus_draw(const float *w, int64_t n, double total, int64_t kept, float top_p, double u) {
    enum { B1 = 1024, B2 = 4096 };
    ip_weighted *all = malloc((size_t)n * sizeof *all);
    if (all == NULL) return -1;
    const int64_t count_all = gather_at_least(w, n, (float)((1.0 - top_p) * total / (double)kept), all);
    double mass1[B1] = {0};
    int64_t count1[B1] = {0};
    for (int64_t q = 0; q < count_all; q++) {
        const uint32_t key = weight_bits(all[q].w) >> 20;
        mass1[key] += all[q].w;
        count1[key]++;
    }
    const double want = top_p * total;
    double above = 0.0;
    int64_t b1 = B1 - 1;
    while (b1 > 0 && above + mass1[b1] < want) above += mass1[b1--];
    const int use2 = count1[b1] > SORT_CANDIDATES;  /* within bucket b1: a second level where it is crowded */
    int64_t b2 = B2 - 1;
    if (use2) {
        double *mass2 = calloc(B2, sizeof(double));
        if (mass2 == NULL) {
            free(all);
            return -1;
        }
        for (int64_t q = 0; q < count_all; q++) {
            const uint32_t bits = weight_bits(all[q].w);
            if ((int64_t)(bits >> 20) == b1) mass2[(bits >> 8) & (B2 - 1)] += all[q].w;
        }
        while (b2 > 0 && above + mass2[b2] < want) above += mass2[b2--];
        free(mass2);
    }
    /* the tokens of the crossing bucket, sorted, taken until the mass is reached */
    ip_weighted *cand = malloc((size_t)(count1[b1] > 0 ? count1[b1] : 1) * sizeof *cand);
    if (cand == NULL) {
        free(all);
        return -1;
    }
    int64_t count = 0;
    for (int64_t q = 0; q < count_all; q++) {
        const uint32_t bits = weight_bits(all[q].w);
        if ((int64_t)(bits >> 20) == b1 && (!use2 || (int64_t)((bits >> 8) & (B2 - 1)) == b2)) cand[count++] = all[q];
    }
    qsort(cand, (size_t)count, sizeof *cand, by_weight_descending);
    double mass = above;
    int64_t in = 0;
    while (in < count && mass < want) mass += cand[in++].w;
    if (in == 0) in = count > 0 ? 1 : 0;  /* rounding: at least the crossing bucket's heaviest */
    /* 5. the draw over the nucleus in vocabulary order: the tokens above the crossing bucket, and
     * those of it at or above the last one taken (of the ties at that weight, as many as were taken,
     * first in vocabulary order) */
    const float last = in > 0 ? cand[in - 1].w : INFINITY;
    int64_t ties = 0;
    for (int64_t q = 0; q < in; q++) ties += cand[q].w == last;
    const double target = u * mass;
    double sum = 0.0;
    int64_t pick = in > 0 ? cand[in - 1].id : (count_all > 0 ? all[0].id : 0);
    for (int64_t q = 0; q < count_all; q++) {
        const float wq = all[q].w;
        const uint32_t bits = weight_bits(wq);
        const int64_t k1 = bits >> 20, k2 = (bits >> 8) & (B2 - 1);
        const int above_it = k1 > b1 || (use2 && k1 == b1 && k2 > b2);
        const int in_it = k1 == b1 && (!use2 || k2 == b2);
        if (!(above_it || (in_it && (wq > last || (wq == last && ties-- > 0))))) continue;
        sum += wq;
        pick = all[q].id;
        if (sum >= target) break;
    }
    free(cand);
    free(all);
    return pick;
}

/* Row i: see the file's comment. out[i] is -1 where memory for the nucleus ran out. */
void ip_sample_row(const float *logits, int64_t n, int64_t ld, const float *temperature, const int64_t *top_k,
                   const float *top_p, const float *min_p, const double *uniform, float *weights, int64_t *out,
                   int64_t i) {
    const float *row = logits + i * ld;
    float *w = weights + i * n;
    /* 1. the maximum; a NaN row has no distribution: its first NaN, as argmax answers */
    float top = -INFINITY;
    int nan = 0;
    int64_t j = 0;
#if IP_VECTOR
    vf acc = vf_set1(-INFINITY);
    const vf lowest = vf_set1(-INFINITY);
    for (; j + VF_WIDTH <= n; j += VF_WIDTH) {
        const vf v = vf_load(row + j);
        acc = vf_max(acc, v);
        nan |= lanes_at_least(v, lowest) != (1u << VF_WIDTH) - 1;  /* a NaN fails every comparison */
    }
    top = vf_reduce_max(acc);
#endif
    for (; j < n; j++) {
        if (row[j] != row[j]) nan = 1;
        else if (row[j] > top) top = row[j];
    }
    if (nan) {
        j = 0;
        while (row[j] == row[j]) j++;
        out[i] = j;
        return;
    }
    if (top == -INFINITY) {  /* every token masked: nothing to draw from */
        out[i] = 0;
        return;
    }
    /* 2. the lowest logit kept */
    const float t = temperature[i];
    float floor = -INFINITY;
    if (top_k[i] > 0 && top_k[i] < n) floor = kth_largest(row, n, top_k[i], w);
    if (min_p[i] > 0.0f) {
        const float cut = top + t * logf(min_p[i]);
        floor = cut > floor ? cut : floor;
    }
    if (floor < -FLT_MAX) floor = -FLT_MAX;  /* a masked (-inf) logit is always out: weight exactly 0 */
    /* 3. the weights of what is kept, and their sum: block by block (a vector's lanes summed in float,
     * the blocks in double), the order the draw below adds them in */
    const float inv_t = 1.0f / t;
    double total = 0.0;
    int64_t kept = 0;
    j = 0;
#if IP_VECTOR
    const vf vtop = vf_set1(top), vinv = vf_set1(inv_t), vfloor = vf_set1(floor);
    for (; j + VF_WIDTH <= n; j += VF_WIDTH) {
        const vf l = vf_load(row + j);
        const uint32_t keep = lanes_at_least(l, vfloor);  /* vf_exp clamps its input: the rest set to 0 */
        const vf e = keep_lanes(vf_exp(vf_mul(vf_sub(l, vtop), vinv)), keep);
        vf_store(w + j, e);
        total += vf_reduce_add(e);
        kept += __builtin_popcount(keep);
    }
#endif
    for (; j < n; j++) {
        if (row[j] < floor) {
            w[j] = 0.0f;
            continue;
        }
        w[j] = expf((row[j] - top) * inv_t);
        total += w[j];
        kept++;
    }
    const double u = uniform[i];
    /* 4. the nucleus */
    if (top_p[i] < 1.0f && kept > 1) {
        out[i] = nucleus_draw(w, n, total, kept, top_p[i], u);
        return;
    }
    /* 5. the draw over every kept token: whole blocks while the target lies beyond them, then one
     * token at a time */
    const double target = u * total;
    double sum = 0.0;
    int64_t last = -1;
    j = 0;
#if IP_VECTOR
    for (; j + VF_WIDTH <= n; j += VF_WIDTH) {
        const float block = vf_reduce_add(vf_load(w + j));
        if (sum + block >= target) break;
        sum += block;
        if (block > 0.0f) last = j + VF_WIDTH - 1;
    }
#endif
    for (; j < n; j++) {
        if (w[j] <= 0.0f) continue;
        last = j;
        sum += w[j];
        if (sum >= target) break;
    }
    while (last >= 0 && w[last] <= 0.0f) last--;  /* a whole block passed: its last positive token */
    out[i] = last >= 0 ? last : 0;
}

/* logits [m, n] (rows ld apart), per row its temperature (> 0), top_k (<= 0: off), top_p (1: off),
 * min_p (0: off) and uniform draw in (0, 1]; weights: [m, n] scratch. out [m]: the tokens; -1 for a
 * row whose nucleus found no memory. */
void ip_sample_rows(const float *logits, int64_t m, int64_t n, int64_t ld, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p, const double *uniform,
                    float *weights, int64_t *out) {
    FOR_ROWS(m, 4, ip_sample_row(logits, n, ld, temperature, top_k, top_p, min_p, uniform, weights, out, i));
}
