/* Paged decode attention on x86 CPUs with AVX2 and FMA: one query token per sequence against its cached K/V,
   read in place through the block table (no gather into a padded copy, no mask, no per-layer plan).

   q [B, H, D] fp32 (row stride ldq, heads contiguous); caches [num_blocks, block_size, Hkv, D], fp32 or int8
   (an int8 cache reads back as value * scale[block, slot, head], kernels/kv_int8.py: the scale of row r at r / D); block_tables [B, *] int32 (row
   stride ldbt); context_lens [B] int32; out [B, H, D] fp32 contiguous.

   One task per (sequence, KV head) computes its G = H / Hkv query heads, the group's K/V rows of a chunk of CHUNK
   context tokens staying in L1 between heads (the next chunk's rows prefetched meanwhile). Per chunk and head:
   the scores (8 tokens at a time), an online-softmax update (running max and sum, the accumulator rescaled when
   the max grows), the weights (a vectorized exp), then the weighted V rows into accumulators held in registers.
   A task's arithmetic depends on its own sequence only: a sequence gets the same bits alone or in any batch.
   Tasks are split between threads by OpenMP (PyTorch's libgomp, loaded first) once a step has enough work to pay
   for waking them (`parallel_min`). Built and loaded by kernels/cpu_decode_attention.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define CHUNK 64
#define MAX_D 256
#define MAX_G 16
/* below this many (context token x KV head) pairs a step's attention runs on the calling thread. With
   OMP_WAIT_POLICY=PASSIVE (play's default) the other thread sleeps and waking it (a futex) costs more than the work
   of a few short contexts (SmolLM2: 3 KV heads x ~100 tokens); otherwise it is spinning at the last barrier and
   taking half of 8 sequences x ~100 tokens is 0.6x the time (AMD Zen 5, 2 threads) */
static int64_t parallel_min(void) {
    static int64_t v = 0;  /* (a race here writes the same value) */
    if (!v) {
        const char* policy = getenv("OMP_WAIT_POLICY");
        v = policy && strcasecmp(policy, "passive") == 0 ? 8192 : 1024;
    }
    return v;
}

static inline __m256 load8(const void* base, int64_t i, const int I8) {
    if (I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)((const int8_t*)base + i))));
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
        int64_t h, int64_t D, const int I8) {
    int64_t end = ctx - c < CHUNK ? ctx : c + CHUNK, bytes = I8 ? D : D * 4;
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

static inline __attribute__((always_inline)) void task(
        const float* q, int64_t G, int64_t D, const void* kc, const void* vc, const float* ks, const float* vs,
        const int32_t* table, int64_t ctx, int64_t bs, int64_t hkv, int64_t h, float scale, float* out,
        const int I8) {
    float qs[MAX_G][MAX_D] __attribute__((aligned(32)));
    float acc[MAX_G][MAX_D] __attribute__((aligned(32)));
    float p[MAX_G][CHUNK] __attribute__((aligned(32)));  /* a chunk's scores, then their weights */
    float fk[CHUNK], fv[CHUNK];  /* an int8 cache's scale of each token's row */
    int64_t row[CHUNK];
    float m[MAX_G], l[MAX_G];
    for (int64_t g = 0; g < G; g++) {
        for (int64_t d = 0; d < D; d++) qs[g][d] = q[g * D + d] * scale;
        memset(acc[g], 0, D * sizeof(float));
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    prefetch_chunk(kc, vc, table, 0, ctx, bs, hkv, h, D, I8);
    for (int64_t c = 0; c < ctx; c += CHUNK) {
        int64_t n = ctx - c < CHUNK ? ctx - c : CHUNK, n8 = (n + 7) & ~7;
        if (c + CHUNK < ctx) prefetch_chunk(kc, vc, table, c + CHUNK, ctx, bs, hkv, h, D, I8);
        for (int64_t t = 0, bi = c / bs, slot = c % bs; t < n8; t++) {  /* (no division per token) */
            int64_t srow = (table[bi] * bs + slot) * hkv + h;
            row[t] = srow * D;
            fk[t] = I8 ? ks[srow] : 1.0f;
            fv[t] = I8 ? vs[srow] : 1.0f;
            if (t + 1 < n && ++slot == bs) {  /* rows past n repeat the last one: computed, then given weight 0 */
                slot = 0;
                bi++;
            }
        }
        for (int64_t g = 0; g < G; g++) {  /* scores, 8 tokens at a time: 8 independent FMA chains */
            for (int64_t t = 0; t < n8; t += 8) {
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
                for (int64_t d = 0; d < D; d += 8) {
                    __m256 qv = _mm256_load_ps(qs[g] + d);
                    a0 = _mm256_fmadd_ps(qv, load8(kc, row[t] + d, I8), a0);
                    a1 = _mm256_fmadd_ps(qv, load8(kc, row[t + 1] + d, I8), a1);
                    a2 = _mm256_fmadd_ps(qv, load8(kc, row[t + 2] + d, I8), a2);
                    a3 = _mm256_fmadd_ps(qv, load8(kc, row[t + 3] + d, I8), a3);
                    a4 = _mm256_fmadd_ps(qv, load8(kc, row[t + 4] + d, I8), a4);
                    a5 = _mm256_fmadd_ps(qv, load8(kc, row[t + 5] + d, I8), a5);
                    a6 = _mm256_fmadd_ps(qv, load8(kc, row[t + 6] + d, I8), a6);
                    a7 = _mm256_fmadd_ps(qv, load8(kc, row[t + 7] + d, I8), a7);
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
                    for (int k = 0; k < 8; k++) c[k] = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 8 * k, I8), c[k]);
                }
                for (int k = 0; k < 8; k++) _mm256_store_ps(acc[g] + d + 8 * k, c[k]);
            }
            for (; d < D; d += 32) {
                int64_t w = D - d < 32 ? D - d : 32;
                __m256 c0 = _mm256_load_ps(acc[g] + d), c1 = w > 8 ? _mm256_load_ps(acc[g] + d + 8) : c0;
                __m256 c2 = w > 16 ? _mm256_load_ps(acc[g] + d + 16) : c0, c3 = w > 24 ? _mm256_load_ps(acc[g] + d + 24) : c0;
                for (int64_t t = 0; t < n; t++) {
                    __m256 pt = _mm256_broadcast_ss(p[g] + t);
                    c0 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d, I8), c0);
                    if (w > 8) c1 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 8, I8), c1);
                    if (w > 16) c2 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 16, I8), c2);
                    if (w > 24) c3 = _mm256_fmadd_ps(pt, load8(vc, row[t] + d + 24, I8), c3);
                }
                _mm256_store_ps(acc[g] + d, c0);
                if (w > 8) _mm256_store_ps(acc[g] + d + 8, c1);
                if (w > 16) _mm256_store_ps(acc[g] + d + 16, c2);
                if (w > 24) _mm256_store_ps(acc[g] + d + 24, c3);
            }
        }
    }
    for (int64_t g = 0; g < G; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;  /* an empty context (never scheduled) gives zeros */
        for (int64_t d = 0; d < D; d++) out[g * D + d] = acc[g][d] * inv;
    }
}

/* D % 8 == 0, D <= MAX_D, H / Hkv <= MAX_G: checked by the caller */
void dl_paged_decode(const float* q, int64_t ldq, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                     const void* k_cache, const void* v_cache, int is_int8, const float* k_scale, const float* v_scale,
                     const int32_t* block_tables, int64_t ldbt, const int32_t* context_lens, int64_t bs,
                     float scale, float* out) {
    int64_t G = H / Hkv, work = 0;
    for (int64_t b = 0; b < B; b++) work += context_lens[b];
    work *= Hkv;
    #pragma omp parallel for schedule(dynamic, 1) if (work >= parallel_min())
    for (int64_t i = 0; i < B * Hkv; i++) {
        int64_t b = i / Hkv, h = i % Hkv;
        const float* qp = q + b * ldq + h * G * D;
        float* op = out + (b * H + h * G) * D;
        if (is_int8)
            task(qp, G, D, k_cache, v_cache, k_scale, v_scale, block_tables + b * ldbt, context_lens[b], bs, Hkv, h,
                 scale, op, 1);
        else
            task(qp, G, D, k_cache, v_cache, k_scale, v_scale, block_tables + b * ldbt, context_lens[b], bs, Hkv, h,
                 scale, op, 0);
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
