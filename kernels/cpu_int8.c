/* int8 weights x int16-quantized activations on x86 CPUs with AVX2: y = (x @ q.T) * scale (+ bias).

   q is [N, K] int8 with one fp32 scale per output row (weight-only int8, |q| <= 127); x [M, K] and y [M, N]
   are fp32, row-major. Each row of x is first quantized to int16 on its own scale (max |x| -> XMAX, round to
   nearest even: a relative error of ~1.5e-5, far below the int8 weight's ~4e-3), so products and their sums are
   exact integers: vpmaddwd multiplies 16 int16 pairs and adds neighbours into 8 int32 lanes, twice the
   multiply-adds per instruction of fp32 FMA on int8 weights widened to fp32 (the kernel this one replaced).
   An output is its lanes' sum (in float, in a fixed order) times the row's and the weight row's scales, so a
   row gives the same bits alone or in any batch, whichever block computes it. Blocks of up to 6 rows x 2 output
   rows keep the accumulators in registers; OpenMP splits the output rows between threads (the process's OpenMP
   runtime: PyTorch's libgomp, already loaded, so torch.set_num_threads applies). Built and loaded by
   kernels/cpu_int8.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
/* bytes ahead of the weight rows being read to prefetch: 1 KiB cut the 1-row matmuls of a SmolLM2 step from
   11.4 to 8.1 ms on the AVX2 target (4 weight rows streamed at once outrun the hardware prefetcher) */
#define PF 1024

/* the largest |activation| after quantization: int16's, unless K is so long that a lane's int32 sum of K / 8
   products (each <= 127 * xmax) could overflow */
static int32_t xmax_for(int64_t K) {
    double bound = 2147483647.0 * 8.0 / (127.0 * (double)(K > 0 ? K : 1));
    return bound >= 32767.0 ? 32767 : (int32_t)bound;
}

/* row i of x to int16 on the grid max|x_i| / xmax; xs[i] the step (NaN for a row with a NaN or inf, so its
   outputs are NaN as fp32 sums would be) */
static void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int16_t* xq, float* xs) {
    const float xmax = (float)xmax_for(K);
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t i = 0; i < M; i++) {
        const float* r = x + i * ldx;
        int16_t* o = xq + i * K;
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
    }
}

static inline __m256i wload(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }

/* the sum of v's 8 int32 lanes, in float (a fixed order; K * 127 * xmax may exceed int32 across lanes) */
static inline float hsum_i32(__m256i v) { return hsum(_mm256_cvtepi32_ps(v)); }

/* one block: MB rows of xq times NB rows of q; every (row, output) is the same integer sum */
#define BLOCK(MB, NB)                                                                              \
static void block_##MB##_##NB(const int16_t* x, const float* xs, int64_t K, const int8_t* w,      \
                              const float* scale, const float* bias, float* y, int64_t ldy) {     \
    __m256i acc[MB][NB];                                                                           \
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_si256(); \
    int64_t k = 0;                                                                                 \
    for (; k + 16 <= K; k += 16) {                                                                 \
        __m256i wv[NB];                                                                            \
        for (int j = 0; j < NB; j++) {                                                             \
            _mm_prefetch((const char*)(w + j * K + k) + PF, _MM_HINT_T0);                          \
            wv[j] = wload(w + j * K + k);                                                          \
        }                                                                                          \
        for (int i = 0; i < MB; i++) {                                                             \
            __m256i xv = _mm256_loadu_si256((const __m256i*)(x + i * K + k));                      \
            for (int j = 0; j < NB; j++)                                                           \
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(xv, wv[j]));             \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MB; i++)                                                                   \
        for (int j = 0; j < NB; j++) {                                                             \
            int32_t t = 0;                                                                         \
            for (int64_t u = k; u < K; u++) t += (int32_t)x[i * K + u] * w[j * K + u];             \
            float s = (hsum_i32(acc[i][j]) + (float)t) * (xs[i] * scale[j]);                       \
            y[i * ldy + j] = bias ? s + bias[j] : s;                                               \
        }                                                                                          \
}
BLOCK(1, 4) BLOCK(2, 4)
BLOCK(1, 2) BLOCK(2, 2) BLOCK(3, 2) BLOCK(4, 2) BLOCK(5, 2) BLOCK(6, 2)
BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1) BLOCK(5, 1) BLOCK(6, 1)

typedef void (*block_fn)(const int16_t*, const float*, int64_t, const int8_t*, const float*, const float*, float*,
                         int64_t);
static const block_fn BY4[3] = {0, block_1_4, block_2_4};
static const block_fn BY2[7] = {0, block_1_2, block_2_2, block_3_2, block_4_2, block_5_2, block_6_2};
static const block_fn BY1[7] = {0, block_1_1, block_2_1, block_3_1, block_4_1, block_5_1, block_6_1};

static void rows(const int16_t* x, const float* xs, int64_t M, int64_t K, const int8_t* w, const float* scale,
                 const float* bias, float* y, int64_t ldy, int64_t nb) {
    /* nb (<= 4) outputs for every row of x, in even chunks of at most 6 rows (8 -> 4 + 4, 11 -> 6 + 5): each
       widened weight vector serves up to 6 rows while the accumulators (rows x 2) and operands fit in the 16
       ymm registers; 1-2 rows take all 4 outputs at once */
    int64_t chunks = (M + 3) / 4, m = 0;
    for (int64_t c = 0; c < chunks; c++) {
        int64_t r = (M - m + (chunks - c) - 1) / (chunks - c);
        const int16_t* xr = x + m * K;
        float* yr = y + m * ldy;
        if (nb == 4 && r <= 2) {
            BY4[r](xr, xs + m, K, w, scale, bias, yr, ldy);
        } else {
            for (int64_t j = 0; j < nb; j += 2) {
                const float* b = bias ? bias + j : 0;
                (nb - j >= 2 ? BY2 : BY1)[r](xr, xs + m, K, w + j * K, scale + j, b, yr + j, ldy);
            }
        }
        m += r;
    }
}

/* returns 0, or -1 when the int16 copy of x could not be allocated */
int dl_int8_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, const float* scale,
                   const float* bias, float* y, int64_t N) {
    int16_t* xq = malloc((size_t)(M * K + 16) * sizeof(int16_t));
    float* xs = malloc((size_t)M * sizeof(float));
    if (!xq || !xs) { free(xq); free(xs); return -1; }
    quantize_rows(x, ldx, M, K, xq, xs);
    int64_t tasks = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t n0 = t * 4, nb = N - n0 < 4 ? N - n0 : 4;
        rows(xq, xs, M, K, w + n0 * K, scale + n0, bias ? bias + n0 : 0, y + n0, N, nb);
    }
    free(xq); free(xs);
    return 0;
}
