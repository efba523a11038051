/* cpu_int8.c's matmul (grouped 8-bit or 4-bit weights x int16-quantized activations, the same weight format and
   the same integer group sums) for x86 CPUs with AVX512-VNNI: Intel Xeons since Cascade Lake, AMD Zen 4 and 5.
   decodelab_kernels/cpu_int8.py picks it where the CPU has avx512_vnni (DECODELAB_INT8_KERNEL=avx512 forces cpu_int8_avx512.c).

   vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each 4 neighbouring products into 16 int32
   lanes. The weight codes are the unsigned bytes as they are; an activation's int16 code x is split into two signed
   bytes, hi = (x + 128) >> 8 and lo = x - 256 hi (so the grid stops at 127 * 256 + 127 = 32639, XMAX, where the
   other builds' stops at 32767: the same relative error, ~1.5e-5), and a group's sum is (w . hi) * 256 + w . lo.
   No 8-bit rounding of the activations (the loss that kept this instruction out before); the integers are
   exactly the other builds' w . x. Where the AVX-512 build widens every code to int16 and needs a vpmaddwd, a
   conversion and an FMA per output and group, the bytes here go in as loaded (4-bit: a mask and a shift). Measured
   against that build on an AMD Zen 5 in session 28 (SmolLM2's 4-bit decoder, 2 threads, this build's first
   blocks): 0.88x its time at 1 row, 0.81x at 8.

   Lanes (since session 31): a zmm holds 16 outputs, one a lane, each lane 4 neighbouring k of its output; the
   weights come in slabs of 16 outputs (decodelab_kernels/cpu_int8.py `pack_wide`: a k-group is 8 zmm of codes, or 4 of
   nibble bytes whose low nibbles are k 4q.. and high ones k 16 + 4q..), and a row's 4 bytes at those k are
   broadcast to every lane. Per row, group and slab: 16 vpdpbusd (8 for hi, 8 for lo), a shift and an add, then
   one conversion and one FMA by the 16 outputs' steps (stored 16 a group, as the offsets): a lane ends as its
   output's sum, so no lane sums follow. The codes of a k-group are loaded and split once for up to WIDE_ROWS
   rows. Before, a zmm held a group of 4 outputs (4 lanes each) and every 4 outputs paid the shift, conversion and
   FMA, and 4 broadcasts of 16 bytes; on an AMD Zen 5 (SmolLM2's 120 4-bit decoder matrices with fp16 steps, 1 and
   2 threads) this layout takes 0.83-0.86x that one's time at 1 row, ~0.70x at 8, 0.53-0.58x at 16-128 rows, and as
   fast as the many-rows matmul from 64 rows to 512, so this build has none (docs/kernels.md).

   Each row goes through the same operations whichever block computes it (a block is one to WIDE_ROWS rows of one
   slab), so a row gives the same bits alone or in any batch (not the other builds' bits: another order). */
#include "cpu_simde512.h"
#include <immintrin.h>
#include "cpu_simd.h"
#include "cpu_int8.h"
#include <stdint.h>
#include <string.h>

#define XMAX 32639.0f

/* each row's int16 codes to its hi bytes (Kp of them) followed by its lo bytes, in the row's own 2 * Kp bytes */
static int split_rows(int16_t* xq, int64_t M, int64_t Kp) {
    int16_t* row = malloc((size_t)Kp * sizeof(int16_t));
    if (!row) return -1;
    const __m512i half = _mm512_set1_epi16(128);
    for (int64_t i = 0; i < M; i++) {
        int8_t* out = (int8_t*)(xq + i * Kp);
        memcpy(row, xq + i * Kp, (size_t)Kp * sizeof(int16_t));
        for (int64_t k = 0; k < Kp; k += 32) {
            __m512i x = _mm512_loadu_si512((const void*)(row + k));
            __m512i hi = _mm512_srai_epi16(_mm512_add_epi16(x, half), 8);
            __m512i lo = _mm512_sub_epi16(x, _mm512_slli_epi16(hi, 8));
            _mm256_storeu_si256((__m256i*)(out + k), _mm512_cvtepi16_epi8(hi));
            _mm256_storeu_si256((__m256i*)(out + Kp + k), _mm512_cvtepi16_epi8(lo));
        }
    }
    free(row);
    return 0;
}

#define BLOCK static inline __attribute__((always_inline)) void
#define WIDE_ROWS 16  /* rows a block: a k-group's weights are decoded once for up to 16 rows */

/* R rows of split activations (2 * Kp bytes apart; group sums Gp apart in xsum) times one packed slab of 16
   outputs (`pack_wide`: a k-group's codes as 8 (4-bit: 4) zmm of 16 outputs x 4 neighbouring k), its steps dp and
   offsets mp 16 a group; y, ldy apart by row: nb <= 16 outputs times each row's step xs, plus bias. R is a
   constant in each caller. Each k-group prefetches `ahead` bytes on. */
BLOCK wide(const int R, const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp,
           const uint8_t* g, const char* dp, const char* mp, int64_t ahead, const float* bias, float* y, int64_t ldy,
           int64_t nb, const int nib, const int half) {
    __m512 acc[WIDE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t stride = nib ? 256 : 512, esz = half ? 2 : 4;
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t k = 0; k < Kp; k += 32, g += stride, dp += 16 * esz) {
        for (int64_t b = 0; b < stride; b += 64) _mm_prefetch((const char*)g + ahead + b, _MM_HINT_T0);
        __m512i w[8];  /* w[q]: the 16 outputs' codes at k 4q .. 4q + 3 */
        if (nib) {
            for (int q = 0; q < 4; q++) {
                __m512i v = _mm512_loadu_si512((const void*)(g + 64 * q));
                w[q] = _mm512_and_si512(v, nibble);
                w[q + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            }
        } else {
            for (int q = 0; q < 8; q++) w[q] = _mm512_loadu_si512((const void*)(g + 64 * q));
        }
        __m512 step = scales16(dp, half);
        for (int r = 0; r < R; r++) {
            const int8_t* hi = (const int8_t*)(x + r * Kp) + k, *lo = hi + Kp;
            __m512i th = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(hi));
            __m512i tl = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], bcast4(lo));
            for (int q = 1; q < 8; q++) {
                th = _mm512_dpbusd_epi32(th, w[q], bcast4(hi + 4 * q));
                tl = _mm512_dpbusd_epi32(tl, w[q], bcast4(lo + 4 * q));
            }
            __m512i t = _mm512_add_epi32(_mm512_slli_epi32(th, 8), tl);  /* w . x: (w . hi) * 256 + w . lo */
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), step, acc[r]);
        }
    }
    slab_end16(R, acc, xsum, xs, Kp, Gp, mp, bias, y, ldy, nb, half);
}

/* `wide` compiled for each row count (1 to WIDE_ROWS) and each format, and `slab` over them, in even chunks of at
   most WIDE_ROWS rows (cpu_int8.h) */
SLABS_16(wide)

#ifdef DL_AMX
/* The AMX build (-DDL_AMX: Intel Xeons since Sapphire Rapids, AMX-INT8): blocks of 16 rows go through the tiles,
   the rest through `wide` above, with the same integers and the same fp32 operations in the same order, so it gives
   this build's bits (a row alone or in any batch alike). Per k-group of 32 and 16 rows of one slab: each 8 rows'
   split bytes as one tile of 16 rows x 32 bytes (signed; a row's hi bytes, then its lo bytes: a row of xq is its
   Kp hi bytes and its Kp lo bytes, so a stride of Kp bytes interleaves them), the slab's codes as one tile of
   8 x 64 bytes (unsigned: `pack_wide`'s 8 pieces of 16 outputs x 4 k are a tile's rows as stored; 4-bit codes are
   split into that form once per slab), two TDPBSUD (the 256 vpdpbusd of `wide`), the int32 sums out of the tiles
   and `wide`'s shift, add, conversion and FMA by the steps. A group's fp32 step means leaving the tiles every 32 k:
   those and the tile stores, not the products, are most of the time. */
#include "cpu_amx.h"

#define AMX_ROWS 16  /* rows of a tile block */
/* the tiles (literal numbers: the intrinsics paste them into the instruction): the sums of rows 0-7 and 8-15 (a
   row's hi sums, then its lo sums), those rows' split bytes, the codes */
#define T_S0 0
#define T_S1 1
#define T_X0 2
#define T_X1 3
#define T_W 4

/* the tile shapes: 16 rows of 64 bytes for the sums, of 32 bytes for the split bytes, 8 of 64 for the codes (a
   constant in memory: GCC 12 drops the stores to a local configuration before ldtilecfg reads it) */
static const amx_config tile_shapes = {
    .palette = 1,
    .colsb = {[T_S0] = 64, [T_S1] = 64, [T_X0] = 32, [T_X1] = 32, [T_W] = 64},
    .rows = {[T_S0] = 16, [T_S1] = 16, [T_X0] = 16, [T_X1] = 16, [T_W] = 8},
};

/* each thread's tile shapes for a call of at least AMX_ROWS rows, loaded in every call: other code in the thread
   (oneDNN's AMX matmuls) may have configured the tiles its own way */
static void amx_around(int begin, int64_t M) {
    if (M < AMX_ROWS) return;
    if (begin) amx_load_config(&tile_shapes);
    else amx_release();
}

/* 16 rows of split activations (as `wide` reads them) times one slab whose codes are 8-bit, 512 bytes a k-group
   (`pack_wide`'s, or a 4-bit slab's split by `slab_amx`), through the tiles. (Issuing group k + 1's products into
   a second pair of sum tiles before scaling group k's sums measured slower: 1.22x the time at 128 rows.) */
BLOCK tiles16(const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp, const uint8_t* g,
              const char* dp, const char* mp, const float* bias, float* y, int64_t ldy, int64_t nb, const int half) {
    __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    int32_t sums[AMX_ROWS][2][16] __attribute__((aligned(64)));  /* row r's hi sums, then its lo sums */
    const int8_t* xb = (const int8_t*)x;
    const int64_t esz = half ? 2 : 4;
    for (int64_t k = 0; k < Kp; k += 32, g += 512, dp += 16 * esz) {
        AMX_LOAD(T_W, g, 64);
        AMX_LOAD(T_X0, xb + k, Kp);
        AMX_LOAD(T_X1, xb + 16 * Kp + k, Kp);
        AMX_ZERO(T_S0);
        AMX_ZERO(T_S1);
        AMX_DPBSUD(T_S0, T_X0, T_W);
        AMX_DPBSUD(T_S1, T_X1, T_W);
        AMX_STORE(T_S0, sums[0], 64);
        AMX_STORE(T_S1, sums[8], 64);
        __m512 step = scales16(dp, half);
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) {
            __m512i t = _mm512_add_epi32(_mm512_slli_epi32(_mm512_load_si512((const void*)sums[r][0]), 8),
                                         _mm512_load_si512((const void*)sums[r][1]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), step, acc[r]);
        }
    }
    /* slab_end16 gets a copy: acc itself never has its address taken, so it stays in registers across the tile
       instructions (inline assembly that clobbers memory: with acc addressed, GCC kept it on the stack and
       stored and reloaded all 16 around each tile store, 1.14x the time at 128 rows) */
    __m512 out[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) _mm512_store_ps((float*)&out[r], acc[r]);
    slab_end16(AMX_ROWS, out, xsum, xs, Kp, Gp, mp, bias, y, ldy, nb, half);
}

static void tiles16_f32(const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp,
                        const uint8_t* g, const char* d, const char* m, const float* bias, float* y, int64_t ldy,
                        int64_t nb) { tiles16(x, xsum, xs, Kp, Gp, g, d, m, bias, y, ldy, nb, 0); }
static void tiles16_f16(const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp,
                        const uint8_t* g, const char* d, const char* m, const float* bias, float* y, int64_t ldy,
                        int64_t nb) { tiles16(x, xsum, xs, Kp, Gp, g, d, m, bias, y, ldy, nb, 1); }

/* a slab's 4-bit codes (256 bytes a k-group) as 8-bit ones in `pack_wide`'s 8-bit layout (512 bytes a k-group):
   piece q's low nibbles are k 4q.., its high ones k 16 + 4q.., pieces q and q + 4 */
static void split_nibbles(const uint8_t* g, int64_t Kp, uint8_t* codes) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t k = 0; k < Kp; k += 32, g += 256, codes += 512)
        for (int q = 0; q < 4; q++) {
            __m512i v = _mm512_loadu_si512((const void*)(g + 64 * q));
            _mm512_store_si512((void*)(codes + 64 * q), _mm512_and_si512(v, nibble));
            _mm512_store_si512((void*)(codes + 64 * (q + 4)), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
        }
}

/* each thread's 8-bit copy of a 4-bit slab (16 * Kp bytes), grown as needed and kept for the thread's life */
static _Thread_local uint8_t* scratch;
static _Thread_local int64_t scratch_bytes;

/* every row of xq times one slab: whole blocks of 16 rows through the tiles, the rest through `slab`. The slab's
   codes stream in once (a 4-bit slab split into the thread's scratch) for all its blocks. */
static void slab_amx(const int16_t* xq, const float* xsum, const float* xs, int64_t M, int64_t Kp, int64_t Gp,
                     const uint8_t* g, const char* d, const char* m, int64_t ahead, const float* bias, float* y,
                     int64_t ldy, int64_t nb, int fmt) {
    int64_t whole = M / AMX_ROWS * AMX_ROWS;
    const uint8_t* codes = g;
    if (whole && (fmt & FMT_NIBBLES)) {
        if (scratch_bytes < 16 * Kp) {
            uint8_t* grown = aligned_alloc(64, (size_t)16 * Kp);
            if (!grown) whole = 0;  /* no memory for the copy: every row through `wide`, which needs none */
            else { free(scratch); scratch = grown, scratch_bytes = 16 * Kp; }
        }
        if (whole) split_nibbles(g, Kp, scratch), codes = scratch;
    }
    for (int64_t i0 = 0; i0 < whole; i0 += AMX_ROWS)
        (fmt & FMT_HALF ? tiles16_f16 : tiles16_f32)(xq + i0 * Kp, xsum + i0 * Gp, xs + i0, Kp, Gp, codes, d, m, bias,
                                                    y + i0 * ldy, ldy, nb);
    if (whole < M)
        slab(xq + whole * Kp, xsum + whole * Gp, xs + whole, M - whole, Kp, Gp, g, d, m, ahead, bias, y + whole * ldy,
             ldy, nb, fmt);
}

/* 0 where this process may use the tiles (decodelab_kernels/cpu_int8.py asks once, before the first matmul), else -1 */
int dl_int8_ready(void) { return amx_request(); }

DL_INT8_LINEAR(slab_amx, XMAX, split_rows, 0, amx_around)
#else
DL_INT8_LINEAR(slab, XMAX, split_rows, 0, 0)
#endif
