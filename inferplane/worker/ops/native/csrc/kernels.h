/* The ops' entry points, which bindings.py binds and decode_layers.c composes into a decoder layer
 * (the layer's own two, ip_decode_layers and ip_decode_steps, are defined in decode_layers.c with
 * the structures they read), and the bits ip_features reports (bindings.py's _FEATURE_*). Each part
 * defines its own; declared here so that any part may call another's, and the compiler checks every
 * definition against its declaration. */
#ifndef IP_KERNELS_H
#define IP_KERNELS_H

#include <stdint.h>

/* ip_features: which kernels this build has (the others return -1) */
#define IP_FEATURE_INT8_LINEAR 1
#define IP_FEATURE_F32_LINEAR 2
#define IP_FEATURE_BLOCK_LINEAR 4
#define IP_FEATURE_HALF_KV 8

/* int8_linear.c */
int ip_int8_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, const float *wscale,
                   const float *bias, int64_t n, float *out, int64_t ldo);
void ip_int8_dequantize(const uint8_t *w, int64_t n, int64_t k, const float *wscale, float *out);

/* block_linear.c */
int ip_block_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int bits,
                    const float *bias, int64_t n, float *out, int64_t ldo);
void ip_block_dequantize(const uint8_t *w, int bits, int64_t n, int64_t k, float *out);

/* f32_linear.c */
int ip_f32_linear(const float *x, int64_t m, int64_t k, int64_t ldx, const float *w, const float *bias, int64_t n,
                  float *out, int64_t ldo);

/* attention.c */
int ip_paged_decode_attention(const float *q, int64_t q_stride, int64_t b, int64_t heads, int64_t kv_heads,
                              int64_t d, const void *k_cache, const void *v_cache, int64_t block_size,
                              const int64_t *block_tables, int64_t max_blocks, const int64_t *context_lens,
                              float scale, float *out, int64_t out_stride, int half, int64_t window,
                              float softcap);

/* norm.c */
void ip_rms_norm(float *x, const float *delta, int64_t m, int64_t k, const float *weight, float eps, float *out);

/* activation.c */
void ip_silu_mul(const float *gate_up, int64_t m, int64_t inter, float *out);
void ip_gelu_mul(const float *gate_up, int64_t m, int64_t inter, float *out);

/* moe_route.c */
int ip_moe_route(const float *logits, int64_t m, int64_t e, int64_t k, int normalize, float *weights,
                 int64_t *ids);

/* argmax.c */
void ip_argmax_rows(const float *x, int64_t m, int64_t n, int64_t ldx, int64_t *out);
/* Row i of ip_sample_rows (what a decode burst's tail draws its sampled rows with). */
void ip_sample_row(const float *logits, int64_t n, int64_t ld, const float *temperature, const int64_t *top_k,
                   const float *top_p, const float *min_p, const double *uniform, float *weights, int64_t *out,
                   int64_t i);
void ip_sample_rows(const float *logits, int64_t m, int64_t n, int64_t ld, const float *temperature,
                    const int64_t *top_k, const float *top_p, const float *min_p, const double *uniform,
                    float *weights, int64_t *out);

/* rope.c */
int ip_rope_store_kv(float *qkv, int64_t t, int64_t heads, int64_t kv_heads, int64_t d, const float *cos,
                     const float *signed_sin, const int64_t *slots, void *k_cache, void *v_cache, int f16);

/* features.c */
int ip_features(void);
const char *ip_isa(void);

#endif /* IP_KERNELS_H */
