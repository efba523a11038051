/* What the builds of the grouped int8 matmul share (cpu_int8.c, AVX2; cpu_int8_avx512.c, AVX-512; cpu_int8_vnni.c,
   AVX512-VNNI): the activations' int16 quantization (AVX2, which every AVX-512 CPU has), the weights' layout (slabs
   of 16 outputs, one a register lane), the split of the slabs between threads and of the rows into blocks.
   decodelab_kernels/_cbuild.py hashes this header with each source. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_simd.h"

/* every cache line of p[0, bytes) on its way to this core's L1 */
static inline void prefetch_lines(const void* p, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char*)p + i, _MM_HINT_T0);
}

/* row i of x to int16 on the grid max|x_i| / xmax (a build's XMAX), zero-padded to Kp; xs[i] the step (NaN for a
   row with a NaN or inf, so its outputs are NaN as fp32 sums would be); xsum[i][j] the sum of its j-th 32 (exact in
   fp32, zero from G up to Gp) */
static void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int64_t Gp, int16_t* xq,
                          float* xs, float* xsum, const float xmax) {
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < M; i++) {
        const float* r = x + i * ldx;
        int16_t* o = xq + i * Kp;
        /* bad: the sum of every x * 0, NaN iff some x is NaN or inf (max_ps would drop a NaN) */
        __m256 m8 = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            __m256 v = _mm256_loadu_ps(r + k);
            m8 = _mm256_max_ps(m8, _mm256_and_ps(v, absmask));
            bad = _mm256_add_ps(bad, _mm256_mul_ps(v, _mm256_setzero_ps()));
        }
        float a = 0.0f, b = hsum(bad);
        float lanes[8];
        _mm256_storeu_ps(lanes, m8);
        for (int t = 0; t < 8; t++) a = lanes[t] > a ? lanes[t] : a;
        for (; k < K; k++) { a = fabsf(r[k]) > a ? fabsf(r[k]) : a; b += r[k] * 0.0f; }
        int finite = b == 0.0f;
        float step = a > 0.0f ? a / xmax : 1.0f, inv = finite ? 1.0f / step : 0.0f;
        xs[i] = finite ? step : NAN;
        const __m256 vinv = _mm256_set1_ps(inv);
        k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k), vinv));
            __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(r + k + 8), vinv));
            /* packs works within 128-bit lanes: reorder its 64-bit quarters back to k order */
            __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
            _mm256_storeu_si256((__m256i*)(o + k), p);
        }
        for (; k < K; k++) o[k] = (int16_t)lrintf(r[k] * inv);
        for (; k < Kp; k++) o[k] = 0;
        for (int64_t j = 0; j < Gp; j++) {
            int32_t t = 0;
            for (int64_t e = 0; j * 32 < Kp && e < 32; e++) t += o[j * 32 + e];
            xsum[i * Gp + j] = (float)t;
        }
    }
}

/* A matrix's format (decodelab_kernels/cpu_int8.py `Matrix.fmt`): FMT_NIBBLES, 4-bit codes (two a byte) instead of 8-bit ones;
   FMT_HALF, its steps and offsets in fp16 instead of fp32 (where that rounding changes none of them: a GGUF's
   Q4_1 and Q8_0 scales are fp16 to begin with), 4 bytes fewer per 32 weights. */
#define FMT_NIBBLES 1
#define FMT_HALF 2

/* 8 offsets from m (fp32, or fp16 with half) */
static inline __m256 load8(const char* m, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)m)) : _mm256_loadu_ps((const float*)m);
}

#if defined(__AVX512F__) || defined(DL_SIMDE)
/* the AVX-512 builds' 16 steps or offsets from p: fp32, or fp16 with half */
static inline __m512 scales16(const char* p, int half) {
    if (!half) return _mm512_loadu_ps((const float*)p);
    __m256 a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
    __m256 b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
}

/* the AVX-512 builds' broadcast: the 4 bytes at p (a row's two int16 codes, or its 4 split bytes) as every 32-bit
   lane of a zmm (memcpy: they were written as other types) */
static inline __m512i bcast4(const void* p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }

/* the AVX-512 builds' end of a block: R rows' 16 output sums acc plus the offsets' term (each group's offsets times
   the row's group sum, group by group), times each row's step xs, plus the bias, to y (ldy apart by row; nb <= 16
   outputs real) */
static inline __attribute__((always_inline)) void slab_end16(const int R, __m512* acc, const float* xsum,
                                                              const float* xs, int64_t Kp, int64_t Gp, const char* mp,
                                                              const float* bias, float* y, int64_t ldy, int64_t nb,
                                                              const int half) {
    const int64_t esz = half ? 2 : 4;
    for (int64_t j = 0; j < Kp / 32; j++) {
        __m512 m = scales16(mp + j * 16 * esz, half);
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * Gp + j]), m, acc[r]);
    }
    for (int r = 0; r < R; r++) {
        __m512 v = _mm512_mul_ps(acc[r], _mm512_set1_ps(xs[r]));
        if (nb == 16) {  /* a whole slab: one store (the same additions as the outputs one by one below) */
            _mm512_storeu_ps(y + r * ldy, bias ? _mm512_add_ps(v, _mm512_loadu_ps(bias)) : v);
            continue;
        }
        float out[16];
        _mm512_storeu_ps(out, v);
        for (int64_t o = 0; o < nb; o++) y[r * ldy + o] = bias ? out[o] + bias[o] : out[o];
    }
}
#endif

/* the rows of chunk c of `chunks`, from row i0 of M on: M split evenly (chunks of at most 4: 8 -> 4 + 4, 7 -> 4 + 3;
   of at most 16: 35 -> 12 + 12 + 11) */
static inline int64_t chunk_rows(int64_t M, int64_t i0, int64_t chunks, int64_t c) {
    return (M - i0 + (chunks - c) - 1) / (chunks - c);
}

/* every row of xq (M rows, Kp apart; steps xs, group sums xsum) times one packed slab of 16 outputs g (nb <= 16 of
   them real), written to y (ldy apart by row) with the bias: each build's own blocks (`SLAB`) */
typedef void (*group_fn)(const int16_t* xq, const float* xsum, const float* xs, int64_t M, int64_t Kp, int64_t Gp,
                         const uint8_t* g, const char* d, const char* m, int64_t ahead, const float* bias, float* y,
                         int64_t ldy, int64_t nb, int fmt);

/* a build's own pass over the quantized rows before its blocks (NULL: none): xq's M rows, Kp int16 each, rewritten
   in place; returns 0, or -1 without memory */
typedef int (*prepare_fn)(int16_t* xq, int64_t M, int64_t Kp);

/* a build's own work in each thread before (begin 1) and after (begin 0) its share of the slabs of one call of M
   rows (NULL: none): the AMX build's tile configuration */
typedef void (*around_fn)(int begin, int64_t M);

/* wp: u packed in slabs of 16 outputs, (N + 15) / 16 of 16 * Kp bytes (FMT_NIBBLES: 4-bit codes, 8 * Kp), Kp = K
   rounded up to 32, laid out as the build's blocks read them (decodelab_kernels/cpu_int8.py `pack_wide`); dp: the steps,
   [(N + 15) / 16][Kp / 32][16]; mp: the offsets, [(N + 15) / 16][Gp][16], Gp = Kp / 32 rounded up to 8 (zeros past
   it) (`pack_wide_scales`); both fp32, or fp16 with FMT_HALF (decodelab_kernels/cpu_int8.py `Matrix`). `group` gets each slab
   in turn, OpenMP splitting them between threads. Returns 0, or -1 when the int16 copy of x could not be allocated.
   xmax and prepare: the build's activation grid and its pass over the quantized rows. reread: the row count from
   which the build's blocks read a slab more than once (0: never). around: the build's work in each thread around
   its share. */
static int int8_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const void* dp,
                       const void* mp, const float* bias, float* y, int64_t N, int fmt, group_fn group,
                       float xmax, prepare_fn prepare, int64_t reread, around_fn around) {
    const int64_t width = 16;
    int64_t Kp = (K + 31) / 32 * 32, Gp = (Kp / 32 + 7) / 8 * 8;
    /* 64-byte aligned (rows are 32 * Kp / 16 bytes long): an activation load never straddles two cache lines, which
       cost ~15% at 4 rows with malloc's 16-byte alignment */
    int16_t* xq = aligned_alloc(64, (size_t)(M * Kp * 2 + 63) / 64 * 64);
    float* xs = malloc((size_t)M * (1 + Gp) * sizeof(float));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    float* xsum = xs + M;
    quantize_rows(x, ldx, M, K, Kp, Gp, xq, xs, xsum, xmax);
    if (prepare && prepare(xq, M, Kp)) { free(xq); free(xs); return -1; }
    /* where the blocks read a slab more than once (from `reread` rows): prefetch the next slab (at least 1 KiB
       on) so the memory stream goes on during the later passes (the AVX2 build's at 8 rows: ~0.95x the time of
       1 KiB ahead, AMD Zen 5); else 1 KiB ahead */
    int64_t group_bytes = (fmt & FMT_NIBBLES ? Kp / 2 : Kp) * width, groups = (N + width - 1) / width;
    int64_t ahead = reread && M >= reread && group_bytes > 1024 ? group_bytes : 1024, esz = fmt & FMT_HALF ? 2 : 4;
    #pragma omp parallel
    {
        /* the activations were just written by the thread that quantized them: the others fetch a decode step's
           in order first, instead of missing on another core's cache line at a time inside their blocks' broadcasts
           (8 streams, 2 threads, AMD EPYC with its 2 vCPUs on separate cores: 1.02-1.05x the tokens a second, by
           the pairs). Prompt rows (past 32 KiB) stream in as their blocks read them. */
        if (omp_get_thread_num() != 0 && M * Kp * 2 <= 32768) {
            prefetch_lines(xq, M * Kp * 2);
            prefetch_lines(xs, M * (1 + Gp) * (int64_t)sizeof(float));
        }
        if (around) around(1, M);
#define DL_SLAB(t) do { int64_t n0 = (t) * width, nb = N - n0 < width ? N - n0 : width; \
            group(xq, xsum, xs, M, Kp, Gp, wp + (t) * group_bytes, (const char*)dp + n0 * (Kp / 32) * esz, \
                  (const char*)mp + n0 * Gp * esz, ahead, bias ? bias + n0 : 0, y + n0, N, nb, fmt); } while (0)
        /* From 4 rows the slabs go out guided (halves, then ever smaller pieces to whichever thread is free): two
           equal static halves ended 8-14 us apart a call on average on a VM's cores, and the other thread waited
           (8 streams, 2 threads, AMD EPYC: 1.055x and 1.059x the tokens a second by interleaved runs, 4 streams
           1.03x). At 1 row a call lasts ~20-70 us and the extra hand-outs cost more than they even out (0.97x):
           static there. */
        if (M >= 4) {
            #pragma omp for schedule(guided)
            for (int64_t t = 0; t < groups; t++) DL_SLAB(t);
        } else {
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < groups; t++) DL_SLAB(t);
        }
#undef DL_SLAB
        if (around) around(0, M);
    }
    free(xq); free(xs);
    return 0;
}

/* A build's `block`, R rows of xq times one packed slab of 16 outputs stored to y with the bias (a
   BLOCK(const int R, x, xsum, xs, Kp, Gp, g, d, m, ahead, bias, y, ldy, nb, const int nib, const int half)),
   compiled for a row count and each format (`FMT_*`) as block_R_fmt; `slab` runs every row of xq through one slab
   (nb of its outputs real), in even chunks of at most max_rows rows, by_fmt[fmt][rows] each. */
typedef void (*slab_block_fn)(const int16_t*, const float*, const float*, int64_t, int64_t, const uint8_t*,
                              const char*, const char*, int64_t, const float*, float*, int64_t, int64_t);
#define SLAB_FORMAT(block, R, fmt) \
    static void block##_##R##_##fmt(const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp, \
                                    const uint8_t* g, const char* d, const char* m, int64_t ahead, \
                                    const float* bias, float* y, int64_t ldy, int64_t nb) { \
        block(R, x, xsum, xs, Kp, Gp, g, d, m, ahead, bias, y, ldy, nb, (fmt) & FMT_NIBBLES, \
              ((fmt) & FMT_HALF) != 0); }
#define SLAB_ROWS(block, R) SLAB_FORMAT(block, R, 0) SLAB_FORMAT(block, R, 1) SLAB_FORMAT(block, R, 2) \
    SLAB_FORMAT(block, R, 3)
#define SLAB(by_fmt, max_rows) \
    static void slab(const int16_t* xq, const float* xsum, const float* xs, int64_t M, int64_t Kp, int64_t Gp, \
                     const uint8_t* g, const char* d, const char* m, int64_t ahead, const float* bias, float* y, \
                     int64_t ldy, int64_t nb, int fmt) { \
        int64_t chunks = (M + (max_rows) - 1) / (max_rows), i0 = 0; \
        for (int64_t c = 0; c < chunks; c++) { \
            int64_t r = chunk_rows(M, i0, chunks, c); \
            by_fmt[fmt][r](xq + i0 * Kp, xsum + i0 * Gp, xs + i0, Kp, Gp, g, d, m, ahead, bias, y + i0 * ldy, ldy, \
                           nb); \
            i0 += r; \
        } \
    }

/* The AVX-512 builds' blocks of up to 16 rows: `block` compiled for 1 to 16 rows and each format, and `slab` over
   them, in even chunks of at most 16 rows */
#define SLAB_BY_ROWS_16(block, f) {0, block##_1_##f, block##_2_##f, block##_3_##f, block##_4_##f, block##_5_##f, \
    block##_6_##f, block##_7_##f, block##_8_##f, block##_9_##f, block##_10_##f, block##_11_##f, block##_12_##f, \
    block##_13_##f, block##_14_##f, block##_15_##f, block##_16_##f}
#define SLABS_16(block) \
    SLAB_ROWS(block, 1) SLAB_ROWS(block, 2) SLAB_ROWS(block, 3) SLAB_ROWS(block, 4) SLAB_ROWS(block, 5) \
    SLAB_ROWS(block, 6) SLAB_ROWS(block, 7) SLAB_ROWS(block, 8) SLAB_ROWS(block, 9) SLAB_ROWS(block, 10) \
    SLAB_ROWS(block, 11) SLAB_ROWS(block, 12) SLAB_ROWS(block, 13) SLAB_ROWS(block, 14) SLAB_ROWS(block, 15) \
    SLAB_ROWS(block, 16) \
    static const slab_block_fn by_fmt[4][17] = {SLAB_BY_ROWS_16(block, 0), SLAB_BY_ROWS_16(block, 1), \
                                                SLAB_BY_ROWS_16(block, 2), SLAB_BY_ROWS_16(block, 3)}; \
    SLAB(by_fmt, 16)

/* the library's one function, `dl_int8_linear` (int8_linear's arguments), over a build's own `slab`, activation
   grid, preparation, `reread` rows and per-thread work around its share */
#define DL_INT8_LINEAR(group, xmax, prepare, reread, around) \
    int dl_int8_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const void* dp, \
                       const void* mp, const float* bias, float* y, int64_t N, int fmt) { \
        return int8_linear(x, ldx, M, K, wp, dp, mp, bias, y, N, fmt, group, xmax, prepare, reread, around); \
    }
