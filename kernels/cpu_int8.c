/* grouped 8-bit (or 4-bit) weights x int16-quantized activations on x86 CPUs with AVX2: y = x @ w.T (+ bias).

   w [N, K] comes as kernels/cpu_int8.py `GroupedInt8`: w[n, k] = d[n, g] * u[n, k] + m[n, g], g = k / 32, u
   uint8, an fp32 step d and offset m per group of 32 weights: each group's 256 levels span its own [min, max]
   (asymmetric, like llama.cpp's Q4_1 blocks, whose 16 levels it keeps exactly). Per-row symmetric int8, the format
   before, cost SmolLM2 up to 0.25 nats on a continuation's log-likelihood and +1% perplexity; integer steps and
   offsets on a per-row grid (kept in integer sums) still 0.10 nats (docs/kernels.md). x [M, K] and y [M, N] are
   fp32, row-major. Each row of x is first quantized to int16 on its own scale (max |x| -> 32767, round to nearest
   even: a relative error of ~1.5e-5) and summed per group. Per group and output, vpmaddwd multiplies 16 int16
   pairs (x, u zero-extended) and adds neighbours into 8 int32 lanes over the group's two 16-wide k-steps (at most
   4 * 32767 * 255 a lane: no overflow at any K); the lanes go to fp32 and are added times d (one FMA). After the
   last group, the offsets' term (each m times the row's group sum, 8 groups a step) joins the lanes, the lanes
   are summed in one fixed order, and the row's scale applied. Every output goes through the same operations
   whichever block computes it, so a row gives the same bits alone or in any batch.

   u comes packed (kernels/cpu_int8.py `pack`): groups of 4 output rows, K padded with zeros to a multiple of 32,
   and within a group the 4 rows' 16-byte pieces of each 16-wide k-step side by side, so a block reads its group
   as one sequential stream of 64-byte lines (one prefetch a line; the 4 separate row streams this replaced
   needed one a row and left the 1-row matmuls of a SmolLM2 step at 12.3 ms instead of 8.5 on the AVX2 target);
   the steps come beside it, 4 rows' per 32 k (`pack_steps`), the offsets a row at a time (`pack_offsets`).
   Blocks of up to 4 rows x 4 (or 2) outputs keep their accumulators in registers; OpenMP splits the groups
   between threads (the process's OpenMP runtime: PyTorch's libgomp, already loaded, so torch.set_num_threads
   applies). Built and loaded by kernels/cpu_int8.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include "cpu_int8.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* 16 weights of a packed k-step, zero-extended to int16 */
static inline __m256i wl(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)); }
static inline __m256i xl(const int16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
/* one output's integer sum over a weight group (two k-steps, 64 bytes apart in the stream): xa . w + xb . w', in
   8 int32 lanes (at most 4 * 32767 * 255 each: no overflow) */
static inline __m256i gsum8(__m256i xa, __m256i xb, const uint8_t* w) {
    return _mm256_add_epi32(_mm256_madd_epi16(xa, wl(w)), _mm256_madd_epi16(xb, wl(w + 64)));
}
/* the same from 4-bit codes (`pack4`): 16 bytes hold the group's 32 codes, byte j = u[j] | u[16 + j] << 4; zero-
   extended to int16, the low nibbles are k-step a and the high ones (a shift) k-step b: as many operations as the
   8-bit form, half the bytes */
static inline __m256i gsum4(__m256i xa, __m256i xb, const uint8_t* w) {
    __m256i v = wl(w);
    return _mm256_add_epi32(_mm256_madd_epi16(xa, _mm256_and_si256(v, _mm256_set1_epi16(0x0F))),
                            _mm256_madd_epi16(xb, _mm256_srli_epi16(v, 4)));
}
#define gsum(xa, xb, w) (nib ? gsum4(xa, xb, w) : gsum8(xa, xb, w))
/* a k-step pair (32 k) of a group of 4 output rows: 128 bytes of 8-bit codes, 64 of 4-bit ones; one prefetch a line */
#define STRIDE (nib ? 64 : 128)
#define PREFETCH(g, ahead) do { _mm_prefetch((const char*)(g) + (ahead), _MM_HINT_T0); \
    if (!nib) _mm_prefetch((const char*)(g) + 64 + (ahead), _MM_HINT_T0); } while (0)
#define BLOCK static inline __attribute__((always_inline)) void
/* f += float(sum) * the group's step: the one float operation per group and accumulator, in every block */
#define FOLD(f, sum, d) f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_broadcast_ss(&(d)), f)
/* Pins accumulators to registers across the loop: without it GCC 12 adds into a temporary and copies it back
   (a move per multiply-add) or spills one to the stack. */
#define PIN4(a, b, c, d) __asm__("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d))
#define PIN2(a, b) __asm__("" : "+x"(a), "+x"(b))
/* a group's 4 steps (cpu_int8.h has STEPS) are DSTEP bytes apart; output row i's offsets start at MROW(i) */
#define DSTEP (half ? 8 : 16)
#define MROW(i) (m + (i) * Gp * (half ? 2 : 4))

/* The blocks: rows of xq (Kp apart; their group sums Gp apart in xsum) times a packed group g, over Kp / 32 weight
   groups of two 64-byte k-steps. d: the steps of the 4 rows of g, 4 a group (the x2 blocks read the first two);
   m: the offsets of the first output row, Gp apart. Each is written out with named accumulators: one generic block
   over arrays (tried) spilled them and ran 4 rows ~1.4x slower. s[i][j]: row i, output j (of the 2 at g for the
   x2 blocks). Each k-step prefetches `ahead` bytes on. */
BLOCK block_1x4(const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g, const char* dp,
                const char* m, int64_t ahead, float s[4][4], const int nib, const int half) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < Kp; k += 32, g += STRIDE, dp += DSTEP) {
        float ds[4];
        const float* d = STEPS(dp, ds);
        PREFETCH(g, ahead);
        __m256i xa = xl(x + k), xb = xl(x + k + 16);
        FOLD(a0, gsum(xa, xb, g), d[0]); FOLD(a1, gsum(xa, xb, g + 16), d[1]);
        FOLD(a2, gsum(xa, xb, g + 32), d[2]); FOLD(a3, gsum(xa, xb, g + 48), d[3]);
        PIN4(a0, a1, a2, a3);
    }
    a0 = offsets(a0, xsum, m, Gp, half); a1 = offsets(a1, xsum, MROW(1), Gp, half);
    a2 = offsets(a2, xsum, MROW(2), Gp, half); a3 = offsets(a3, xsum, MROW(3), Gp, half);
    _mm_storeu_ps(s[0], reduce4(a0, a1, a2, a3));
}

BLOCK block_2x4(const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g, const char* dp,
                const char* m, int64_t ahead, float s[4][4], const int nib, const int half) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = 0; k < Kp; k += 32, g += STRIDE, dp += DSTEP) {
        float ds[4];
        const float* d = STEPS(dp, ds);
        PREFETCH(g, ahead);
        __m256i xa = xl(x + k), xb = xl(x + k + 16), ya = xl(x + Kp + k), yb = xl(x + Kp + k + 16);
        FOLD(a0, gsum(xa, xb, g), d[0]); FOLD(b0, gsum(ya, yb, g), d[0]);
        FOLD(a1, gsum(xa, xb, g + 16), d[1]); FOLD(b1, gsum(ya, yb, g + 16), d[1]);
        FOLD(a2, gsum(xa, xb, g + 32), d[2]); FOLD(b2, gsum(ya, yb, g + 32), d[2]);
        FOLD(a3, gsum(xa, xb, g + 48), d[3]); FOLD(b3, gsum(ya, yb, g + 48), d[3]);
        PIN4(a0, a1, a2, a3); PIN4(b0, b1, b2, b3);
    }
    a0 = offsets(a0, xsum, m, Gp, half); a1 = offsets(a1, xsum, MROW(1), Gp, half);
    a2 = offsets(a2, xsum, MROW(2), Gp, half); a3 = offsets(a3, xsum, MROW(3), Gp, half);
    b0 = offsets(b0, xsum + Gp, m, Gp, half); b1 = offsets(b1, xsum + Gp, MROW(1), Gp, half);
    b2 = offsets(b2, xsum + Gp, MROW(2), Gp, half); b3 = offsets(b3, xsum + Gp, MROW(3), Gp, half);
    _mm_storeu_ps(s[0], reduce4(a0, a1, a2, a3));
    _mm_storeu_ps(s[1], reduce4(b0, b1, b2, b3));
}

BLOCK block_3x2(const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g, const char* dp,
                const char* m, int64_t ahead, float s[4][4], const int nib, const int half) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0;
    for (int64_t k = 0; k < Kp; k += 32, g += STRIDE, dp += DSTEP) {
        float ds[4];
        const float* d = STEPS(dp, ds);
        PREFETCH(g, ahead);
        __m256i xa = xl(x + k), xb = xl(x + k + 16);
        FOLD(a0, gsum(xa, xb, g), d[0]); FOLD(a1, gsum(xa, xb, g + 16), d[1]);
        xa = xl(x + Kp + k); xb = xl(x + Kp + k + 16);
        FOLD(b0, gsum(xa, xb, g), d[0]); FOLD(b1, gsum(xa, xb, g + 16), d[1]);
        xa = xl(x + 2 * Kp + k); xb = xl(x + 2 * Kp + k + 16);
        FOLD(c0, gsum(xa, xb, g), d[0]); FOLD(c1, gsum(xa, xb, g + 16), d[1]);
        PIN4(a0, a1, b0, b1); PIN2(c0, c1);
    }
    a0 = offsets(a0, xsum, m, Gp, half); a1 = offsets(a1, xsum, MROW(1), Gp, half);
    b0 = offsets(b0, xsum + Gp, m, Gp, half); b1 = offsets(b1, xsum + Gp, MROW(1), Gp, half);
    c0 = offsets(c0, xsum + 2 * Gp, m, Gp, half); c1 = offsets(c1, xsum + 2 * Gp, MROW(1), Gp, half);
    float t[4];
    _mm_storeu_ps(s[0], reduce4(a0, a1, b0, b1));
    s[1][0] = s[0][2]; s[1][1] = s[0][3];
    _mm_storeu_ps(t, reduce4(c0, c1, c0, c1));
    s[2][0] = t[0]; s[2][1] = t[1];
}

BLOCK block_4x2(const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g, const char* dp,
                const char* m, int64_t ahead, float s[4][4], const int nib, const int half) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, e0 = a0, e1 = a0;
    for (int64_t k = 0; k < Kp; k += 32, g += STRIDE, dp += DSTEP) {
        float ds[4];
        const float* d = STEPS(dp, ds);
        PREFETCH(g, ahead);
        __m256i xa = xl(x + k), xb = xl(x + k + 16);
        FOLD(a0, gsum(xa, xb, g), d[0]); FOLD(a1, gsum(xa, xb, g + 16), d[1]);
        xa = xl(x + Kp + k); xb = xl(x + Kp + k + 16);
        FOLD(b0, gsum(xa, xb, g), d[0]); FOLD(b1, gsum(xa, xb, g + 16), d[1]);
        xa = xl(x + 2 * Kp + k); xb = xl(x + 2 * Kp + k + 16);
        FOLD(c0, gsum(xa, xb, g), d[0]); FOLD(c1, gsum(xa, xb, g + 16), d[1]);
        xa = xl(x + 3 * Kp + k); xb = xl(x + 3 * Kp + k + 16);
        FOLD(e0, gsum(xa, xb, g), d[0]); FOLD(e1, gsum(xa, xb, g + 16), d[1]);
        PIN4(a0, a1, b0, b1); PIN4(c0, c1, e0, e1);
    }
    a0 = offsets(a0, xsum, m, Gp, half); a1 = offsets(a1, xsum, MROW(1), Gp, half);
    b0 = offsets(b0, xsum + Gp, m, Gp, half); b1 = offsets(b1, xsum + Gp, MROW(1), Gp, half);
    c0 = offsets(c0, xsum + 2 * Gp, m, Gp, half); c1 = offsets(c1, xsum + 2 * Gp, MROW(1), Gp, half);
    e0 = offsets(e0, xsum + 3 * Gp, m, Gp, half); e1 = offsets(e1, xsum + 3 * Gp, MROW(1), Gp, half);
    float t[4];
    _mm_storeu_ps(t, reduce4(a0, a1, b0, b1));
    s[0][0] = t[0]; s[0][1] = t[1]; s[1][0] = t[2]; s[1][1] = t[3];
    _mm_storeu_ps(t, reduce4(c0, c1, e0, e1));
    s[2][0] = t[0]; s[2][1] = t[1]; s[3][0] = t[2]; s[3][1] = t[3];
}

/* each block compiled for each format (cpu_int8.h `FMT_*`): 8-bit or 4-bit codes, fp32 or fp16 steps and offsets */
#define FORMAT(name, fmt) \
    static void name##_##fmt(const int16_t* x, const float* xsum, int64_t Kp, int64_t Gp, const uint8_t* g, \
                             const char* d, const char* m, int64_t ahead, float s[4][4]) { \
        name(x, xsum, Kp, Gp, g, d, m, ahead, s, (fmt) & FMT_NIBBLES, ((fmt) & FMT_HALF) != 0); }
#define FORMATS(name) FORMAT(name, 0) FORMAT(name, 1) FORMAT(name, 2) FORMAT(name, 3)
FORMATS(block_1x4) FORMATS(block_2x4) FORMATS(block_3x2) FORMATS(block_4x2)

/* every row of xq times one group (nb <= 4 real outputs at y, ldy apart by row), in even chunks of at most 4 rows
   (8 -> 4 + 4, 7 -> 4 + 3): 1-2 rows take the group's 4 outputs at once, 3-4 rows 2 at a time (the accumulators
   and operands fit in the 16 ymm registers; the second pass reads the group from L1) */
static void group(const int16_t* xq, const float* xsum, const float* xs, int64_t M, int64_t Kp, int64_t Gp,
                  const uint8_t* g, const char* d, const char* m, int64_t ahead, const float* bias, float* y,
                  int64_t ldy, int64_t nb, int fmt) {
#define BY_ROWS(f) {0, block_1x4_##f, block_2x4_##f, block_3x2_##f, block_4x2_##f}
    static const block_fn by_fmt[4][5] = {BY_ROWS(0), BY_ROWS(1), BY_ROWS(2), BY_ROWS(3)};
    const block_fn* by_rows = by_fmt[fmt];
    const int64_t esz = fmt & FMT_HALF ? 2 : 4;  /* bytes of a step or an offset */
    int64_t chunks = (M + 3) / 4, i0 = 0;
    for (int64_t c = 0; c < chunks; c++) {
        int64_t r = chunk_rows(M, i0, chunks, c);
        const int16_t* xr = xq + i0 * Kp;
        const float* sr = xsum + i0 * Gp;
        float s[4][4], h[4][4];
        by_rows[r](xr, sr, Kp, Gp, g, d, m, ahead, s);
        if (r > 2) {
            by_rows[r](xr, sr, Kp, Gp, g + 32, d + 2 * esz, m + 2 * Gp * esz, ahead, h);
            for (int64_t i = 0; i < r; i++) { s[i][2] = h[i][0]; s[i][3] = h[i][1]; }
        }
        store(s, r, nb, xs + i0, bias, y + i0 * ldy, ldy);
        i0 += r;
    }
}

DL_INT8_LINEAR(group, 32767.0f, 0, 4)

/* the many-rows matmul (prompt tokens): 8 rows a ymm, vpmaddwd + vpaddd */
#include "cpu_int8_rows.h"
