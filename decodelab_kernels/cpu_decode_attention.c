/* Paged decode attention on x86 CPUs with AVX2 and FMA (and 16 lanes a register where the build has AVX-512 F:
   task16, below): one query token per sequence against its cached K/V, read in place through the block table (no
   gather into a padded copy, no mask, no per-layer plan).

   q [B, H, D] fp32 (row stride ldq, heads contiguous); caches [num_blocks, block_size, Hkv, D], fp32, fp16 or int8
   (an int8 cache reads back as value * scale[block, slot, head], decodelab_kernels/kv_int8.py: the scale of row r at r / D); block_tables [B, *] int32 (row
   stride ldbt); context_lens [B] int32; out [B, H, D] fp32 contiguous.

   One task per (sequence, KV head) computes its G = H / Hkv query heads, the group's K/V rows of a chunk of CHUNK
   context tokens staying in L1 between heads (the next chunk's rows prefetched meanwhile). Per chunk and head:
   the scores (8 tokens at a time), an online-softmax update (running max and sum, the accumulator rescaled when
   the max grows), the weights (a vectorized exp), then the weighted V rows into accumulators held in registers.
   A task's arithmetic depends on its own sequence only: a sequence gets the same bits alone or in any batch.
   Tasks are split between threads by OpenMP (PyTorch's libgomp, loaded first) once a step has enough work to pay
   for waking them (`parallel_min`). Built and loaded by decodelab_kernels/cpu_decode_attention.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CHUNK 64
#define MAX_D 256
#define MAX_G 16
/* below this many (context token x KV head) pairs a step's attention runs on the calling thread. With
   OMP_WAIT_POLICY=PASSIVE (play's default) the other thread sleeps and waking it (a futex) costs more than the work
   of a few short contexts (SmolLM2: 3 KV heads x ~100 tokens). Otherwise it is spinning at the last barrier, and
   even one sequence's 3 tasks of 20-160 tokens take 0.6x the time split between two threads (SmolLM2's 30 layers,
   0.20 -> 0.12 ms a step at 20-45 tokens, 0.42 -> 0.26 at 30-160: AMD EPYC Zen 3, 2 threads; each layer's K/V
   comes from memory, the step's weights having gone through the caches since): no bar then, only more than one
   task (dl_paged_decode) */
static int64_t parallel_min(void) {
    static int64_t v = -1;  /* (a race here writes the same value) */
    if (v < 0) v = omp_passive() ? 8192 : 0;
    return v;
}

/* a cache's element kind: 0 fp32, 1 int8 (times its row's scale), 2 fp16 */
static inline int64_t elem_bytes(const int KIND) { return KIND == 1 ? 1 : KIND == 2 ? 2 : 4; }

static inline __m256 load8(const void* base, int64_t i, const int KIND) {
    if (KIND == 2) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)base + i)));
    if (KIND == 1) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)base + i))));
    return _mm256_loadu_ps((const float*)base + i);
}

/* the 8-lane sums of a0..a3 as 4 floats */
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The K and V rows of the chunk at `c` on their way to L1 while the chunk before is computed. A KV head's rows lie
   Hkv * D values apart in a block and the blocks anywhere, which the hardware prefetcher does not follow: without
   this the first query head's loads waited on memory (perf on AMD Zen 5: most of the kernel's samples on two of
   them; with it, 128 sequences x ~200 tokens ~0.8x the time). always_inline: GCC 12 takes a function of prefetches
   alone for one without side effects and drops its calls. */
static inline __attribute__((always_inline)) void prefetch_chunk(
        const void* kc, const void* vc, const int32_t* table, int64_t c, int64_t ctx, int64_t bs, int64_t hkv,
        int64_t h, int64_t D, const int KIND) {
    int64_t end = ctx - c < CHUNK ? ctx : c + CHUNK, bytes = D * elem_bytes(KIND);
    for (int64_t pos = c, bi = c / bs, slot = c % bs; pos < end; pos++) {
        int64_t off = ((table[bi] * bs + slot) * hkv + h) * bytes;
        for (int64_t b = 0; b < bytes; b += 64) {
            _mm_prefetch((const char*)kc + off + b, _MM_HINT_T0);
            _mm_prefetch((const char*)vc + off + b, _MM_HINT_T0);
        }
        if (++slot == bs) {
            slot = 0;
            bi++;
        }
    }
}

/* The rows of the chunk at `c`, padded to a multiple of 16 (offsets in elements, an int8 cache's scales; rows past
   the context repeat the last one: computed, then given weight 0), each row's K and V lines prefetched when `PF`.
   The 16-lane task computes the next chunk's rows while it has the current one's (two sets), so one walk of the
   block table both finds and prefetches them. Against no prefetch, 128 sequences x 269 tokens on 2 threads (AMD
   Zen 5): 1.03x the time on blocks in order, 0.88-0.94x on shuffled ones. */
static inline __attribute__((always_inline)) void chunk_rows(
        const int32_t* table, int64_t c, int64_t ctx, int64_t bs, int64_t hkv, int64_t h, int64_t D, const void* kc,
        const void* vc, const float* ks, const float* vs, int64_t* row, float* fk, float* fv, const int PF,
        const int KIND) {
    int64_t n = ctx - c < CHUNK ? ctx - c : CHUNK, n16 = (n + 15) & ~15, bytes = D * elem_bytes(KIND);
    for (int64_t t = 0, bi = c / bs, slot = c % bs; t < n16; t++) {  /* (no division per token) */
        int64_t srow = (table[bi] * bs + slot) * hkv + h;
        row[t] = srow * D;
        fk[t] = KIND == 1 ? ks[srow] : 1.0f;
        fv[t] = KIND == 1 ? vs[srow] : 1.0f;
        if (PF && t < n)
            for (int64_t b = 0; b < bytes; b += 64) {
                _mm_prefetch((const char*)kc + srow * bytes + b, _MM_HINT_T0);
                _mm_prefetch((const char*)vc + srow * bytes + b, _MM_HINT_T0);
            }
        if (t + 1 < n && ++slot == bs) {
            slot = 0;
            bi++;
        }
    }
}

/* Both tasks' first and last steps: the G query heads scaled, their accumulators, running maxima and sums reset;
   then each head's output, its accumulator over its sum */
static inline void begin_heads(const float* q, int64_t G, int64_t D, float scale, float (*qs)[MAX_D],
                               float (*acc)[MAX_D], float* m, float* l) {
    for (int64_t g = 0; g < G; g++) {
        for (int64_t d = 0; d < D; d++) qs[g][d] = q[g * D + d] * scale;
        memset(acc[g], 0, D * sizeof(float));
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
}

static inline void end_heads(int64_t G, int64_t D, float (*acc)[MAX_D], const float* l, float* out) {
    for (int64_t g = 0; g < G; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  /* an empty context (never scheduled) gives zeros */
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g][d] * inv;
    }
}

static inline __attribute__((always_inline)) void task(
        const float* q, int64_t G, int64_t D, const void* kc, const void* vc, const float* ks, const float* vs,
        const int32_t* table, int64_t ctx, int64_t bs, int64_t hkv, int64_t h, float scale, float* out,
        const int KIND) {
    float qs[MAX_G][MAX_D] __attribute__((aligned(32)));
    float acc[MAX_G][MAX_D] __attribute__((aligned(32)));
    float p[MAX_G][CHUNK] __attribute__((aligned(32)));  /* a chunk's scores, then their weights */
    float fk[CHUNK], fv[CHUNK];  /* an int8 cache's scale of each token's row */
    int64_t row[CHUNK];
    float m[MAX_G], l[MAX_G];
    begin_heads(q, G, D, scale, qs, acc, m, l);
    prefetch_chunk(kc, vc, table, 0, ctx, bs, hkv, h, D, KIND);
    for (int64_t c = 0; c < ctx; c += CHUNK) {
        int64_t n = ctx - c < CHUNK ? ctx - c : CHUNK, n8 = (n + 7) & ~7;
        if (c + CHUNK < ctx) prefetch_chunk(kc, vc, table, c + CHUNK, ctx, bs, hkv, h, D, KIND);
        chunk_rows(table, c, ctx, bs, hkv, h, D, kc, vc, ks, vs, row, fk, fv, 0, KIND);
        for (int64_t g = 0; g < G; g++) {  /* scores, 8 tokens at a time: 8 independent FMA chains */
            for (int64_t t = 0; t < n8; t += 8) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int64_t d = 0; d < D; d += 8) {
                    __m256 qv = _mm256_load_ps(qs[g] + d);
                    a0 = _mm256_fmadd_ps(qv, load8(kc, row[t] + d, KIND), a0);
                    a1 = _mm256_fmadd_ps(qv, load8(kc, row[t + 1] + d, KIND), a1);
                    a2 = _mm256_fmadd_ps(qv, load8(kc, row[t + 2] + d, KIND), a2);
                    a3 = _mm256_fmadd_ps(qv, load8(kc, row[t + 3] + d, KIND), a3);
                    a4 = _mm256_fmadd_ps(qv, load8(kc, row[t + 4] + d, KIND), a4);
                    a5 = _mm256_fmadd_ps(qv, load8(kc, row[t + 5] + d, KIND), a5);
                    a6 = _mm256_fmadd_ps(qv, load8(kc, row[t + 6] + d, KIND), a6);
                    a7 = _mm256_fmadd_ps(qv, load8(kc, row[t + 7] + d, KIND), a7);
                }
                _mm_storeu_ps(p[g] + t, _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm_loadu_ps(fk + t)));
                _mm_storeu_ps(p[g] + t + 4, _mm_mul_ps(hsum4(a4, a5, a6, a7), _mm_loadu_ps(fk + t + 4)));
            }
            for (int64_t t = n; t < n8; t++) p[g][t] = -INFINITY;
            float mx = m[g];
            for (int64_t t = 0; t < n; t++) mx = p[g][t] > mx ? p[g][t] : mx;
            if (mx > m[g]) {  /* the max grew: what was summed so far shrinks by exp(old - new) */
                float alpha = expf(m[g] - mx);
                __m256 av = _mm256_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(acc[g] + d, _mm256_mul_ps(av, _mm256_load_ps(acc[g] + d)));
                l[g] *= alpha;
                m[g] = mx;
            }
            __m256 sum = _mm256_setzero_ps(), mv = _mm256_set1_ps(mx);
            for (int64_t t = 0; t < n8; t += 8) {
                __m256 e = exp8(_mm256_sub_ps(_mm256_load_ps(p[g] + t), mv));
                if (t + 8 > n)  /* padding lanes: weight 0 */
                    e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(
                        _mm256_set1_epi32((int)(n - t)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))));
                sum = _mm256_add_ps(sum, e);
                _mm256_store_ps(p[g] + t, _mm256_mul_ps(e, _mm256_loadu_ps(fv + t)));
            }
            l[g] += hsum(sum);
            /* the weighted V rows, 64 output lanes in registers at a time (8 independent FMA chains: one FMA's
               latency is ~4 cycles and two issue a cycle), then 32 for what is left of D */
            int64_t d = 0;
            for (; d + 64 <= D; d += 64) {
                __m256 c[8];
                for (int k = 0; k < 8; k++) c[k] = _mm256_load_ps(acc[g] + d + 8 * k);
                for (int64_t t = 0; t < n; t++) {
                    __m256 pt = _mm256_broadcast_ss(p[g] + t);
                    for (int k = 0; k < 8; k++) c[k] = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 8 * k, KIND), c[k]);
                }
                for (int k = 0; k < 8; k++) _mm256_store_ps(acc[g] + d + 8 * k, c[k]);
            }
            for (; d < D; d += 32) {
                int64_t w = D - d < 32 ? D - d : 32;
                __m256 c0 = _mm256_load_ps(acc[g] + d), c1 = w > 8 ? _mm256_load_ps(acc[g] + d + 8) : c0;
                __m256 c2 = w > 16 ? _mm256_load_ps(acc[g] + d + 16) : c0, c3 = w > 24 ? _mm256_load_ps(acc[g] + d + 24) : c0;
                for (int64_t t = 0; t < n; t++) {
                    __m256 pt = _mm256_broadcast_ss(p[g] + t);
                    c0 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d, KIND), c0);
                    if (w > 8) c1 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 8, KIND), c1);
                    if (w > 16) c2 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 16, KIND), c2);
                    if (w > 24) c3 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 24, KIND), c3);
                }
                _mm256_store_ps(acc[g] + d, c0);
                if (w > 8) _mm256_store_ps(acc[g] + d + 8, c1);
                if (w > 16) _mm256_store_ps(acc[g] + d + 16, c2);
                if (w > 24) _mm256_store_ps(acc[g] + d + 24, c3);
            }
        }
    }
    end_heads(G, D, acc, l, out);
}

#if defined(__AVX512F__)
/* The same task with 16 lanes a register (the build with -mavx512f, chosen where the CPU has AVX-512 F: D % 16 == 0;
   other head sizes take the 8-lane task). Two things change besides the width. The scores of 16 tokens are summed
   as a tree over 16 registers (4 levels of 2 shuffles and an add) into one register of 16 scores, instead of the
   horizontal adds per 4 tokens. The weighted V rows are added for up to 4 query heads at once: a token's V row is
   loaded once for them (up to 4 x 4 accumulators in registers), where the 8-lane task loads it once a head. */
static inline __m512 load16(const void* base, int64_t i, const int KIND) {
    if (KIND == 2) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)base + i)));
    if (KIND == 1) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)((const int8_t*)base + i))));
    return _mm512_loadu_ps((const float*)base + i);
}

/* exp8's polynomial on 16 floats */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500E-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073E-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894E-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459E-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201E-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

/* lane j of the result: the sum of a[s(j)]'s 16 lanes, s(j) = 4 (j % 4) + j / 4 (the tree leaves its sums in that
   order; callers accumulate token j in a[s(j)]). Each level adds pairs after moving their halves side by side:
   128-bit quarters 0+2 / 1+3 of two registers, then 0+1 / 2+3, then floats 0+2 / 1+3 and 0+1 / 2+3 within quarters */
static inline __m512 sum16x16(const __m512 a[16]) {
    __m512 b[8], c[4], e[2];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++)
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++)
        e[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
}

/* acc[g0 .. g0 + GT) [d, d + 16 W) += sum over the chunk's n tokens of p[g][t] x V row t: GT x W accumulators in
   registers, each V row loaded once for the GT heads */
static inline __attribute__((always_inline)) void weighted_v(
        float (*acc)[MAX_D], float (*p)[CHUNK], int64_t g0, const int GT, int64_t d, const int W, const void* vc,
        const int64_t* row, int64_t n, const int KIND) {
    __m512 c[4][4];
    for (int g = 0; g < GT; g++)
        for (int k = 0; k < W; k++) c[g][k] = _mm512_load_ps(acc[g0 + g] + d + 16 * k);
    for (int64_t t = 0; t < n; t++) {
        __m512 v[4];
        for (int k = 0; k < W; k++) v[k] = load16(vc, row[t] + d + 16 * k, KIND);
        for (int g = 0; g < GT; g++) {
            __m512 pt = _mm512_set1_ps(p[g0 + g][t]);
            for (int k = 0; k < W; k++) c[g][k] = _mm512_fmadd_ps(pt, v[k], c[g][k]);
        }
    }
    for (int g = 0; g < GT; g++)
        for (int k = 0; k < W; k++) _mm512_store_ps(acc[g0 + g] + d + 16 * k, c[g][k]);
}

static inline __attribute__((always_inline)) void weighted_v_heads(
        float (*acc)[MAX_D], float (*p)[CHUNK], int64_t g0, int64_t gt, int64_t d, const int W, const void* vc,
        const int64_t* row, int64_t n, const int KIND) {
    switch (gt) {
        case 1: weighted_v(acc, p, g0, 1, d, W, vc, row, n, KIND); break;
        case 2: weighted_v(acc, p, g0, 2, d, W, vc, row, n, KIND); break;
        case 3: weighted_v(acc, p, g0, 3, d, W, vc, row, n, KIND); break;
        default: weighted_v(acc, p, g0, 4, d, W, vc, row, n, KIND); break;
    }
}

static inline __attribute__((always_inline)) void task16(
        const float* q, int64_t G, int64_t D, const void* kc, const void* vc, const float* ks, const float* vs,
        const int32_t* table, int64_t ctx, int64_t bs, int64_t hkv, int64_t h, float scale, float* out,
        const int KIND) {
    float qs[MAX_G][MAX_D] __attribute__((aligned(64)));
    float acc[MAX_G][MAX_D] __attribute__((aligned(64)));
    float p[MAX_G][CHUNK] __attribute__((aligned(64)));  /* a chunk's scores, then their weights */
    float fks[2][CHUNK] __attribute__((aligned(64))), fvs[2][CHUNK] __attribute__((aligned(64)));
    int64_t rows[2][CHUNK];  /* this chunk's rows and the next one's */
    float m[MAX_G], l[MAX_G];
    begin_heads(q, G, D, scale, qs, acc, m, l);
    chunk_rows(table, 0, ctx, bs, hkv, h, D, kc, vc, ks, vs, rows[0], fks[0], fvs[0], 0, KIND);
    for (int64_t c = 0, i = 0; c < ctx; c += CHUNK, i ^= 1) {
        int64_t n = ctx - c < CHUNK ? ctx - c : CHUNK, n16 = (n + 15) & ~15;
        const int64_t* row = rows[i];
        const float *fk = fks[i], *fv = fvs[i];
        if (c + CHUNK < ctx)
            chunk_rows(table, c + CHUNK, ctx, bs, hkv, h, D, kc, vc, ks, vs, rows[i ^ 1], fks[i ^ 1], fvs[i ^ 1], 1, KIND);
        for (int64_t g = 0; g < G; g++) {
            for (int64_t t = 0; t < n16; t += 16) {  /* 16 independent FMA chains, one a token */
                __m512 a[16];
                for (int j = 0; j < 16; j++) a[j] = _mm512_setzero_ps();
                for (int64_t d = 0; d < D; d += 16) {
                    __m512 qv = _mm512_load_ps(qs[g] + d);
                    #pragma GCC unroll 16
                    for (int j = 0; j < 16; j++)
                        a[4 * (j % 4) + j / 4] = _mm512_fmadd_ps(qv, load16(kc, row[t + j] + d, KIND), a[4 * (j % 4) + j / 4]);
                }
                _mm512_store_ps(p[g] + t, _mm512_mul_ps(sum16x16(a), _mm512_load_ps(fk + t)));
            }
            __mmask16 valid = n16 > n ? (__mmask16)((1u << (n - (n16 - 16))) - 1) : (__mmask16)0xFFFF;
            __m512 last = _mm512_load_ps(p[g] + n16 - 16);
            _mm512_store_ps(p[g] + n16 - 16, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), last));
            __m512 mxv = _mm512_load_ps(p[g]);
            for (int64_t t = 16; t < n16; t += 16) mxv = _mm512_max_ps(mxv, _mm512_load_ps(p[g] + t));
            float mx = _mm512_reduce_max_ps(mxv);
            if (mx > m[g]) {  /* the max grew: what was summed so far shrinks by exp(old - new) */
                float alpha = expf(m[g] - mx);
                __m512 av = _mm512_set1_ps(alpha);
                for (int64_t d = 0; d < D; d += 16) _mm512_store_ps(acc[g] + d, _mm512_mul_ps(av, _mm512_load_ps(acc[g] + d)));
                l[g] *= alpha;
                m[g] = mx;
            }
            __m512 sum = _mm512_setzero_ps(), mv = _mm512_set1_ps(m[g]);
            for (int64_t t = 0; t < n16; t += 16) {
                __m512 e = exp16(_mm512_sub_ps(_mm512_load_ps(p[g] + t), mv));
                if (t + 16 > n) e = _mm512_maskz_mov_ps(valid, e);  /* padding lanes: weight 0 */
                sum = _mm512_add_ps(sum, e);
                _mm512_store_ps(p[g] + t, _mm512_mul_ps(e, _mm512_load_ps(fv + t)));
            }
            l[g] += _mm512_reduce_add_ps(sum);
        }
        for (int64_t g0 = 0; g0 < G; g0 += 4) {
            int64_t gt = G - g0 < 4 ? G - g0 : 4, d = 0;
            for (; d + 64 <= D; d += 64) weighted_v_heads(acc, p, g0, gt, d, 4, vc, row, n, KIND);
            for (; d < D; d += 16) weighted_v_heads(acc, p, g0, gt, d, 1, vc, row, n, KIND);
        }
    }
    end_heads(G, D, acc, l, out);
}
#endif

/* D % 8 == 0, D <= MAX_D, H / Hkv <= MAX_G: checked by the caller. kv_kind: the caches' elements, 0 fp32, 1 int8
   (k_scale / v_scale: their rows' scales), 2 fp16 */
void dl_paged_decode(const float* q, int64_t ldq, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                     const void* k_cache, const void* v_cache, int kv_kind, const float* k_scale, const float* v_scale,
                     const int32_t* block_tables, int64_t ldbt, const int32_t* context_lens, int64_t bs,
                     float scale, float* out) {
    int64_t G = H / Hkv, work = 0;
    for (int64_t b = 0; b < B; b++) work += context_lens[b];
    work *= Hkv;
    #pragma omp parallel for schedule(dynamic, 1) if (B * Hkv > 1 && work >= parallel_min())
    for (int64_t i = 0; i < B * Hkv; i++) {
        int64_t b = i / Hkv, h = i % Hkv;
        const float* qp = q + b * ldq + h * G * D;
        float* op = out + (b * H + h * G) * D;
#if defined(__AVX512F__)
        if (D % 16 == 0) {
            const int32_t* t = block_tables + b * ldbt;
            if (kv_kind == 1) task16(qp, G, D, k_cache, v_cache, k_scale, v_scale, t, context_lens[b], bs, Hkv, h, scale, op, 1);
            else if (kv_kind == 2) task16(qp, G, D, k_cache, v_cache, 0, 0, t, context_lens[b], bs, Hkv, h, scale, op, 2);
            else task16(qp, G, D, k_cache, v_cache, 0, 0, t, context_lens[b], bs, Hkv, h, scale, op, 0);
            continue;
        }
#endif
        const int32_t* t = block_tables + b * ldbt;
        if (kv_kind == 1) task(qp, G, D, k_cache, v_cache, k_scale, v_scale, t, context_lens[b], bs, Hkv, h, scale, op, 1);
        else if (kv_kind == 2) task(qp, G, D, k_cache, v_cache, 0, 0, t, context_lens[b], bs, Hkv, h, scale, op, 2);
        else task(qp, G, D, k_cache, v_cache, 0, 0, t, context_lens[b], bs, Hkv, h, scale, op, 0);
    }
}

/* The step's new K/V rows into their cache slots (an fp32 cache): row i of k / v (row stride ldk / ldv, its Hkv * D
   values contiguous) to slot slots[i]; one call instead of an index_copy_ per cache, a layer's store at batch 1 */
void dl_store_kv(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t n, int64_t width,
                 const int64_t* slots, float* k_cache, float* v_cache) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(k_cache + slots[i] * width, k + i * ldk, width * sizeof(float));
        memcpy(v_cache + slots[i] * width, v + i * ldv, width * sizeof(float));
    }
}

/* The same into fp16 caches: each value rounded to the nearest fp16 (ties to even, as PyTorch's .half()). width is a
   multiple of 8 (Hkv * D, D % 8 == 0: checked by the caller) */
void dl_store_kv_f16(const float* k, int64_t ldk, const float* v, int64_t ldv, int64_t n, int64_t width,
                     const int64_t* slots, uint16_t* k_cache, uint16_t* v_cache) {
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < width; j += 8) {
            _mm_storeu_si128((__m128i*)(k_cache + slots[i] * width + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(k + i * ldk + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            _mm_storeu_si128((__m128i*)(v_cache + slots[i] * width + j),
                             _mm256_cvtps_ph(_mm256_loadu_ps(v + i * ldv + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        }
}
