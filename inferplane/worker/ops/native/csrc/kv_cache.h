/* Reading and writing the paged KV cache's rows, float32 or float16: what attention.c reads and
 * rope.c stores. */
#ifndef IP_KV_CACHE_H
#define IP_KV_CACHE_H

#include "common.h"

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

#endif /* IP_KV_CACHE_H */
