/* What the builds of the grouped int8 matmul share (cpu_int8.c, AVX2; cpu_int8_avx512.c, AVX-512; cpu_int8_vnni.c,
   AVX512-VNNI): the activations' int16 quantization (AVX2, which every AVX-512 CPU has), the split of the outputs
   between threads, and the AVX-512 build's offsets' term and lane sums. kernels/_cbuild.py hashes this header with
   each source. */
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "cpu_simd.h"

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

/* A matrix's format (kernels/cpu_int8.py `Matrix.fmt`): FMT_NIBBLES, 4-bit codes (`pack4`) instead of 8-bit ones;
   FMT_HALF, its steps and offsets in fp16 instead of fp32 (where that rounding changes none of them: a GGUF's
   Q4_1 and Q8_0 scales are fp16 to begin with), 4 bytes fewer per 32 weights. */
#define FMT_NIBBLES 1
#define FMT_HALF 2

/* 8 offsets from m (fp32, or fp16 with half) */
static inline __m256 load8(const char* m, int half) {
    return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)m)) : _mm256_loadu_ps((const float*)m);
}

/* f += the offsets' term, sum over groups of offset * the row's group sum (8 groups a step, in order) */
static inline __m256 offsets(__m256 f, const float* xsum, const char* m, int64_t Gp, int half) {
    for (int64_t j = 0; j < Gp; j += 8)
        f = _mm256_fmadd_ps(_mm256_loadu_ps(xsum + j), load8(m + j * (half ? 2 : 4), half), f);
    return f;
}

/* a group's 4 steps as fp32: read in place, or (half) converted from fp16 into ds[4] */
#define STEPS(p, ds) (half ? (_mm_storeu_ps(ds, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)(p)))), (const float*)(ds)) \
                           : (const float*)(p))

/* the lane sums of 4 accumulators [s0 s1 s2 s3], each in the same fixed order */
static inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* a block: rows of xq (Kp apart; their group sums Gp apart) times a packed group g with its steps d and offsets m
   (each build's own shapes), its sums to s[row][output] */
typedef void (*block_fn)(const int16_t*, const float*, int64_t, int64_t, const uint8_t*, const char*, const char*,
                         int64_t, float[4][4]);

/* the rows of chunk c of `chunks`, from row i0 of M on: M split evenly (chunks of at most 4: 8 -> 4 + 4, 7 -> 4 + 3) */
static inline int64_t chunk_rows(int64_t M, int64_t i0, int64_t chunks, int64_t c) {
    return (M - i0 + (chunks - c) - 1) / (chunks - c);
}

/* a chunk's r rows x nb outputs of block sums s to y (ldy apart by row): times each row's step xs, plus the bias */
static inline void store(float s[4][4], int64_t r, int64_t nb, const float* xs, const float* bias, float* y,
                         int64_t ldy) {
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < nb; j++) {
            float v = s[i][j] * xs[i];
            y[i * ldy + j] = bias ? v + bias[j] : v;
        }
}

/* every row of xq (M rows, Kp apart; steps xs, group sums xsum) times one group of 4 packed output rows g (nb <= 4
   of them real; the VNNI and AVX2 builds: a slab of 16, nb <= 16), written to y (ldy apart by row) with the bias:
   each build's own blocks */
typedef void (*group_fn)(const int16_t* xq, const float* xsum, const float* xs, int64_t M, int64_t Kp, int64_t Gp,
                         const uint8_t* g, const char* d, const char* m, int64_t ahead, const float* bias, float* y,
                         int64_t ldy, int64_t nb, int fmt);

/* a build's own pass over the quantized rows before its blocks (NULL: none): xq's M rows, Kp int16 each, rewritten
   in place; returns 0, or -1 without memory */
typedef int (*prepare_fn)(int16_t* xq, int64_t M, int64_t Kp);

/* wp: u packed, (N + 3) / 4 groups of 4 * Kp bytes (FMT_NIBBLES: 4-bit codes, 2 * Kp bytes), Kp = K rounded up to
   32, laid out as the build's blocks read them (kernels/cpu_int8.py `pack`, `pack4`); dp: the steps,
   [(N + 3) / 4][Kp / 32][4]; mp: the offsets, [(N + 3) / 4 * 4][Gp], Gp = Kp / 32 rounded up to 8 (zeros past it);
   both fp32, or fp16 with FMT_HALF (kernels/cpu_int8.py `Matrix`). With width 16 (the VNNI and AVX2 builds) the
   same in slabs of 16 outputs: (N + 15) / 16 of 16 * Kp bytes (4-bit: 8 * Kp), steps [(N + 15) / 16][Kp / 32][16],
   offsets [(N + 15) / 16][Gp][16] (`pack_wide`, `pack_wide_scales`). `group` gets each `width` outputs in turn, OpenMP
   splitting them between threads. Returns 0, or -1 when the int16 copy of x could not be allocated. xmax and
   prepare: the build's activation grid and its pass over the quantized rows. reread: the row count from which the
   build's blocks read a group more than once (0: never). */
static int int8_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const void* dp,
                       const void* mp, const float* bias, float* y, int64_t N, int fmt, group_fn group,
                       float xmax, prepare_fn prepare, int64_t width, int64_t reread) {
    int64_t Kp = (K + 31) / 32 * 32, Gp = (Kp / 32 + 7) / 8 * 8;
    /* 64-byte aligned (rows are 32 * Kp / 16 bytes long): an activation load never straddles two cache lines, which
       cost ~15% at 4 rows with malloc's 16-byte alignment */
    int16_t* xq = aligned_alloc(64, (size_t)(M * Kp * 2 + 63) / 64 * 64);
    float* xs = malloc((size_t)M * (1 + Gp) * sizeof(float));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    float* xsum = xs + M;
    quantize_rows(x, ldx, M, K, Kp, Gp, xq, xs, xsum, xmax);
    if (prepare && prepare(xq, M, Kp)) { free(xq); free(xs); return -1; }
    /* where the blocks read a group more than once (from `reread` rows): prefetch the next group (at least 1 KiB
       on) so the memory stream goes on during the later passes (the AVX2 build's slab at 8 rows: ~0.95x the time
       of 1 KiB ahead, AMD Zen 5); else 1 KiB ahead */
    int64_t group_bytes = (fmt & FMT_NIBBLES ? Kp / 2 : Kp) * width, groups = (N + width - 1) / width;
    int64_t ahead = reread && M >= reread && group_bytes > 1024 ? group_bytes : 1024, esz = fmt & FMT_HALF ? 2 : 4;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < groups; t++) {
        int64_t n0 = t * width, nb = N - n0 < width ? N - n0 : width;
        group(xq, xsum, xs, M, Kp, Gp, wp + t * group_bytes, (const char*)dp + n0 * (Kp / 32) * esz,
              (const char*)mp + n0 * Gp * esz, ahead, bias ? bias + n0 : 0, y + n0, N, nb, fmt);
    }
    free(xq); free(xs);
    return 0;
}

/* The AVX-512 builds' `group` over their own `block` (R rows of xq times one packed group of 4 outputs, in a given
   format: a BLOCK(const int R, ..., const int nib, const int half)), compiled for each row count (1-4) and each
   format (`FMT_*`); `group` runs every row of xq, in even chunks of at most 4 rows (8 -> 4 + 4, 7 -> 4 + 3). */
#define BLOCK_FORMAT(block, R, fmt) \
    static void block_##R##_##fmt(const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g, \
                                  const char* d, const char* m, int64_t ahead, float s[4][4]) { \
        block(R, x, xsum, Kp, Gp, g, d, m, ahead, s, (fmt) & FMT_NIBBLES, ((fmt) & FMT_HALF) != 0); }
#define BLOCK_ROWS(block, R) BLOCK_FORMAT(block, R, 0) BLOCK_FORMAT(block, R, 1) BLOCK_FORMAT(block, R, 2) \
    BLOCK_FORMAT(block, R, 3)
#define BLOCKS_BY_ROWS(f) {0, block_1_##f, block_2_##f, block_3_##f, block_4_##f}
#define BLOCKS_AND_GROUP(block) \
    BLOCK_ROWS(block, 1) BLOCK_ROWS(block, 2) BLOCK_ROWS(block, 3) BLOCK_ROWS(block, 4) \
    static void group(const int16_t* xq, const float* xsum, const float* xs, int64_t M, int64_t Kp, int64_t Gp, \
                      const uint8_t* g, const char* d, const char* m, int64_t ahead, const float* bias, float* y, \
                      int64_t ldy, int64_t nb, int fmt) { \
        static const block_fn by_fmt[4][5] = {BLOCKS_BY_ROWS(0), BLOCKS_BY_ROWS(1), BLOCKS_BY_ROWS(2), \
                                              BLOCKS_BY_ROWS(3)}; \
        const block_fn* by_rows = by_fmt[fmt]; \
        int64_t chunks = (M + 3) / 4, i0 = 0; \
        for (int64_t c = 0; c < chunks; c++) { \
            int64_t r = chunk_rows(M, i0, chunks, c); \
            float s[4][4]; \
            by_rows[r](xq + i0 * Kp, xsum + i0 * Gp, Kp, Gp, g, d, m, ahead, s); \
            store(s, r, nb, xs + i0, bias, y + i0 * ldy, ldy); \
            i0 += r; \
        } \
    }

/* The slab builds' (VNNI, AVX2) `block`, R rows of xq times one packed slab of 16 outputs stored to y with the bias (a
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

/* the library's one function, `dl_int8_linear` (int8_linear's arguments), over a build's own `group`, activation
   grid, preparation, width (outputs a `group` call: 4, or 16) and `reread` rows */
#define DL_INT8_LINEAR(group, xmax, prepare, width, reread) \
    int dl_int8_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const void* dp, \
                       const void* mp, const float* bias, float* y, int64_t N, int fmt) { \
        return int8_linear(x, ldx, M, K, wp, dp, mp, bias, y, N, fmt, group, xmax, prepare, width, reread); \
    }
