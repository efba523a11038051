/* cpu_int8.c's matmul (grouped 8-bit or 4-bit weights x int16-quantized activations, the same format and the same
   integers) for x86 CPUs with AVX-512 F + BW: Intel Xeons since Skylake-SP, AMD Zen 4. kernels/cpu_int8.py picks
   it where the CPU has them but not AVX512-VNNI (Skylake-SP; cpu_int8_vnni.c where it has that too, or with
   DECODELAB_INT8_KERNEL=avx512 this build anyway); DECODELAB_CPU_ISA=avx2 forces the AVX2 build instead.

   A zmm register holds a whole group of 32 activations as int16, so per group and output one vpmaddwd of 32 pairs
   gives 16 int32 lanes (at most 2 * 32767 * 255 each), one conversion and one FMA times the group's step fold them
   into 16 fp32 lanes: 3 instructions per group, row and output where the AVX2 build's blocks before session 33
   needed 5 (two 16-wide k-steps and their sum). VNNI's vpdpwssd would fuse that multiply with an add into int32
   accumulators, but nothing here accumulates in int32 across groups (each group has its own fp32 step), so it
   would be this vpmaddwd with a zero addend; vpdpbusd multiplies 8-bit activations, which cpu_int8_vnni.c gets
   around by splitting each int16 code into two bytes. The 32 zmm registers hold a block of 4 rows x the 4 outputs
   of a packed group (16 accumulators), so a group is read once for up to 4 rows. On an AMD Zen 5 (2 threads,
   SmolLM2's 120 decode matrices, session 27) it took 0.98x the time of the AVX2 build's blocks then at 1 row (both
   bound by memory), 0.85x at 8 and 0.81x at 64.

   The weights come packed by kernels/cpu_int8.py `pack(u)`: groups of 4 output rows, each row's 32 codes of a
   weight group side by side ([ceil(N / 4), Kp / 32, 4, 32], 128 bytes a k-group); 4-bit codes in `pack4`'s layout
   (16 bytes a row: low nibbles k 0-15, high k 16-31). The activation quantization, the offsets' term, the lane
   sums' fixed order and OpenMP over groups are kernels/cpu_int8.h's. Every output goes through the same operations
   whichever block computes it: a row gives the same bits alone or in any batch (not the other builds' bits: they
   add the products in another order).

   With -DDL_SIMDE (and without -mavx512*) the same source builds against SIMDe's portable versions of these
   intrinsics (Debian's libsimde-dev): how tests check this kernel's logic on CPUs without AVX-512. */
#include "cpu_simde512.h"
#include <immintrin.h>
#include "cpu_simd.h"
#include "cpu_int8.h"
#include <stdint.h>

/* a row's 32 codes of a weight group as int16: 8-bit codes (32 bytes), or 4-bit ones (16 bytes, byte j = u[j] |
   u[16 + j] << 4: zero-extended, the low nibbles are k 0-15 and a shift gives k 16-31) */
static inline __m512i w8(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
static inline __m512i w4(const uint8_t* p) {
    __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(v, _mm256_set1_epi16(0x0F))),
                              _mm256_srli_epi16(v, 4), 1);
}

#define BLOCK static inline __attribute__((always_inline)) void

/* R rows of xq (Kp apart; their group sums Gp apart in xsum) times packed group g's 4 outputs, over Kp / 32 weight
   groups (128 bytes of 8-bit codes, 64 of 4-bit ones); dp: the 4 outputs' steps, 4 a group; m: the first output's
   offsets, Gp apart (fp16 with half, else fp32). s[r][o]: row r, output o. R is a constant in each caller, so the
   loops unroll and the accumulators stay in registers (R * 4 + R + 2 of the 32). */
BLOCK block(const int R, const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g,
            const char* dp, const char* m, int64_t ahead, float s[4][4], const int nib, const int half) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int o = 0; o < 4; o++) acc[r][o] = _mm512_setzero_ps();
    const int64_t stride = nib ? 64 : 128, row_bytes = nib ? 16 : 32, esz = half ? 2 : 4;
    for (int64_t k = 0; k < Kp; k += 32, g += stride, dp += 4 * esz) {
        _mm_prefetch((const char*)g + ahead, _MM_HINT_T0);
        if (!nib) _mm_prefetch((const char*)g + 64 + ahead, _MM_HINT_T0);
        float ds[4];
        const float* d = STEPS(dp, ds);
        __m512i xr[4];
        for (int r = 0; r < R; r++) xr[r] = _mm512_loadu_si512((const void*)(x + r * Kp + k));
        for (int o = 0; o < 4; o++) {
            __m512i w = nib ? w4(g + o * row_bytes) : w8(g + o * row_bytes);
            __m512 step = _mm512_set1_ps(d[o]);
            for (int r = 0; r < R; r++)
                acc[r][o] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(xr[r], w)), step, acc[r][o]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m256 h[4];
        for (int o = 0; o < 4; o++) {  /* 16 lanes to 8 (low half + high half), then cpu_int8.h's order */
            h[o] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][o]),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][o]), 1)));
            h[o] = offsets(h[o], xsum + r * Gp, m + o * Gp * esz, Gp, half);
        }
        _mm_storeu_ps(s[r], reduce4(h[0], h[1], h[2], h[3]));
    }
}

/* each row count compiled for each format, and `group` over them (cpu_int8.h) */
BLOCKS_AND_GROUP(block)

/* reread 3: from 3 rows a group is prefetched a group ahead, the distance the AVX2 build's groups of 4 took before
   session 33 (they read a group twice from 3 rows); this build reads it once for up to 4 rows and was timed so */
DL_INT8_LINEAR(group, 32767.0f, 0, 4, 3)

/* the many-rows matmul (prompt tokens): 16 rows a zmm, vpmaddwd + vpaddd */
#include "cpu_int8_rows.h"
