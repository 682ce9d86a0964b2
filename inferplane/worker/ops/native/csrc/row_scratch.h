/* The int8 and block kernels' per-thread scratch for their quantized input rows. One translation
 * unit (kernels.c) includes this once, so both kernels share one scratch per thread. */
#ifndef IP_ROW_SCRATCH_H
#define IP_ROW_SCRATCH_H

#include "common.h"

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

#endif /* IP_ROW_SCRATCH_H */
