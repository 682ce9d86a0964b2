/* Rotary position embedding of q and k, and the step's k and v stored into the paged cache.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"
#include "kv_cache.h"

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
