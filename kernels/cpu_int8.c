/* grouped 8-bit weights x int16-quantized activations on x86 CPUs with AVX2: y = x @ w.T (+ bias).

   w [N, K] comes as kernels/cpu_int8.py `GroupedInt8`: w[n, k] = scale[n] * (a[n, g] * u[n, k] + b[n, g]),
   g = k / 32, u uint8, a (1..64) and b int16 per group of 32 weights, one fp32 scale per output row, every
   a * u + b an int16. Each group's 256 levels span its own [min, max] (asymmetric, like llama.cpp's Q4_1 blocks):
   per-row symmetric int8, the format before, cost SmolLM2 up to 0.26 nats on a continuation's log-likelihood
   and 1% perplexity (docs/kernels.md). x [M, K] and y [M, N] are fp32, row-major. Each row of x is first
   quantized to int16 on its own scale (max |x| -> xmax, round to nearest even: a relative error of ~1.5e-5), so
   products and their sums are exact integers: each 16-weight load is widened to int16 and turned into a * u + b
   (vpmullw, vpaddw), and vpmaddwd multiplies 16 int16 pairs and adds neighbours into 8 int32 lanes. An output is
   its lanes' sum (in float, one fixed order for every block) times the row's and the weight row's scales, so a row
   gives the same bits alone or in any batch, whichever block computes it. xmax is int16's unless a lane's int32
   sum could overflow (the caller bounds it from the weight's integers).

   u comes packed (kernels/cpu_int8.py `pack`): groups of 4 output rows, K padded with zeros to a multiple of 32,
   and within a group the 4 rows' 16-byte pieces of each 16-wide k-step side by side, so a block reads its group
   as one sequential stream of 64-byte lines (one prefetch a line; the 4 separate row streams this replaced
   needed one a row and left the 1-row matmuls of a SmolLM2 step at 12.3 ms instead of 8.5 on the AVX2 target);
   (a, b) come beside it, 4 rows' pairs per 32 k (`pack_steps`). Blocks of up to 4 rows x 4 (or 2) outputs keep
   their accumulators in registers; OpenMP splits the groups between threads (the process's OpenMP runtime:
   PyTorch's libgomp, already loaded, so torch.set_num_threads applies). Built and loaded by kernels/cpu_int8.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* row i of x to int16 on the grid max|x_i| / xmax, zero-padded to Kp; xs[i] the step (NaN for a row with a NaN
   or inf, so its outputs are NaN as fp32 sums would be) */
static void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Kp, int32_t xmax_int,
                          int16_t* xq, float* xs) {
    const float xmax = (float)xmax_int;
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
    }
}

/* 16 weights of a packed k-step as the integers a * u + b (u zero-extended to int16; the caller's pack keeps every
   a * u + b within int16) */
static inline __m256i wl(const uint8_t* p, __m256i a, __m256i b) {
    return _mm256_add_epi16(_mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p)), a), b);
}
static inline __m256i xl(const int16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
/* row r's (a, b) of the current weight group, broadcast */
#define AB(r) const __m256i A##r = _mm256_set1_epi16(ab[2 * (r)]), B##r = _mm256_set1_epi16(ab[2 * (r) + 1])
/* a += x . w pairwise (vector extension add: GCC then keeps each accumulator in one register) */
typedef int v8si __attribute__((vector_size(32)));
#define MADD(a, x, w) a = (__m256i)((v8si)(a) + (v8si)_mm256_madd_epi16(x, w))
/* Pins accumulators to registers across the loop: without it GCC 12 adds into a temporary and copies it back
   (a move per multiply-add) or spills one to the stack; with it the 4x2 block's k-step takes ~5.4 cycles on Zen 3
   instead of ~6.4. */
#define PIN4(a, b, c, d) __asm__("" : "+x"(a), "+x"(b), "+x"(c), "+x"(d))
#define PIN2(a, b) __asm__("" : "+x"(a), "+x"(b))

/* the lane sums of 4 accumulators [s0 s1 s2 s3], in float, each in the same fixed order */
static inline __m128 reduce4(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(_mm256_cvtepi32_ps(a0), _mm256_cvtepi32_ps(a1)),
                              _mm256_hadd_ps(_mm256_cvtepi32_ps(a2), _mm256_cvtepi32_ps(a3)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The blocks: rows of xq (Kp apart) times a packed group g, over Kp / 32 weight groups of two 64-byte k-steps (ab:
   the group's 4 rows' (a, b), 8 int16, the x2 blocks' first two of them). Each is written out
   with named accumulators: one generic block over arrays (tried) spilled them and ran 4 rows ~1.4x slower. s[i][j]: lane sums
   of row i and output j (of the 2 at g for the x2 blocks). Each k-step prefetches `ahead` bytes on. */
static void block_1x4(const int16_t* x, int64_t Kp, const uint8_t* g, const int16_t* ab, int64_t ahead,
                      float s[4][4]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < Kp; ab += 8) {
        AB(0); AB(1); AB(2); AB(3);
        for (int h = 0; h < 2; h++, k += 16, g += 64) {
            _mm_prefetch((const char*)g + ahead, _MM_HINT_T0);
            __m256i x0 = xl(x + k);
            MADD(a0, x0, wl(g, A0, B0)); MADD(a1, x0, wl(g + 16, A1, B1));
            MADD(a2, x0, wl(g + 32, A2, B2)); MADD(a3, x0, wl(g + 48, A3, B3));
            PIN4(a0, a1, a2, a3);
        }
    }
    _mm_storeu_ps(s[0], reduce4(a0, a1, a2, a3));
}

static void block_2x4(const int16_t* x, int64_t Kp, const uint8_t* g, const int16_t* ab, int64_t ahead,
                      float s[4][4]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    for (int64_t k = 0; k < Kp; ab += 8) {
        AB(0); AB(1); AB(2); AB(3);
        for (int h = 0; h < 2; h++, k += 16, g += 64) {
            _mm_prefetch((const char*)g + ahead, _MM_HINT_T0);
            __m256i x0 = xl(x + k), x1 = xl(x + Kp + k), w = wl(g, A0, B0);
            MADD(a0, x0, w); MADD(b0, x1, w);
            w = wl(g + 16, A1, B1); MADD(a1, x0, w); MADD(b1, x1, w);
            w = wl(g + 32, A2, B2); MADD(a2, x0, w); MADD(b2, x1, w);
            w = wl(g + 48, A3, B3); MADD(a3, x0, w); MADD(b3, x1, w);
            PIN4(a0, a1, a2, a3); PIN4(b0, b1, b2, b3);
        }
    }
    _mm_storeu_ps(s[0], reduce4(a0, a1, a2, a3));
    _mm_storeu_ps(s[1], reduce4(b0, b1, b2, b3));
}

static void block_3x2(const int16_t* x, int64_t Kp, const uint8_t* g, const int16_t* ab, int64_t ahead,
                      float s[4][4]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0;
    for (int64_t k = 0; k < Kp; ab += 8) {
        AB(0); AB(1);
        for (int h = 0; h < 2; h++, k += 16, g += 64) {
            _mm_prefetch((const char*)g + ahead, _MM_HINT_T0);
            __m256i w0 = wl(g, A0, B0), w1 = wl(g + 16, A1, B1), xv = xl(x + k);
            MADD(a0, xv, w0); MADD(a1, xv, w1);
            xv = xl(x + Kp + k); MADD(b0, xv, w0); MADD(b1, xv, w1);
            xv = xl(x + 2 * Kp + k); MADD(c0, xv, w0); MADD(c1, xv, w1);
            PIN4(a0, a1, b0, b1); PIN2(c0, c1);
        }
    }
    float t[4];
    _mm_storeu_ps(s[0], reduce4(a0, a1, b0, b1));
    s[1][0] = s[0][2]; s[1][1] = s[0][3];
    _mm_storeu_ps(t, reduce4(c0, c1, c0, c1));
    s[2][0] = t[0]; s[2][1] = t[1];
}

static void block_4x2(const int16_t* x, int64_t Kp, const uint8_t* g, const int16_t* ab, int64_t ahead,
                      float s[4][4]) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, d0 = a0, d1 = a0;
    for (int64_t k = 0; k < Kp; ab += 8) {
        AB(0); AB(1);
        for (int h = 0; h < 2; h++, k += 16, g += 64) {
            _mm_prefetch((const char*)g + ahead, _MM_HINT_T0);
            __m256i w0 = wl(g, A0, B0), w1 = wl(g + 16, A1, B1), xv = xl(x + k);
            MADD(a0, xv, w0); MADD(a1, xv, w1);
            xv = xl(x + Kp + k); MADD(b0, xv, w0); MADD(b1, xv, w1);
            xv = xl(x + 2 * Kp + k); MADD(c0, xv, w0); MADD(c1, xv, w1);
            xv = xl(x + 3 * Kp + k); MADD(d0, xv, w0); MADD(d1, xv, w1);
            PIN4(a0, a1, b0, b1); PIN4(c0, c1, d0, d1);
        }
    }
    float t[4];
    _mm_storeu_ps(t, reduce4(a0, a1, b0, b1));
    s[0][0] = t[0]; s[0][1] = t[1]; s[1][0] = t[2]; s[1][1] = t[3];
    _mm_storeu_ps(t, reduce4(c0, c1, d0, d1));
    s[2][0] = t[0]; s[2][1] = t[1]; s[3][0] = t[2]; s[3][1] = t[3];
}

typedef void (*block_fn)(const int16_t*, int64_t, const uint8_t*, const int16_t*, int64_t, float[4][4]);

/* every row of xq times one group (nb <= 4 real outputs at y, ldy apart by row), in even chunks of at most 4 rows
   (8 -> 4 + 4, 7 -> 4 + 3): 1-2 rows take the group's 4 outputs at once, 3-4 rows 2 at a time (the accumulators
   and operands fit in the 16 ymm registers; the second pass reads the group from L1) */
static void group(const int16_t* xq, const float* xs, int64_t M, int64_t Kp, const uint8_t* g, const int16_t* ab,
                  int64_t ahead,
                  const float* scale, const float* bias, float* y, int64_t ldy, int64_t nb) {
    static const block_fn by_rows[5] = {0, block_1x4, block_2x4, block_3x2, block_4x2};
    int64_t chunks = (M + 3) / 4, m = 0;
    for (int64_t c = 0; c < chunks; c++) {
        int64_t r = (M - m + (chunks - c) - 1) / (chunks - c);
        const int16_t* xr = xq + m * Kp;
        float s[4][4], h[4][4];
        by_rows[r](xr, Kp, g, ab, ahead, s);
        if (r > 2) {
            by_rows[r](xr, Kp, g + 32, ab + 4, ahead, h);
            for (int64_t i = 0; i < r; i++) { s[i][2] = h[i][0]; s[i][3] = h[i][1]; }
        }
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < nb; j++) {
                float v = s[i][j] * (xs[m + i] * scale[j]);
                y[(m + i) * ldy + j] = bias ? v + bias[j] : v;
            }
        m += r;
    }
}

/* wp: u packed, (N + 3) / 4 groups of 4 * Kp bytes, Kp = K rounded up to 32; ab: each group's (a, b) pairs,
   [(N + 3) / 4][Kp / 32][4][2] int16; xmax: the largest |activation| after quantization, small enough that no
   int32 lane overflows (kernels/cpu_int8.py `pack`). Returns 0, or -1 when the int16 copy of x could not be
   allocated. */
int dl_int8_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const uint8_t* wp, const int16_t* ab,
                   const float* scale, const float* bias, float* y, int64_t N, int32_t xmax) {
    int64_t Kp = (K + 31) / 32 * 32;
    /* 64-byte aligned (rows are 32 * Kp / 16 bytes long): an activation load never straddles two cache lines, which
       cost ~15% at 4 rows with malloc's 16-byte alignment */
    int16_t* xq = aligned_alloc(64, (size_t)(M * Kp * 2 + 63) / 64 * 64);
    float* xs = malloc((size_t)M * sizeof(float));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    quantize_rows(x, ldx, M, K, Kp, xmax, xq, xs);
    /* with 3+ rows a group is read twice: prefetch the next group (at least 1 KiB on) so the memory stream goes
       on during the second pass; 1-2 rows read it once, 1 KiB ahead */
    int64_t groups = (N + 3) / 4, ahead = M > 2 && 4 * Kp > 1024 ? 4 * Kp : 1024;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < groups; t++) {
        int64_t n0 = t * 4, nb = N - n0 < 4 ? N - n0 : 4;
        group(xq, xs, M, Kp, wp + t * 4 * Kp, ab + t * 4 * Kp / 16, ahead, scale + n0, bias ? bias + n0 : 0, y + n0, N, nb);
    }
    free(xq); free(xs);
    return 0;
}
