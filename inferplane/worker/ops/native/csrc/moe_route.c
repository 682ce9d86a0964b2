/* A Mixture-of-Experts router's top-k choice of experts.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"

/* A Mixture-of-Experts router's choice for each of m rows of logits [m, e]: softmax over the e
 * experts, the k most probable (the first of equal ones), most probable first, into ids [m, k] and
 * weights [m, k], renormalised to sum to 1 where `normalize` says so (Mixtral; Qwen3-MoE by
 * norm_topk_prob). The MoE layer's Python (model/moe.py) calls this on the CPU too, so the fused
 * decode and the layers op by op route with the same bits. Returns 0, -1 where k is not in [1, e],
 * -2 when out of memory. */
int ip_moe_route(const float *logits, int64_t m, int64_t e, int64_t k, int normalize, float *weights,
                 int64_t *ids) {
    if (k < 1 || k > e) return -1;
    float *probs = (float *)malloc(sizeof(float) * (size_t)e);
    unsigned char *taken = (unsigned char *)malloc((size_t)e);
    if (!probs || !taken) {
        free(probs); free(taken);
        return -2;
    }
    for (int64_t r = 0; r < m; r++) {
        const float *row = logits + r * e;
        float top = row[0];
        for (int64_t j = 1; j < e; j++) top = row[j] > top ? row[j] : top;
        float total = 0.0f;
        for (int64_t j = 0; j < e; j++) {
            probs[j] = expf(row[j] - top);
            total += probs[j];
            taken[j] = 0;
        }
        for (int64_t j = 0; j < e; j++) probs[j] /= total;
        float chosen = 0.0f;
        for (int64_t t = 0; t < k; t++) {
            int64_t best = -1;
            for (int64_t j = 0; j < e; j++)
                if (!taken[j] && (best < 0 || probs[j] > probs[best])) best = j;
            taken[best] = 1;
            ids[r * k + t] = best;
            weights[r * k + t] = probs[best];
            chosen += probs[best];
        }
        for (int64_t t = 0; normalize && t < k; t++) weights[r * k + t] /= chosen;
    }
    free(probs); free(taken);
    return 0;
}
