/* Paged decode attention: one query token per sequence against its KV rows where they lie in the
 * paged cache, so no gather copies the context first.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"
#include "kv_cache.h"

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

/* Tokens per part at least: a context is split only where each part reads this many (a batch's
 * rows already fill the threads; splitting a 600-token context four ways cost a batch of 16 a
 * fifth more, in merges and tasks). */
#define PART_MIN_TOKENS 256

/* How many parts a query's context is split into: a function of its own length (and the thread
 * count) alone, never of the batch, so that a row's result is the same bits whatever else the step
 * runs (a seeded request's draws, and a speculative draft's verification rows, depend on it). */
static int64_t parts_for(int64_t len, int64_t threads) {
    int64_t parts = len / PART_MIN_TOKENS;
    if (parts > 2 * threads) parts = 2 * threads;
    return parts < 2 ? 1 : parts;
}

/* q [b, heads, d] (rows q_stride apart) attends to its sequence's first context_lens[i] tokens in
 * k_cache / v_cache [blocks, block_size, kv_heads, d], found through block_tables [b, max_blocks].
 * out [b, heads, d] (rows out_stride apart). A task is one sequence and all its heads, so each
 * token's keys (and values) are read as one contiguous row of kv_heads * d floats (split by KV head,
 * threads each read a part of every row and the KV reads ran at half the memory bandwidth). A
 * context long enough (parts_for) is split into parts of its tokens (every head), merged after
 * (merge_parts): each thread reads its own rows once, where a task per query head made threads read
 * the rows their heads share (all of them for Gemma 3's one KV head). With fewer sequences than two
 * per thread, an unsplit context is a task per query head, so that a batch of one still keeps both
 * threads busy (by KV head, three tasks on two threads left one idle a third of the time); heads
 * are independent sums, so that choice changes no bits. `window` > 0 (a sliding layer): each query
 * reads only its context's last `window` tokens. `softcap` > 0 (Gemma 2): scores become
 * softcap * tanh(score / softcap) before the softmax. */
int ip_paged_decode_attention(const float *q, int64_t q_stride, int64_t b, int64_t heads, int64_t kv_heads,
                              int64_t d, const void *k_cache, const void *v_cache, int64_t block_size,
                              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                              float scale, float *out, int64_t out_stride, int half, int64_t window,
                              float softcap) {
    if (half && !IP_HALF_KV) return -1;
    const int64_t group = heads / kv_heads;
    const int64_t row = kv_heads * d;  /* floats per token in the cache */
    const int64_t threads = omp_get_max_threads();
    const int64_t splits = b < 2 * threads ? heads : 1; /* tasks of an unsplit context */
    /* per sequence: its parts, its first task and (split ones) its first part in po */
    int64_t *plan = (int64_t *)malloc(sizeof(int64_t) * (size_t)(3 * b + 1));
    if (!plan) return -2;
    int64_t longest = 0, tasks = 0, split_parts = 0;
    for (int64_t i = 0; i < b; i++) {
        const int64_t len = window > 0 && context_lens[i] > window ? window : context_lens[i];
        longest = len > longest ? len : longest;
        const int64_t parts = parts_for(len, threads);
        plan[3 * i] = parts;
        plan[3 * i + 1] = tasks;
        plan[3 * i + 2] = split_parts;
        tasks += parts > 1 ? parts : splits;
        if (parts > 1) split_parts += parts;
    }
    float *po = NULL, *pstats = NULL;
    if (split_parts) {
        po = (float *)malloc(sizeof(float) * (size_t)(split_parts * heads * d));
        pstats = (float *)malloc(sizeof(float) * (size_t)(split_parts * heads * 2));
        if (!po || !pstats) {
            free(po); free(pstats); free(plan);
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
        int64_t seq = 0;      /* the sequence of the task, found by walking forward (tasks come in order) */
#pragma omp for schedule(static)
        for (int64_t task = 0; task < tasks; task++) {
            if (!scores || !offs || !sums) continue;
            if (task < plan[3 * seq + 1]) seq = 0;
            while (seq + 1 < b && plan[3 * (seq + 1) + 1] <= task) seq++;
            const int64_t parts = plan[3 * seq], local = task - plan[3 * seq + 1];
            const int64_t split = parts > 1 ? 0 : local, part = parts > 1 ? local : 0;
            const int64_t own_splits = parts > 1 ? 1 : splits;
            const int64_t qa = split * heads / own_splits, qb = (split + 1) * heads / own_splits;
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
            float *o = parts > 1 ? po + (plan[3 * seq + 2] + part) * heads * d : out + seq * out_stride;
            float *st = parts > 1 ? pstats + (plan[3 * seq + 2] + part) * heads * 2 : sums;
            if (half)
                attend(q + seq * q_stride, qa, qb, group, d, k_cache, v_cache, offs + ta, tb - ta, scale, softcap,
                       scores, o, st, 1);
            else
                attend(q + seq * q_stride, qa, qb, group, d, k_cache, v_cache, offs + ta, tb - ta, scale, softcap,
                       scores, o, st, 0);
            if (parts == 1) scale_by_sums(o, st, qa, qb, d);
        }
        if (split_parts && !failed) {
#pragma omp for schedule(static)
            for (int64_t task = 0; task < b * heads; task++) {
                const int64_t i = task / heads, h = task % heads;
                if (plan[3 * i] > 1)
                    merge_parts(po + plan[3 * i + 2] * heads * d, pstats + plan[3 * i + 2] * heads * 2, plan[3 * i],
                                heads, d, h, out + i * out_stride + h * d);
            }
        }
        free(scores);
        free(offs);
        free(sums);
    }
    free(po); free(pstats); free(plan);
    return failed ? -2 : 0;
}
