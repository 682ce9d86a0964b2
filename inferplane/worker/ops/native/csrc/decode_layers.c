/* One whole decoder layer, and a decode step's layers, in one call: the other parts' ops composed in
 * the order the model's Python calls them, so the result is the same bits.
 * Part of kernels.c's one translation unit, which includes it; the headers named here make it
 * readable (and checkable) alone. */
#include "common.h"
#include "kernels.h"

/* One of the layer's linears: packed int8 with per-channel scales s, or (s NULL) GGUF blocks of `bits`
 * (4, 5, 6 or 8), or (bits IP_FLOAT32_BITS) a float32 weight [n, k] (a MoE router, which cpu-int8
 * keeps in float32 as llama.cpp's files keep it). */
#define IP_FLOAT32_BITS 32
static int layer_linear(const float *x, int64_t b, int64_t k, int64_t ldx, const uint8_t *w, const float *s,
                        int64_t bits, const float *bias, int64_t n, float *out, int64_t ldo) {
    if (s) return ip_int8_linear(x, b, k, ldx, w, s, bias, n, out, ldo);
    if (bits == IP_FLOAT32_BITS) return ip_f32_linear(x, b, k, ldx, (const float *)w, bias, n, out, ldo);
    return ip_block_linear(x, b, k, ldx, w, (int)bits, bias, n, out, ldo);
}

/* One linear of a layer, as layer_linear reads it; n outputs; bias or NULL. */
typedef struct {
    const uint8_t *w;
    const float *s, *bias;
    int64_t bits, n;
} ip_linear;

/* A Mixture-of-Experts MLP (model/moe.py): the router (hidden -> n_experts) and each expert's fused
 * gate_up (hidden -> 2 * inter) and down (inter -> hidden) projections. */
typedef struct ip_moe {
    ip_linear router;
    const ip_linear *gate_up, *down;
    int64_t n_experts, top_k, inter, normalize;
} ip_moe;

static int run_linear(const float *x, int64_t b, int64_t k, const ip_linear *lin, float *out) {
    return layer_linear(x, b, k, k, lin->w, lin->s, lin->bits, lin->bias, lin->n, out, lin->n);
}

/* h [b, hidden] through the experts into delta [b, hidden], as SparseMoE.forward computes it: each
 * expert that any row chose runs once over its rows (in row order), its output scaled by the row's
 * weight, and the scaled outputs are added to a zeroed delta expert by expert in id order. The
 * product is stored before the add, as PyTorch's separate multiply and index_add_ round it. */
static int moe_mlp(const float *h, int64_t b, int64_t hidden, const ip_moe *M, int gelu, float *delta) {
    const int64_t e = M->n_experts, k = M->top_k, inter = M->inter;
    float *logits = (float *)malloc(sizeof(float) * (size_t)(b * e));
    float *weights = (float *)malloc(sizeof(float) * (size_t)(b * k));
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(b * k));
    int64_t *rows = (int64_t *)malloc(sizeof(int64_t) * (size_t)b);
    float *row_weight = (float *)malloc(sizeof(float) * (size_t)b);
    float *x = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    float *gate_up = (float *)malloc(sizeof(float) * (size_t)(b * 2 * inter));
    float *act = (float *)malloc(sizeof(float) * (size_t)(b * inter));
    float *y = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    int rc = (!logits || !weights || !ids || !rows || !row_weight || !x || !gate_up || !act || !y) ? -2 : 0;
    if (rc == 0) rc = run_linear(h, b, hidden, &M->router, logits);
    if (rc == 0) rc = ip_moe_route(logits, b, e, k, (int)M->normalize, weights, ids);
    if (rc == 0) memset(delta, 0, sizeof(float) * (size_t)(b * hidden));
    for (int64_t expert = 0; rc == 0 && expert < e; expert++) {
        int64_t count = 0;
        for (int64_t r = 0; r < b; r++)
            for (int64_t t = 0; t < k; t++)
                if (ids[r * k + t] == expert) {
                    rows[count] = r;
                    row_weight[count++] = weights[r * k + t];
                }
        if (count == 0) continue;
        for (int64_t i = 0; i < count; i++) memcpy(x + i * hidden, h + rows[i] * hidden, sizeof(float) * (size_t)hidden);
        rc = run_linear(x, count, hidden, &M->gate_up[expert], gate_up);
        if (rc != 0) break;
        if (gelu) ip_gelu_mul(gate_up, count, inter, act);
        else ip_silu_mul(gate_up, count, inter, act);
        rc = run_linear(act, count, inter, &M->down[expert], y);
        for (int64_t i = 0; rc == 0 && i < count; i++) {
            float *yr = y + i * hidden;
            for (int64_t j = 0; j < hidden; j++) yr[j] *= row_weight[i];
        }
        for (int64_t i = 0; rc == 0 && i < count; i++) {
            float *d = delta + rows[i] * hidden;
            const float *yr = y + i * hidden;
            for (int64_t j = 0; j < hidden; j++) d[j] += yr[j];
        }
    }
    free(logits); free(weights); free(ids); free(rows); free(row_weight); free(x); free(gate_up); free(act); free(y);
    return rc;
}

/* One decoder layer's weights and KV cache, as ip_decode_layers reads them: the four linears (qkv, o,
 * gate_up, down) each as packed int8 with per-channel scales s, or (s NULL) GGUF blocks of bits[i]
 * (4, 5, 6 or 8, ip_block_linear); biases may be
 * NULL. The Llama block has norm1 (attention input) and norm2 (MLP input). Gemma adds: q_norm and
 * k_norm over each head before the rotation, and a sandwich of norms, where norm2 norms the attention
 * output, norm3 is the MLP's input norm and norm4 norms the MLP's output (NULL where a family has
 * none). A sliding layer has its window, its KV addressed through the window view (its own pool)
 * and, in Gemma 3, its own rope tables. Python builds an array of these once
 * (ops/fused_decode.py), so a decode step passes one pointer for the whole model. */
typedef struct {
    const float *norm1, *norm2;
    const uint8_t *w[4];
    const float *s[4];
    const float *bias[4];
    void *k_cache, *v_cache;  /* float32, or float16 where ip_decode_layers' `half` says so */
    const float *q_norm, *k_norm, *norm3, *norm4;
    int64_t window;  /* > 0: attends to the last `window` tokens only */
    int64_t view;    /* the ip_attn_view its KV is addressed by: 0 the main pool, 1 the window pool */
    int64_t rope;    /* the ip_rope it rotates by: 0 the model's, 1 the sliding layers' own */
    int64_t bits[4]; /* where s[i] is NULL: the bits of linear i's blocks */
    float softcap;   /* > 0: attention scores soft-capped (Gemma 2), cap * tanh(score / cap) */
    const struct ip_moe *moe; /* non-NULL: the MLP is these experts (w[2], w[3] unused) */
} ip_layer_weights;

/* Where a step's KV goes and is read from, for the layers of one pool: each row's slot, its block
 * table [b, max_blocks] and context length. */
typedef struct {
    const int64_t *slots, *block_tables, *context_lens;
    int64_t max_blocks;
} ip_attn_view;

/* One rope's cos and signed sin tables for each row's position, [b, d]. */
typedef struct {
    const float *cos, *signed_sin;
} ip_rope;

/* A decoder layer for b decode rows (one new token per sequence): the kernels above in the order the
 * model's Python calls them, so the result is the same bits. x [b, hidden] (contiguous) becomes
 * x + attn, then + mlp, in place. h, wide, narrow and delta are scratch rows the caller owns. */
static int decode_layer(float *x, int64_t b, int64_t hidden, const ip_layer_weights *L, float eps,
                        int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const ip_rope *ropes,
                        const ip_attn_view *views, int64_t block_size, float scale, int half, int gelu,
                        float *h, float *wide, float *narrow, float *delta) {
    const int64_t qkv_width = (heads + 2 * kv_heads) * d;
    const ip_attn_view *view = views + L->view;
    const ip_rope *rope = ropes + L->rope;
    ip_rms_norm(x, NULL, b, hidden, L->norm1, eps, h);
    int rc = layer_linear(h, b, hidden, hidden, L->w[0], L->s[0], L->bits[0], L->bias[0], qkv_width, wide, qkv_width);
    if (rc == 0 && L->q_norm) {
        for (int64_t r = 0; r < b; r++) {  /* each head's row normed in place, as Attention._head_norms */
            float *row = wide + r * qkv_width;
            ip_rms_norm(row, NULL, heads, d, L->q_norm, eps, row);
            ip_rms_norm(row + heads * d, NULL, kv_heads, d, L->k_norm, eps, row + heads * d);
        }
    }
    if (rc == 0) {
        rc = ip_rope_store_kv(wide, b, heads, kv_heads, d, rope->cos, rope->signed_sin, view->slots, L->k_cache,
                              L->v_cache, half);
    }
    if (rc == 0) {
        rc = ip_paged_decode_attention(wide, qkv_width, b, heads, kv_heads, d, L->k_cache, L->v_cache, block_size,
                                       view->block_tables, view->max_blocks, view->context_lens, scale, narrow,
                                       heads * d, half, L->window, L->softcap);
    }
    if (rc == 0) rc = layer_linear(narrow, b, heads * d, heads * d, L->w[1], L->s[1], L->bits[1], L->bias[1], hidden, delta, hidden);
    if (rc == 0) {
        if (L->norm3) {  /* Gemma: the attention output normed, then x += it and the MLP's own input norm */
            ip_rms_norm(delta, NULL, b, hidden, L->norm2, eps, delta);
            ip_rms_norm(x, delta, b, hidden, L->norm3, eps, h);
        } else {
            ip_rms_norm(x, delta, b, hidden, L->norm2, eps, h);  /* x += attn; h = norm(x) */
        }
        if (L->moe) rc = moe_mlp(h, b, hidden, L->moe, gelu, delta);
        else rc = layer_linear(h, b, hidden, hidden, L->w[2], L->s[2], L->bits[2], L->bias[2], 2 * inter, wide, 2 * inter);
    }
    if (rc == 0 && !L->moe) {
        if (gelu) ip_gelu_mul(wide, b, inter, narrow);
        else ip_silu_mul(wide, b, inter, narrow);
        rc = layer_linear(narrow, b, inter, inter, L->w[3], L->s[3], L->bits[3], L->bias[3], hidden, delta, hidden);
    }
    if (rc == 0) {
        if (L->norm4) ip_rms_norm(delta, NULL, b, hidden, L->norm4, eps, delta);
        for (int64_t i = 0; i < b * hidden; i++) x[i] += delta[i];
    }
    return rc;
}

/* What may follow the last layer in the same call (model/llama.py's final norm and head, as
 * forward_and_logits runs them op by op): x normed in place by `norm` (NULL: left as the last layer's
 * output), then, where head.w is set, logits [b, head.n] = x @ head (the kernel head.s/bits name)
 * and, where argmax is set, each row's argmax of them (ip_argmax_rows: what greedy sampling takes,
 * read while the logits are still in cache; Gemma 3's are 1 MB a row). Where temperature is set too,
 * a row whose temperature is above 0 gets instead the token drawn at its uniform (sample.c's
 * ip_sample_row, with its top_k, top_p and min_p; weights: [b, head.n] scratch), so a burst of steps
 * (ip_decode_steps) runs sampled rows as it runs greedy ones; uniform holds a draw per step and row
 * [steps, b], the step's row read by ip_decode_steps. */
typedef struct {
    const float *norm;
    float eps;
    ip_linear head;
    float *logits;
    int64_t *argmax;
    const float *temperature; /* [b], NULL: every row greedy */
    const int64_t *top_k;
    const float *top_p, *min_p;
    const double *uniform;    /* [steps, b] */
    float *weights;
} ip_decode_tail;

/* Row i's draw where its temperature is above 0 (its argmax stays otherwise), at `uniform` [b]:
 * this step's row of the tail's. */
static void choose_row(const ip_decode_tail *tail, const double *uniform, int64_t i) {
    if (tail->temperature[i] > 0.0f)
        ip_sample_row(tail->logits, tail->head.n, tail->head.n, tail->temperature, tail->top_k, tail->top_p,
                      tail->min_p, uniform, tail->weights, tail->argmax, i);
}

/* Each row's next token from the tail's logits: every row's argmax, then the sampled rows' draws. */
static void choose_tokens(const ip_decode_tail *tail, int64_t b, const double *uniform) {
    const int64_t n = tail->head.n;
    ip_argmax_rows(tail->logits, b, n, n, tail->argmax);
    if (tail->temperature) FOR_ROWS(b, 4, choose_row(tail, uniform, i));
}

/* What the first layer reads, looked up inside the call where `inputs` is given: each row's token
 * embedding (times `scale` where it is not 0, Gemma's multiplier as float32) into x, and each rope's
 * rows for the step's positions from its whole tables [max_positions, d]. Why: done in PyTorch
 * before the call, the three lookups (an embedding and two indexings) ran with caches the last
 * step's weights had swept, about 0.09 ms of SmolLM2's batch-1 step and 0.2 ms of Gemma 3's; the
 * copies are the same values. */
typedef struct {
    const int64_t *token_ids, *positions;
    const float *embedding; /* [vocab, hidden] */
    float scale;
    const float *cos[2], *signed_sin[2]; /* the model's rope, then the sliding layers' own (or again the model's) */
    int64_t vocab, max_positions;        /* the tables' rows: an id or position outside them is refused (-3) */
} ip_decode_inputs;

/* x [b, hidden] and each rope's rows [b, d] (into rows [4, b, d]: cos and signed sin of the model's
 * rope, then of the sliding layers') as `inputs` names them; -3 (nothing written) where a token id or
 * position is outside its table, else 0. */
static int look_up_inputs(const ip_decode_inputs *inputs, int64_t b, int64_t hidden, int64_t d, float *x, float *rows,
                          ip_rope looked_up[2]) {
    for (int64_t r = 0; r < b; r++)
        if (inputs->token_ids[r] < 0 || inputs->token_ids[r] >= inputs->vocab || inputs->positions[r] < 0
            || inputs->positions[r] >= inputs->max_positions)
            return -3;
    for (int64_t r = 0; r < b; r++) {
        const float *e = inputs->embedding + inputs->token_ids[r] * hidden;
        float *xr = x + r * hidden;
        if (inputs->scale != 0.0f)
            for (int64_t j = 0; j < hidden; j++) xr[j] = e[j] * inputs->scale;
        else
            memcpy(xr, e, sizeof(float) * (size_t)hidden);
    }
    for (int rope = 0; rope < 2; rope++) {
        float *cos = rows + 2 * rope * b * d, *sin = cos + b * d;
        for (int64_t r = 0; r < b; r++) {
            memcpy(cos + r * d, inputs->cos[rope] + inputs->positions[r] * d, sizeof(float) * (size_t)d);
            memcpy(sin + r * d, inputs->signed_sin[rope] + inputs->positions[r] * d, sizeof(float) * (size_t)d);
        }
        looked_up[rope].cos = cos;
        looked_up[rope].signed_sin = sin;
    }
    return 0;
}

/* n_layers consecutive decoder layers for b decode rows, one call per decode step instead of ~10 per
 * layer: from Python each call cost tens of microseconds of argument handling, which for SmolLM2 at
 * batch 1 was a third of the step. Every layer reads the step's rope tables and attention view its
 * entry names (ropes[2], views[2]: the model's and the sliding layers'). `gelu`: the MLP is GeGLU
 * (tanh), else SwiGLU. `tail` (or NULL): the final norm and head after the last layer; each PyTorch
 * op between two C calls ran with caches the weights had just swept (SmolLM2's final norm took
 * 0.15 ms after the layers, 0.02 ms warm), so the step's ends run here too. `inputs` (or NULL):
 * x and the rope rows are looked up here (ropes is then not read). Returns 0, -1 where this build has
 * no int8 kernel, -2 when out of memory, -3 where a token id or position is outside its table (x and
 * the caches untouched). */
int ip_decode_layers(float *x, int64_t b, int64_t hidden, const ip_layer_weights *layers, int64_t n_layers,
                     float eps, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const ip_rope *ropes,
                     const ip_attn_view *views, int64_t block_size, float scale, int half, int gelu,
                     const ip_decode_tail *tail, const ip_decode_inputs *inputs) {
    if (!(ip_features() & IP_FEATURE_INT8_LINEAR)) return -1;
    const int64_t qkv_width = (heads + 2 * kv_heads) * d;
    const int64_t widest = qkv_width > 2 * inter ? qkv_width : 2 * inter;
    float *h = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    float *wide = (float *)malloc(sizeof(float) * (size_t)(b * widest));
    float *narrow = (float *)malloc(sizeof(float) * (size_t)(b * (inter > heads * d ? inter : heads * d)));
    float *delta = (float *)malloc(sizeof(float) * (size_t)(b * hidden));
    float *rows = inputs ? (float *)malloc(sizeof(float) * (size_t)(4 * b * d)) : NULL; /* the ropes' rows */
    int rc = (!h || !wide || !narrow || !delta || (inputs && !rows)) ? -2 : 0;
    ip_rope looked_up[2];
    if (rc == 0 && inputs) {
        rc = look_up_inputs(inputs, b, hidden, d, x, rows, looked_up);
        ropes = looked_up;
    }
    for (int64_t l = 0; rc == 0 && l < n_layers; l++)
        rc = decode_layer(x, b, hidden, layers + l, eps, heads, kv_heads, d, inter, ropes, views, block_size, scale,
                          half, gelu, h, wide, narrow, delta);
    free(h); free(wide); free(narrow); free(delta); free(rows);
    if (rc == 0 && tail && tail->norm) ip_rms_norm(x, NULL, b, hidden, tail->norm, tail->eps, x);
    if (rc == 0 && tail && tail->head.w) rc = run_linear(x, b, hidden, &tail->head, tail->logits);
    if (rc == 0 && tail && tail->head.w && tail->argmax) choose_tokens(tail, b, tail->uniform);
    return rc;
}

/* Up to `steps` decode steps of b rows in one call: ip_decode_layers, then each row's token (its
 * argmax, or its draw where the tail samples it: the step's row of tail->uniform) becomes its next
 * token, at the next position, in the next slot of the block its first token went to, with one more
 * token of context in each pool's view. tokens [steps, b] gets each step's tokens.
 * The call ends after the first step in which any row's token is one of stop_ids [n_stop] (a stop
 * token or EOS of some row): single steps would run without that row from there on, and the attention
 * splits a context by the number of rows, so the other rows' next steps are not this call's to run.
 * Needs `inputs` (the call looks the tokens up) and a tail with the head and argmax; every step's
 * slot must lie in the block the row's first token went to (the caller keeps a burst inside it, so
 * no block is allocated or freed in it): -4 where one would not, nothing of that step written.
 * Returns the steps run (>= 1), or a negative error (-2 or -4 here, or ip_decode_layers'). Why: a
 * batch-1 step's Python (scheduling, the step's inputs, appending the token) took 0.27-0.33 ms of
 * SmolLM2's 2.5 ms step, and each step's C call started with caches the Python had disturbed; here
 * the engine's Python runs once per burst. ropes: not read (the rows are looked up). */
int ip_decode_steps(float *x, int64_t b, int64_t hidden, const ip_layer_weights *layers, int64_t n_layers,
                    float eps, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter, const ip_attn_view *views,
                    int64_t block_size, float scale, int half, int gelu, const ip_decode_tail *tail,
                    const ip_decode_inputs *inputs, int64_t steps, const int64_t *stop_ids, int64_t n_stop,
                    int64_t *tokens) {
    if (!inputs || !tail || !tail->head.w || !tail->argmax || steps < 1) return -4;
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)(6 * b));
    if (!ids) return -2;
    int64_t *positions = ids + b, *slots = ids + 2 * b, *lens = ids + 4 * b; /* slots and lens: per view */
    ip_decode_inputs looked = *inputs;
    ip_attn_view own[2];
    memcpy(ids, inputs->token_ids, sizeof(int64_t) * (size_t)b);
    memcpy(positions, inputs->positions, sizeof(int64_t) * (size_t)b);
    for (int v = 0; v < 2; v++) {
        own[v] = views[v];
        memcpy(slots + v * b, views[v].slots, sizeof(int64_t) * (size_t)b);
        memcpy(lens + v * b, views[v].context_lens, sizeof(int64_t) * (size_t)b);
        own[v].slots = slots + v * b;
        own[v].context_lens = lens + v * b;
    }
    looked.token_ids = ids;
    looked.positions = positions;
    ip_decode_tail step_tail = *tail; /* its uniform moves a row of draws each step */
    int rc = 0;
    int64_t s = 0;
    for (; rc == 0 && s < steps; s++) {
        if (s > 0) {
            for (int64_t r = 0; rc == 0 && r < b; r++) {
                for (int v = 0; v < 2; v++) {
                    /* the new token's place in the view, in the block of the burst's first token (which
                     * its table holds, so no width check is needed) */
                    const int64_t at = lens[v * b + r];
                    if (at / block_size != (at - s) / block_size) {
                        rc = -4;
                        break;
                    }
                }
            }
            if (rc != 0) break;
            for (int64_t r = 0; r < b; r++) {
                ids[r] = tail->argmax[r];
                positions[r] += 1;
                for (int v = 0; v < 2; v++) {
                    const int64_t at = lens[v * b + r]++;
                    const int64_t block = own[v].block_tables[r * own[v].max_blocks + at / block_size];
                    slots[v * b + r] = block * block_size + at % block_size;
                }
            }
        }
        if (tail->uniform) step_tail.uniform = tail->uniform + s * b;
        rc = ip_decode_layers(x, b, hidden, layers, n_layers, eps, heads, kv_heads, d, inter, NULL, own, block_size,
                              scale, half, gelu, &step_tail, &looked);
        if (rc != 0) break;
        memcpy(tokens + s * b, tail->argmax, sizeof(int64_t) * (size_t)b);
        int stopped = 0;
        for (int64_t r = 0; r < b && !stopped; r++)
            for (int64_t i = 0; i < n_stop && !stopped; i++) stopped = tail->argmax[r] == stop_ids[i];
        if (stopped) {
            s++;
            break;
        }
    }
    free(ids);
    return rc != 0 ? rc : (int)s;
}
