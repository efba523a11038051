/* cpu_int8.c's matmul (grouped 8-bit or 4-bit weights x int16-quantized activations, the same weight format and
   the same integer group sums) for x86 CPUs with AVX512-VNNI: Intel Xeons since Cascade Lake, AMD Zen 4 and 5.
   kernels/cpu_int8.py picks it where the CPU has avx512_vnni (DECODELAB_INT8_KERNEL=avx512 forces cpu_int8_avx512.c).

   vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each 4 neighbouring products into 16 int32
   lanes. The weight codes are the unsigned bytes as they are; an activation's int16 code x is split into two signed
   bytes, hi = (x + 128) >> 8 and lo = x - 256 hi (so the grid stops at 127 * 256 + 127 = 32639, XMAX, where the
   other builds' stops at 32767: the same relative error, ~1.5e-5), and a group's sum is (w . hi) * 256 + w . lo:
   four vpdpbusd and a shift for 32 weights x 4 outputs of 4-bit codes. No 8-bit rounding of the activations (the
   loss that kept this instruction out before); the integers are exactly the other builds' w . x. Where the
   AVX-512 build widens every code to int16 and needs a vpmaddwd, a conversion and an FMA per output and group,
   one zmm here holds a whole group of 4 outputs: the weights' bytes go in as loaded (4-bit: a mask and a shift),
   and one conversion and one FMA per group serve all 4 outputs: per group and row, about 2.5x fewer instructions
   at 1 row and 2x at 4, on paper. Measured on an AMD Zen 5 (SmolLM2's 4-bit decoder, 2 threads): 0.88x the
   AVX-512 build's time at 1 row and 0.81x at 8 (docs/kernels.md); 8-bit codes at 1 row are bound by memory in both.

   Lanes: 4-bit, a group's 64 bytes are 4 outputs x 16 bytes (`pack4`), so the low nibbles give lanes 4o..4o+3 of
   output o's k 0-15, the high nibbles k 16-31, against the row's 16 hi (or lo) bytes repeated 4 times; 8-bit, 128
   bytes are 4 outputs x 32 (`pack(u, 32)`, the AVX-512 layout), two zmm of 2 outputs, lanes 8o..8o+7, against the
   row's 32 bytes twice. After the last group each output's lanes go to 8 (zero-padded from 4), the offsets' term
   and cpu_int8.h's lane sums follow. Every row goes through the same operations whichever block computes it, so a
   row gives the same bits alone or in any batch (not the other builds' bits: fewer lanes, another order). */
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

/* t = (w . hi) * 256 + w . lo over one zmm of weight bytes, against a row's hi and lo bytes arranged as its lanes */
static inline __m512i dot(__m512i w, __m512i hi, __m512i lo) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, hi);
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), w, lo);
}
/* the 4-bit form: the group's low nibbles against k 0-15, the high ones against k 16-31 */
static inline __m512i dot4(__m512i wl, __m512i wh, __m512i hl, __m512i hh, __m512i ll, __m512i lh) {
    __m512i t = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, hl), wh, hh);
    return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_slli_epi32(t, 8), wl, ll), wh, lh);
}
static inline __m512i rep4(const int8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)); }
static inline __m512i rep2(const int8_t* p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)p)); }

/* R rows of split activations (2 * Kp bytes apart; group sums Gp apart in xsum) times packed group g's 4 outputs,
   over Kp / 32 weight groups; dp: the 4 outputs' steps, 4 a group; m: the first output's offsets, Gp apart (fp16
   with half, else fp32). s[r][o]: row r, output o. R is a constant in each caller: the loops unroll. */
BLOCK block(const int R, const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g,
            const char* dp, const char* m, int64_t ahead, float s[4][4], const int nib, const int half) {
    __m512 acc[4][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t stride = nib ? 64 : 128, esz = half ? 2 : 4;
    /* a group's 4 steps to the lanes of their outputs */
    const __m512i by4 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i by8a = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i by8b = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int64_t k = 0; k < Kp; k += 32, g += stride, dp += 4 * esz) {
        _mm_prefetch((const char*)g + ahead, _MM_HINT_T0);
        if (!nib) _mm_prefetch((const char*)g + 64 + ahead, _MM_HINT_T0);
        __m512 d = _mm512_castps128_ps512(half ? _mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)dp))
                                               : _mm_loadu_ps((const float*)dp));
        if (nib) {
            __m512i v = _mm512_loadu_si512((const void*)g);
            __m512i wl = _mm512_and_si512(v, nibble), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            __m512 step = _mm512_permutexvar_ps(by4, d);
            for (int r = 0; r < R; r++) {
                const int8_t* hi = (const int8_t*)(x + r * Kp) + k, *lo = hi + Kp;
                __m512i t = dot4(wl, wh, rep4(hi), rep4(hi + 16), rep4(lo), rep4(lo + 16));
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), step, acc[r][0]);
            }
        } else {
            __m512i wa = _mm512_loadu_si512((const void*)g), wb = _mm512_loadu_si512((const void*)(g + 64));
            __m512 sa = _mm512_permutexvar_ps(by8a, d), sb = _mm512_permutexvar_ps(by8b, d);
            for (int r = 0; r < R; r++) {
                const int8_t* hi = (const int8_t*)(x + r * Kp) + k, *lo = hi + Kp;
                __m512i h = rep2(hi), l = rep2(lo);
                acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(wa, h, l)), sa, acc[r][0]);
                acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(wb, h, l)), sb, acc[r][1]);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 h[4];
        if (nib) {
            for (int o = 0; o < 4; o++)
                h[o] = _mm256_insertf128_ps(_mm256_setzero_ps(), _mm512_extractf32x4_ps(acc[r][0], o), 0);
        } else {
            for (int a = 0; a < 2; a++) {
                h[2 * a] = _mm512_castps512_ps256(acc[r][a]);
                h[2 * a + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][a]), 1));
            }
        }
        for (int o = 0; o < 4; o++) h[o] = offsets(h[o], xsum + r * Gp, m + o * Gp * esz, Gp, half);
        _mm_storeu_ps(s[r], reduce4(h[0], h[1], h[2], h[3]));
    }
}

/* each row count compiled for each format, and `group` over them (cpu_int8.h) */
BLOCKS_AND_GROUP(block)

DL_INT8_LINEAR(group, XMAX, split_rows)

/* the many-rows matmul (prompt tokens): 16 rows a zmm, vpdpwssd */
#define DL_ROWS_512
#define DL_ROWS_VNNI
#include "cpu_int8_rows.h"
