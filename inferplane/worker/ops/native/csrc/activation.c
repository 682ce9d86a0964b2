/* The gated MLP's activation: SwiGLU's silu(gate) * up and GeGLU's gelu(gate) * up.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"

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
