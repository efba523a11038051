/* Our int8 kernel's second matmul, for many rows at once (a prompt's): `dl_int8_rows`, the arguments and the
   weights of `dl_int8_linear` (cpu_int8.h: the same packed codes, steps and offsets, 8-bit or 4-bit; int16
   activations on the 32767 grid; exact integer group sums), laid out the other way round. The AVX-512 build
   includes it (cpu_int8_avx512.c); the VNNI build did until session 31 and the AVX2 one (8 rows a ymm) until
   session 33, when their own blocks (outputs in the lanes) came to run as fast from 64 rows to 512, so they have
   none.

   The blocks of `dl_int8_linear` hold one (row, output) pair's products of a group in the lanes of a register, so
   every group of every pair ends with a conversion, an FMA and (at the end) a lane sum: about 4-5 instructions per
   32 products, whichever row count. Here a register's lanes are rows (16 in a zmm):
   each row's codes are transposed into dwords of two neighbouring k (`panels`), a weight's two codes at the same k
   are broadcast as one dword, and one vpmaddwd and one vpaddd add LANES rows x 2 products into LANES int32 sums,
   for as many k as a group has: 16 of them per group, LANES rows and output, then one conversion and one FMA by
   the group's step. A block is 2 x LANES rows x ROWS_OUT outputs (16 int32 accumulators), its weights widened to int16 once per call into a thread's buffer (L1-sized for K up to ~1500).
   Measured on an AMD Zen 5 (docs/kernels.md).

   Each row goes through the same operations in its lane whatever its block or batch, so a row gives the same bits
   alone or with others (not `dl_int8_linear`'s bits: that sums the same integers in another order). Its cost is
   LANES rows' work for a panel with fewer (padding lanes), hence many rows only: kernels/cpu_int8.py
   `Matrix.rows`, used for prompt tokens (engine_service/engine/models/int8_linear.py). */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "cpu_int8.h"

/* The register: 16 lanes (zmm); ROWS_OUT outputs a block (two packed groups of 4). DOT2 adds x . w (each lane's two
   int16 products) into acc, in place, in assembly: through the intrinsics GCC 12 adds into a copy of each
   accumulator and moves it back, or spills them. */
#define LANES 16
#define ROWS_OUT 8
typedef __m512i vint;
typedef __m512 vflt;
#define VLOADI(p) _mm512_loadu_si512((const void*)(p))
#define VSET1I(v) _mm512_set1_epi32(v)
#define VZEROI() _mm512_setzero_si512()
#define VZEROF() _mm512_setzero_ps()
#define VLOADF(p) _mm512_loadu_ps(p)
#define VSTOREF(p, v) _mm512_storeu_ps(p, v)
#define VSET1F(v) _mm512_set1_ps(v)
#define VFMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VCVT(v) _mm512_cvtepi32_ps(v)
#if defined(DL_SIMDE)
#define DOT2(acc, x, w) (acc = _mm512_add_epi32(acc, _mm512_madd_epi16(x, w)))
#else
#define DOT2(acc, x, w) do { __m512i t_; \
    __asm__("vpmaddwd %3, %2, %1\n\tvpaddd %1, %0, %0" : "+v"(acc), "=&v"(t_) : "v"(x), "v"(w)); } while (0)
#endif
/* output r of a packed group, weight group j: its two 16-byte pieces (pack(u): 32 bytes in one piece) */
#define PIECE(j, r, h) ((j) * 128 + (r) * 32 + (h) * 16)

/* x's M rows quantized (cpu_int8.h `quantize_rows`: steps xs, group sums xsum) and laid out as panels of LANES
   rows: panel b, dword p, lane l = row LANES b + l's int16 codes at k = 2p and 2p + 1 (zeros past M); the group sums
   likewise, panel b, group j, lane l. Returns 0, or -1 without memory. */
static int panels(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int64_t Gp, float* xs, float* xsum,
                  int32_t* xp, float* sp) {
    int64_t P = Kp / 2, B = (M + LANES - 1) / LANES;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        int16_t* xq = aligned_alloc(64, (size_t)LANES * Kp * sizeof(int16_t));
        if (!xq) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; b++) {
            if (!xq) continue;
            int64_t i0 = b * LANES, n = M - i0 < LANES ? M - i0 : LANES;
            quantize_rows(x + i0 * ldx, ldx, n, K, Kp, Gp, xq, xs + i0, xsum + i0 * Gp, 32767.0f);
            const int32_t* rows = (const int32_t*)xq;
            int32_t* o = xp + b * P * LANES;
            for (int64_t p = 0; p < P; p++)
                for (int64_t l = 0; l < LANES; l++) o[p * LANES + l] = l < n ? rows[l * P + p] : 0;
            float* so = sp + b * Gp * LANES;
            for (int64_t j = 0; j < Gp; j++)
                for (int64_t l = 0; l < LANES; l++) so[j * LANES + l] = l < n ? xsum[(i0 + l) * Gp + j] : 0.0f;
        }
        free(xq);
    }
    return failed ? -1 : 0;
}

/* outputs n0 on (ROWS_OUT, nb of them real) widened to int16, as dwords wb[p][o] = output o's codes at k = 2p and
   2p + 1, and their steps db[o][j] and offsets mb[o][j] as fp32 (zeros past nb), from the build's packed layout
   (cpu_int8.h `int8_linear`: pack(u), or pack4) */
static void widen(const uint8_t* wp, const char* dp, const char* mp, int64_t n0, int64_t nb, int64_t Kp,
                  int64_t Gp, int fmt, int32_t* wb, float* db, float* mb) {
    const int nib = fmt & FMT_NIBBLES, half = (fmt & FMT_HALF) != 0;
    const int64_t esz = half ? 2 : 4, G = Kp / 32, group_bytes = (nib ? 2 : 4) * Kp;
    memset(wb, 0, (size_t)ROWS_OUT * Kp * sizeof(int16_t));
    memset(db, 0, (size_t)ROWS_OUT * G * sizeof(float));
    memset(mb, 0, (size_t)ROWS_OUT * Gp * sizeof(float));
    for (int64_t o = 0; o < nb; o++) {
        int64_t t = (n0 + o) / 4, r = (n0 + o) % 4;
        const uint8_t* g = wp + t * group_bytes;
        const char* d = dp + t * G * 4 * esz;
        const char* m = mp + (n0 + o) * Gp * esz;
        for (int64_t j = 0; j < G; j++) {
            int32_t w[16];
            if (nib) {
                __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(g + j * 64 + r * 16)));
                _mm256_storeu_si256((__m256i*)w, _mm256_and_si256(v, _mm256_set1_epi16(0x0F)));
                _mm256_storeu_si256((__m256i*)(w + 8), _mm256_srli_epi16(v, 4));
            } else {
                for (int h = 0; h < 2; h++)
                    _mm256_storeu_si256((__m256i*)(w + 8 * h),
                                        _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(g + PIECE(j, r, h)))));
            }
            for (int q = 0; q < 16; q++) wb[(j * 16 + q) * ROWS_OUT + o] = w[q];
            const char* e = d + (j * 4 + r) * esz;
            db[o * G + j] = half ? _cvtsh_ss(*(const uint16_t*)e) : *(const float*)e;
        }
        for (int64_t j = 0; j < Gp; j++) {
            const char* e = m + j * esz;
            mb[o * Gp + j] = half ? _cvtsh_ss(*(const uint16_t*)e) : *(const float*)e;
        }
    }
}

#define ROWS_BLOCK static inline __attribute__((always_inline)) void

/* R panels (LANES rows each, P dwords apart) times the ROWS_OUT widened outputs: f[r][o] = sum over groups of step * the
   group's integer sum, then plus the offsets' term, one FMA each in group order */
ROWS_BLOCK rows_block(const int R, const int32_t* xp, const float* sp, int64_t Kp, int64_t Gp, const int32_t* wb,
                      const float* db, const float* mb, vflt f[2][ROWS_OUT]) {
    const int64_t P = Kp / 2, G = Kp / 32;
    for (int r = 0; r < R; r++)
        for (int o = 0; o < ROWS_OUT; o++) f[r][o] = VZEROF();
    for (int64_t j = 0; j < G; j++) {
        vint a[2][ROWS_OUT];
        for (int r = 0; r < R; r++)
            for (int o = 0; o < ROWS_OUT; o++) a[r][o] = VZEROI();
        const int32_t* xj = xp + j * 16 * LANES;
        const int32_t* wj = wb + j * 16 * ROWS_OUT;
#ifndef DL_SIMDE  /* (SIMDe's emulated 512-bit operations unrolled took GCC minutes to compile) */
        #pragma GCC unroll 16
#endif
        for (int q = 0; q < 16; q++) {
            vint x[2];
            for (int r = 0; r < R; r++) x[r] = VLOADI(xj + r * P * LANES + q * LANES);
            for (int o = 0; o < ROWS_OUT; o++) {
                vint w = VSET1I(wj[q * ROWS_OUT + o]);
                for (int r = 0; r < R; r++) DOT2(a[r][o], x[r], w);
            }
        }
        for (int o = 0; o < ROWS_OUT; o++) {
            vflt d = VSET1F(db[o * G + j]);
            for (int r = 0; r < R; r++) {  /* the fp32 sums stay in memory (L1): the registers hold the int32 ones */
                float* fo = (float*)&f[r][o];
                VSTOREF(fo, VFMADD(VCVT(a[r][o]), d, VLOADF(fo)));
            }
        }
    }
    for (int64_t j = 0; j < Gp; j++)
        for (int r = 0; r < R; r++) {
            vflt s = VLOADF(sp + r * Gp * LANES + j * LANES);
            for (int o = 0; o < ROWS_OUT; o++) f[r][o] = VFMADD(s, VSET1F(mb[o * Gp + j]), f[r][o]);
        }
}
static void rows_block1(const int32_t* xp, const float* sp, int64_t Kp, int64_t Gp, const int32_t* wb,
                        const float* db, const float* mb, vflt f[2][ROWS_OUT]) {
    rows_block(1, xp, sp, Kp, Gp, wb, db, mb, f);
}
static void rows_block2(const int32_t* xp, const float* sp, int64_t Kp, int64_t Gp, const int32_t* wb,
                        const float* db, const float* mb, vflt f[2][ROWS_OUT]) {
    rows_block(2, xp, sp, Kp, Gp, wb, db, mb, f);
}

/* `dl_int8_linear`'s arguments and result (0, or -1 without memory) */
int dl_int8_rows(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const void* dp,
                 const void* mp, const float* bias, float* y, int64_t N, int fmt) {
    int64_t Kp = (K + 31) / 32 * 32, Gp = (Kp / 32 + 7) / 8 * 8, B = (M + LANES - 1) / LANES, G = Kp / 32;
    float* xs = malloc((size_t)M * (1 + Gp) * sizeof(float));
    int32_t* xp = aligned_alloc(64, (size_t)(B * LANES * Kp * 2 + 63) / 64 * 64);
    float* sp = aligned_alloc(64, (size_t)(B * LANES * Gp * 4 + 63) / 64 * 64);
    if (!xs || !xp || !sp || panels(x, ldx, M, K, Kp, Gp, xs, xs + M, xp, sp)) {
        free(xs); free(xp); free(sp);
        return -1;
    }
    int64_t slabs = (N + ROWS_OUT - 1) / ROWS_OUT;
    int failed = 0;
    #pragma omp parallel reduction(|: failed)
    {
        int32_t* wb = aligned_alloc(64, (size_t)ROWS_OUT * Kp * sizeof(int16_t));
        float* db = malloc((size_t)ROWS_OUT * (G + Gp) * sizeof(float));
        if (!wb || !db) failed = 1;
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < slabs; t++) {
            if (!wb || !db) continue;
            int64_t n0 = t * ROWS_OUT, nb = N - n0 < ROWS_OUT ? N - n0 : ROWS_OUT;
            float* mb = db + ROWS_OUT * G;
            widen(wp, (const char*)dp, (const char*)mp, n0, nb, Kp, Gp, fmt, wb, db, mb);
            for (int64_t b = 0; b < B; b += 2) {
                int R = B - b >= 2 ? 2 : 1;
                vflt f[2][ROWS_OUT];
                (R == 2 ? rows_block2 : rows_block1)(xp + b * LANES * (Kp / 2), sp + b * LANES * Gp, Kp, Gp, wb, db, mb, f);
                for (int r = 0; r < R; r++) {
                    float lanes[ROWS_OUT][LANES];
                    for (int o = 0; o < ROWS_OUT; o++) VSTOREF(lanes[o], f[r][o]);
                    for (int64_t l = 0; l < LANES; l++) {
                        int64_t i = (b + r) * LANES + l;
                        if (i >= M) break;
                        for (int64_t o = 0; o < nb; o++) {
                            float v = lanes[o][l] * xs[i];
                            y[i * N + n0 + o] = bias ? v + bias[n0 + o] : v;
                        }
                    }
                }
            }
        }
        free(wb); free(db);
    }
    free(xs); free(xp); free(sp);
    return failed ? -1 : 0;
}
