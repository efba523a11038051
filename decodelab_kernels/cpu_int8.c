/* grouped 8-bit (or 4-bit) weights x int16-quantized activations on x86 CPUs with AVX2: y = x @ w.T (+ bias).

   w [N, K] comes as decodelab_kernels/cpu_int8.py `GroupedInt8`: w[n, k] = d[n, g] * u[n, k] + m[n, g], g = k / 32, u
   uint8, an fp32 step d and offset m per group of 32 weights: each group's 256 levels span its own [min, max]
   (asymmetric, like llama.cpp's Q4_1 blocks, whose 16 levels it keeps exactly). Per-row symmetric int8, the format
   before, cost SmolLM2 up to 0.25 nats on a continuation's log-likelihood and +1% perplexity; integer steps and
   offsets on a per-row grid (kept in integer sums) still 0.10 nats (docs/kernels.md). x [M, K] and y [M, N] are
   fp32, row-major. Each row of x is first quantized to int16 on its own scale (max |x| -> 32767, round to nearest
   even: a relative error of ~1.5e-5) and summed per group (cpu_int8.h, shared with the AVX-512 builds).

   Lanes (since session 33): a ymm holds 8 outputs, one a lane, each lane two neighbouring k of its output, so
   vpmaddwd against a row's two int16 codes at those k broadcast to every lane, and a vpaddd, add 16 products into
   8 int32 sums. The weights come in slabs of 16 outputs (decodelab_kernels/cpu_int8.py `pack_wide(..., lane=2)`: a k-group
   is 16 pieces of 32 bytes, piece q each output's codes at k 2q and 2q + 1; 4-bit: 8 pieces of nibble bytes,
   whose low nibbles are k 2q.. and high ones k 16 + 2q..), widened to int16 once for a block of up to 4 rows, and
   a slab's two halves share each broadcast. After a group's 16 k-pairs a lane holds its output's exact integer
   sum (at most 32 * 32767 * 255: no overflow), which one conversion and one FMA by the 8 outputs' steps add to its
   fp32 sum; after the last group the offsets' term (each m times the row's group sum) joins it, group by group, and
   the row's step scales it: no lane sums. Before, a register held one output's 16 k (the sums of 4 outputs packed
   in groups of 4 ended in lane sums), so every output paid a conversion and an FMA a group and the group's codes
   were widened for 1-2 rows at a time; on an AMD Zen 5 (SmolLM2's 120 4-bit decoder matrices, 2 threads) this
   takes 0.97x that one's time at 1 row, 0.84x at 8 and 0.82-0.84x at 64-256, as fast as the many-rows matmul it
   carried for prompt rows (cpu_int8_rows.h), so it carries it no more (docs/kernels.md).

   Each row goes through the same operations whichever block computes it (a block is 1-4 rows of one slab), so a
   row gives the same bits alone or in any batch. OpenMP splits the slabs between threads (the process's OpenMP
   runtime: PyTorch's libgomp, already loaded, so torch.set_num_threads applies). Built and loaded by
   decodelab_kernels/cpu_int8.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include "cpu_int8.h"
#include <stdint.h>

#define BLOCK static inline __attribute__((always_inline)) void
#define LANE_ROWS 4  /* rows a block: their 8 int32 sums of a slab's two halves and the weights fill the 16 ymm */

/* a0 += w0 . b, a1 += w1 . b for b the two int16 at p broadcast to every lane: in assembly, as through the
   intrinsics GCC 12 keeps the products in memory and adds them later */
#define DOT2(a0, a1, w0, w1, p) do { __m256i b_, t_; \
    __asm__("vpbroadcastd %6, %2\n\tvpmaddwd %2, %4, %3\n\tvpaddd %3, %0, %0\n\t" \
            "vpmaddwd %2, %5, %3\n\tvpaddd %3, %1, %1" \
            : "+x"(a0), "+x"(a1), "=&x"(b_), "=&x"(t_) : "x"(w0), "x"(w1), "m"(*(const int32_t*)(p))); } while (0)

/* 8 codes of 2 k each from p, widened to int16 */
static inline __m256i widen(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }

/* R rows of xq (Kp apart; group sums Gp apart in xsum) times one packed slab of 16 outputs (`pack_wide(...,
   lane=2)`), its steps dp and offsets mp 16 a group; y, ldy apart by row: nb <= 16 outputs times each row's step
   xs, plus bias. R is a constant in each caller. Each k-group prefetches `ahead` bytes on. */
BLOCK lanes(const int R, const int16_t* x, const float* xsum, const float* xs, int64_t Kp, int64_t Gp,
            const uint8_t* g, const char* dp, const char* mp, int64_t ahead, const float* bias, float* y,
            int64_t ldy, int64_t nb, const int nib, const int half) {
    __m256 acc[LANE_ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t stride = nib ? 256 : 512, esz = half ? 2 : 4;
    const __m256i nibble = _mm256_set1_epi16(0x0F);
    for (int64_t k = 0; k < Kp; k += 32, g += stride, dp += 16 * esz) {
        for (int64_t b = 0; b < stride; b += 64) _mm_prefetch((const char*)g + ahead + b, _MM_HINT_T0);
        __m256i t[LANE_ROWS][2];
        for (int r = 0; r < R; r++) t[r][0] = t[r][1] = _mm256_setzero_si256();
        if (nib) {
            for (int q = 0; q < 8; q++) {
                __m256i v0 = widen(g + 32 * q), v1 = widen(g + 32 * q + 16);
                __m256i l0 = _mm256_and_si256(v0, nibble), l1 = _mm256_and_si256(v1, nibble);
                for (int r = 0; r < R; r++) DOT2(t[r][0], t[r][1], l0, l1, x + r * Kp + k + 2 * q);
                v0 = _mm256_srli_epi16(v0, 4);
                v1 = _mm256_srli_epi16(v1, 4);
                for (int r = 0; r < R; r++) DOT2(t[r][0], t[r][1], v0, v1, x + r * Kp + k + 16 + 2 * q);
            }
        } else {
            for (int q = 0; q < 16; q++) {
                __m256i w0 = widen(g + 32 * q), w1 = widen(g + 32 * q + 16);
                for (int r = 0; r < R; r++) DOT2(t[r][0], t[r][1], w0, w1, x + r * Kp + k + 2 * q);
            }
        }
        __m256 s0 = load8(dp, half), s1 = load8(dp + 8 * esz, half);
        for (int r = 0; r < R; r++) {
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][0]), s0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r][1]), s1, acc[r][1]);
        }
    }
    for (int64_t j = 0; j < Kp / 32; j++) {  /* the offsets' term, group by group */
        __m256 m0 = load8(mp + j * 16 * esz, half), m1 = load8(mp + (j * 16 + 8) * esz, half);
        for (int r = 0; r < R; r++) {
            __m256 s = _mm256_set1_ps(xsum[r * Gp + j]);
            acc[r][0] = _mm256_fmadd_ps(s, m0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(s, m1, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        float out[16];
        __m256 step = _mm256_set1_ps(xs[r]);
        _mm256_storeu_ps(out, _mm256_mul_ps(acc[r][0], step));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(acc[r][1], step));
        for (int64_t o = 0; o < nb; o++) y[r * ldy + o] = bias ? out[o] + bias[o] : out[o];
    }
}

/* `lanes` compiled for each row count (1 to LANE_ROWS) and each format, and `slab` over them (cpu_int8.h); a chunk
   after a slab's first reads it from cache (8 rows -> 4 + 4, 7 -> 4 + 3) */
SLAB_ROWS(lanes, 1) SLAB_ROWS(lanes, 2) SLAB_ROWS(lanes, 3) SLAB_ROWS(lanes, 4)
#define LANES_BY_ROWS(f) {0, lanes_1_##f, lanes_2_##f, lanes_3_##f, lanes_4_##f}
static const slab_block_fn by_fmt[4][LANE_ROWS + 1] = {LANES_BY_ROWS(0), LANES_BY_ROWS(1), LANES_BY_ROWS(2),
                                                       LANES_BY_ROWS(3)};
SLAB(by_fmt, LANE_ROWS)

/* from 5 rows a slab is read once a chunk of up to 4 rows: prefetch the next slab */
DL_INT8_LINEAR(slab, 32767.0f, 0, LANE_ROWS + 1, 0)
