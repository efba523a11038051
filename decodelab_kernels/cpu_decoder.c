/* Every decoder layer of a CPU decode step in one call: the layer's own loop, moved out of Python.

   The model's module path makes ~10 calls into C per layer (RMSNorm, the int8 matmuls, RoPE, the KV store, decode
   attention, SiLU x up) with Python, ctypes and PyTorch's bookkeeping around each: ~5 ms of a SmolLM2 step on the
   2-core AVX2 target. This file does that sequence itself and calls the very same functions, passed in as pointers
   from the libraries the module path loads (cpu_int8, cpu_layer_ops, cpu_decode_attention), so every number is
   bit for bit what the module path computes. It holds no kernel of its own. Used by
   engine_service/engine/models/fused_decode.py where its conditions hold. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*int8_linear_fn)(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const void* dp,
                              const void* mp, const float* bias, float* y, int64_t N, int fmt);
typedef void (*rms_norm_fn)(const float* x, int64_t ldx, const float* h, float* s, const float* w, float* y,
                            int64_t M, int64_t N, float eps);
typedef void (*rope_fn)(float* x, int64_t ldx, int64_t M, int64_t heads, int64_t D, const float* cos,
                        const float* ssin);
typedef void (*silu_mul_fn)(const float* gu, int64_t ldg, int64_t M, int64_t I, float* y);
typedef void (*store_kv_fn)(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t n, int64_t width,
                            const int64_t* slots, void* k_cache, void* v_cache);
typedef void (*paged_decode_fn)(const float* q, int64_t ldq, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                                const void* k_cache, const void* v_cache, int kv_kind, const float* k_scale,
                                const float* v_scale, const int32_t* block_tables, int64_t ldbt,
                                const int32_t* context_lens, int64_t bs, float scale, float* out);

typedef struct {
    int8_linear_fn int8_linear;
    rms_norm_fn rms_norm;
    rope_fn rope;
    silu_mul_fn silu_mul;
    store_kv_fn store_kv;
    paged_decode_fn paged_decode;
} dl_ops;

/* one int8 matmul as cpu_int8.Matrix holds it */
typedef struct { const uint8_t* packed; const void* steps; const void* offsets; const float* bias; int64_t fmt; } dl_matrix;

typedef struct {
    const float* input_norm;
    const float* post_norm;
    dl_matrix qkv, o, gate_up, down;
    void* k_cache;
    void* v_cache;
} dl_layer;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    float eps, scale;
    int64_t kv_kind;  /* the caches' elements, as cpu_decode_attention.c numbers them: 0 fp32, 2 fp16 (store_kv
                         is the store for that kind) */
} dl_shape;

/* x [M, hidden] (contiguous) through every layer in place. cos / ssin [M, head_dim] (RoPE's tables at the rows'
   positions, the sine signed as apply_rope wants it); slots [M] the KV slots (none -1); block_tables [M, ldbt]
   int32 and context_lens [M] the rows' decode tables. Returns 0, or -1 when a buffer could not be allocated. */
int dl_decode_layers(const dl_ops* ops, const dl_shape* s, const dl_layer* layers, float* x, int64_t M,
                     const float* cos, const float* ssin, const int64_t* slots, const int32_t* block_tables,
                     int64_t ldbt, const int32_t* context_lens) {
    const int64_t H = s->hidden, D = s->head_dim, Q = s->heads * D, KV = s->kv_heads * D, NQKV = Q + 2 * KV;
    const int64_t I = s->intermediate;
    float* buf = malloc((size_t)M * (size_t)(3 * H + NQKV + Q + 3 * I) * sizeof(float));
    if (!buf) return -1;
    float *h = buf, *qkv = h + M * H, *att = qkv + M * NQKV, *o = att + M * Q, *sum = o + M * H;
    float *gu = sum + M * H, *act = gu + M * 2 * I;
    float* down = o;  /* o is dead once the residual add has read it */
    int err = 0;
#define LINEAR(x, ldx, K, m, y, N) ops->int8_linear(x, ldx, M, K, (m).packed, (m).steps, (m).offsets, (m).bias, y, N, (int)(m).fmt)
    for (int64_t l = 0; l < s->layers && !err; l++) {
        const dl_layer* L = layers + l;
        ops->rms_norm(x, H, 0, x, L->input_norm, h, M, H, s->eps);
        err |= LINEAR(h, H, H, L->qkv, qkv, NQKV);
        ops->rope(qkv, NQKV, M, s->heads + s->kv_heads, D, cos, ssin);
        ops->store_kv(qkv + Q, NQKV, qkv + Q + KV, NQKV, M, KV, slots, L->k_cache, L->v_cache);
        ops->paged_decode(qkv, NQKV, M, s->heads, s->kv_heads, D, L->k_cache, L->v_cache, (int)s->kv_kind, 0, 0, block_tables,
                          ldbt, context_lens, s->block_size, s->scale, att);
        err |= LINEAR(att, Q, Q, L->o, o, H);
        ops->rms_norm(x, H, o, sum, L->post_norm, h, M, H, s->eps);  /* sum = x + o; h = its norm */
        err |= LINEAR(h, H, H, L->gate_up, gu, 2 * I);
        ops->silu_mul(gu, 2 * I, M, I, act);
        err |= LINEAR(act, I, I, L->down, down, H);
        for (int64_t i = 0; i < M * H; i++) x[i] = sum[i] + down[i];
    }
    free(buf);
    return err ? -1 : 0;
}

/* A whole decode step around the layers: the rows' embeddings (ids into the fp32 table embed [vocab, hidden]), RoPE's
   tables at their positions (cos_table / ssin_table [max_pos, head_dim], the sine signed), every layer
   (dl_decode_layers), then the final norm into out [M, hidden]: what CausalLM.forward does around the layers, as
   plain copies and the module path's own norm, without its ~0.15 ms a step of PyTorch calls. Returns 0, -1 when a
   buffer could not be allocated, -2 for an id or a position out of its table. */
int dl_decode_step(const dl_ops* ops, const dl_shape* s, const dl_layer* layers, const float* embed, int64_t vocab,
                   const int64_t* ids, const int64_t* positions, const float* cos_table, const float* ssin_table,
                   int64_t max_pos, const float* final_norm, float final_eps, float* out, int64_t M,
                   const int64_t* slots, const int32_t* block_tables, int64_t ldbt, const int32_t* context_lens) {
    const int64_t H = s->hidden, D = s->head_dim;
    for (int64_t i = 0; i < M; i++)
        if (ids[i] < 0 || ids[i] >= vocab || positions[i] < 0 || positions[i] >= max_pos) return -2;
    float* buf = malloc((size_t)M * (size_t)(H + 2 * D) * sizeof(float));
    if (!buf) return -1;
    float *x = buf, *cos = x + M * H, *ssin = cos + M * D;
    for (int64_t i = 0; i < M; i++) {
        memcpy(x + i * H, embed + ids[i] * H, (size_t)H * sizeof(float));
        memcpy(cos + i * D, cos_table + positions[i] * D, (size_t)D * sizeof(float));
        memcpy(ssin + i * D, ssin_table + positions[i] * D, (size_t)D * sizeof(float));
    }
    int err = dl_decode_layers(ops, s, layers, x, M, cos, ssin, slots, block_tables, ldbt, context_lens);
    if (!err) ops->rms_norm(x, H, 0, x, final_norm, out, M, H, final_eps);
    free(buf);
    return err;
}
