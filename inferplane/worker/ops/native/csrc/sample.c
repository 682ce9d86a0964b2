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
 *  4. top-p: the nucleus is the smallest set of best tokens whose mass reaches top_p x W. Every token
 *     with w < (1 - top_p) W / n (n: the survivors) is outside it, since all such tokens together
 *     weigh less than (1 - top_p) W and each has only worse tokens after it; so only the few tokens
 *     above that bound are sorted; where they are many (a flat distribution), the nucleus is the
 *     tokens at or above the weight threshold, found by bisection, whose mass first reaches top_p W
 *     (tokens tied within float precision at the threshold are all kept);
 *  5. one uniform u in (0, 1] per row (the caller's, drawn from the request's own key and the
 *     token's position: the same draws whatever shares the batch) picks the token whose cumulative
 *     weight first reaches u x W': inverse-CDF sampling, exact for the filtered distribution.
 * Sums in double, so a 262k-entry row adds up without losing its tail. */
#include <float.h>

#include "common.h"
#include "kernels.h"

#define HEAP_K 1024  /* top-k above this: quickselect on a copy instead of a heap */
#define SORT_CANDIDATES 4096  /* top-p: above this many candidates, a threshold by bisection instead of a sort */

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

/* Row i: see the file's comment. out[i] is -1 where memory for the nucleus ran out. */
static void sample_row(const float *logits, int64_t n, int64_t ld, const float *temperature, const int64_t *top_k,
                      const float *top_p, const float *min_p, const double *uniform, float *weights, int64_t *out,
                      int64_t i) {
    const float *row = logits + i * ld;
    float *w = weights + i * n;
    /* 1. the maximum (a NaN row has no distribution: its first NaN, as argmax answers) */
    float top = -INFINITY;
    int64_t j = 0;
#if IP_VECTOR
    vf acc = vf_set1(-INFINITY);
    for (; j + VF_WIDTH <= n; j += VF_WIDTH) acc = vf_max(acc, vf_load(row + j));
    top = vf_reduce_max(acc);
#endif
    for (; j < n; j++) top = row[j] > top ? row[j] : top;
    for (j = 0; j < n; j++) {
        if (row[j] != row[j]) {
            out[i] = j;
            return;
        }
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
    /* 3. the weights of what is kept, and their sum */
    if (floor < -FLT_MAX) floor = -FLT_MAX;  /* a masked (-inf) logit is always out: weight exactly 0 */
    const float inv_t = 1.0f / t;
    double total = 0.0;
    int64_t kept = 0;
    j = 0;
#if IP_VECTOR
    const vf vtop = vf_set1(top), vinv = vf_set1(inv_t);
    for (; j + VF_WIDTH <= n; j += VF_WIDTH) {
        vf_store(w + j, vf_exp(vf_mul(vf_sub(vf_load(row + j), vtop), vinv)));
        float part = 0.0f;
        for (int q = 0; q < VF_WIDTH; q++) {  /* vf_exp clamps its input: below the floor is set to 0 here */
            if (row[j + q] < floor) w[j + q] = 0.0f;
            else kept++;
            part += w[j + q];
        }
        total += part;
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
        const float bound = (float)((1.0 - top_p[i]) * total / (double)kept);
        int64_t count = 0;
        for (j = 0; j < n; j++) count += w[j] > 0.0f && w[j] >= bound;
        ip_weighted *cand = malloc((size_t)count * sizeof *cand);
        if (cand == NULL) {
            out[i] = -1;
            return;
        }
        int64_t c = 0;
        for (j = 0; j < n; j++)
            if (w[j] > 0.0f && w[j] >= bound) cand[c++] = (ip_weighted){w[j], (int32_t)j};
        const double want = top_p[i] * total;
        double mass = 0.0;
        int64_t in = 0;
        if (count <= SORT_CANDIDATES) {  /* few (a peaked distribution): sorted, the exact smallest set */
            qsort(cand, (size_t)count, sizeof *cand, by_weight_descending);
            while (in < count && mass < want) mass += cand[in++].w;
        } else {  /* many (a flat one): the weight threshold whose tokens first reach the mass, by bisection */
            float lo = bound, hi = 1.0f;  /* the top token's weight is 1: at least one token is kept */
            for (int step = 0; step < 32 && lo < hi; step++) {
                const float mid = lo + (hi - lo) * 0.5f;
                if (mid <= lo || mid >= hi) break;
                double above = 0.0;
                for (int64_t q = 0; q < count; q++) above += cand[q].w >= mid ? cand[q].w : 0.0f;
                if (above >= want) lo = mid;
                else hi = mid;
            }
            for (int64_t q = 0; q < count; q++)  /* keep those at or above lo, in vocabulary order */
                if (cand[q].w >= lo) {
                    cand[in++] = cand[q];
                    mass += cand[q].w;
                }
        }
        /* 5. the draw, over the nucleus */
        const double target = u * mass;
        double sum = 0.0;
        int64_t pick = cand[in - 1].id;
        for (int64_t q = 0; q < in; q++) {
            sum += cand[q].w;
            if (sum >= target) {
                pick = cand[q].id;
                break;
            }
        }
        free(cand);
        out[i] = pick;
        return;
    }
    /* 5. the draw, over every kept token */
    const double target = u * total;
    double sum = 0.0;
    int64_t last = -1;
    for (j = 0; j < n; j++) {
        if (w[j] <= 0.0f) continue;
        last = j;
        sum += w[j];
        if (sum >= target) break;
    }
    out[i] = last >= 0 ? last : 0;
}

/* logits [m, n] (rows ld apart), per row its temperature (> 0), top_k (<= 0: off), top_p (1: off),
 * min_p (0: off) and uniform draw in (0, 1]; weights: [m, n] scratch. out [m]: the tokens; -1 for a
 * row whose nucleus found no memory. */
void ip_sample_rows(const float *logits, int64_t m, int64_t n, int64_t ld, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p, const double *uniform,
                    float *weights, int64_t *out) {
    FOR_ROWS(m, 4, sample_row(logits, n, ld, temperature, top_k, top_p, min_p, uniform, weights, out, i));
}
