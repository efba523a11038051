/* cpu_int8.c's matmul (grouped 8-bit or 4-bit weights x int16-quantized activations, the same format and the same
   integers) for x86 CPUs with AVX-512 F + BW: Intel Xeons since Skylake-SP, AMD Zen 4. decodelab_kernels/cpu_int8.py picks
   it where the CPU has them but not AVX512-VNNI (Skylake-SP; cpu_int8_vnni.c where it has that too, or with
   DECODELAB_INT8_KERNEL=avx512 this build anyway); DECODELAB_CPU_ISA=avx2 forces the AVX2 build instead.

   Lanes (since session 33, as the AVX2 build's with one register for both halves): a zmm holds 16 outputs, one a
   lane, each lane two neighbouring k of its output (decodelab_kernels/cpu_int8.py `pack_wide(..., lane=2)`, the AVX2 build's
   layout: a k-group is 16 pieces of 32 bytes, 4-bit codes 8 pieces of nibble bytes whose low nibbles are k 2q.. and
   high ones k 16 + 2q..), widened to int16 once per k-group for up to LANE_ROWS rows; per row vpmaddwd against its
   two int16 codes at those k broadcast to every lane and a vpaddd add 32 products into 16 int32 sums, a group's
   exact sum (at most 32 * 32767 * 255) then one conversion and one FMA by the 16 outputs' steps; the offsets' term
   after the last group; no lane sums. Before, a zmm held one output's whole group of 32 k (one vpmaddwd, a
   conversion and an FMA per row, output and group, lane sums at the end, blocks of 4 rows x 4 outputs), and prompt
   rows took a many-rows matmul (cpu_int8_rows.h, rows in the lanes); on an AMD Zen 5 (SmolLM2's 120 4-bit decoder
   matrices with fp16 steps, 2 threads) this takes 0.85-0.93x that build's time at 1 row, 0.63-0.64x at 8, 0.46-0.51x
   from 16 rows on, and 0.71-0.72x / 0.80-0.81x / 0.86-0.93x the many-rows matmul's at 64 / 128 / 512 rows (two
   passes), which it no longer carries.

   Each row goes through the same operations whichever block computes it (a block is 1 to LANE_ROWS rows of one
   slab), so a row gives the same bits alone or in any batch (the AVX2 build's bits too: the same integer sums,
   converted and folded in the same order). With -DDL_SIMDE (and without -mavx512*) the same source builds against
   SIMDe's portable versions of these intrinsics (Debian's libsimde-dev): how tests check this kernel's logic on CPUs
   without AVX-512. */
#include "cpu_simde512.h"
#include <immintrin.h>
#include "cpu_simd.h"
#include "cpu_int8.h"
#include <stdint.h>
#include <string.h>

#define BLOCK static inline __attribute__((always_inline)) void

#define LANE_ROWS 16  /* rows a block: a k-group's codes are widened once for up to 16 rows */

/* R rows of xq (Kp apart; group sums Gp apart in xsum) times one packed slab of 16 outputs, its steps dp and offsets
   mp 16 a group; y, ldy apart by row: nb <= 16 outputs times each row's step xs, plus bias. R is a constant in each
   caller. Each k-group prefetches `ahead` bytes on. */
BLOCK lanes(const int R, const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp,
            const uint8_t* g, const char* dp, const char* mp, int64_t ahead, const float* bias, float* y, int64_t ldy,
            int64_t nb, const int nib, const int half) {
    __m512 acc[LANE_ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    const int64_t stride = nib ? 256 : 512, esz = half ? 2 : 4;
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    for (int64_t k = 0; k < Kp; k += 32, g += stride, dp += 16 * esz) {
        for (int64_t b = 0; b < stride; b += 64) _mm_prefetch((const char*)g + ahead + b, _MM_HINT_T0);
        __m512i w[16];  /* w[q]: the 16 outputs' codes at k 2q and 2q + 1, as int16 */
        if (nib) {
            for (int q = 0; q < 8; q++) {
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(g + 32 * q)));
                w[q] = _mm512_and_si512(v, nibble);
                w[q + 8] = _mm512_srli_epi16(v, 4);
            }
        } else {
            for (int q = 0; q < 16; q++) w[q] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(g + 32 * q)));
        }
        __m512 step = scales16(dp, half);
        for (int r = 0; r < R; r++) {
            const int16_t* xr = x + r * Kp + k;
            __m512i t = _mm512_madd_epi16(w[0], bcast4(xr));
            for (int q = 1; q < 16; q++) t = _mm512_add_epi32(t, _mm512_madd_epi16(w[q], bcast4(xr + 2 * q)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), step, acc[r]);
        }
    }
    slab_end16(R, acc, xsum, xs, Kp, Gp, mp, bias, y, ldy, nb, half);
}

/* `lanes` compiled for each row count (1 to LANE_ROWS) and each format, and `slab` over them (cpu_int8.h) */
SLABS_16(lanes)
DL_INT8_LINEAR(slab, 32767.0f, 0, 0, 0)  /* a slab is read once for up to 16 rows */
