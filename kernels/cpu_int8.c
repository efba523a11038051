/* int8 weights x fp32 activations on x86 CPUs with AVX2 and FMA: y = (x @ q.T) * scale (+ bias).

   q is [N, K] int8 with one fp32 scale per output row (weight-only int8, |q| <= 127); x [M, K] and y [M, N]
   are fp32, row-major. Each output is one dot product over k in 8-wide steps (int8 widened to fp32, FMA into
   one accumulator, summed across lanes at the end, then the k % 8 tail), the same sequence of operations
   whichever block computes it: a row gives the same result alone or in any batch. Blocks of up to 4 rows x 4
   output rows keep the accumulators in registers; OpenMP splits the output rows between threads (the process's
   OpenMP runtime: PyTorch's libgomp, already loaded, so torch.set_num_threads applies). Built and loaded by
   kernels/cpu_int8.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <stdint.h>
/* bytes ahead of the weight rows being read to prefetch: 1 KiB cut the 1-row matmuls of a SmolLM2 step from
   11.4 to 8.1 ms on the AVX2 target (4 weight rows streamed at once outrun the hardware prefetcher) */
#define PF 1024

static inline __m256 wload(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

/* one block: MB rows of x times NB rows of q; every (row, output) sums over k in the same order */
#define BLOCK(MB, NB)                                                                              \
static void block_##MB##_##NB(const float* x, int64_t ldx, int64_t K, const int8_t* w,            \
                              const float* scale, const float* bias, float* y, int64_t ldy) {     \
    __m256 acc[MB][NB];                                                                            \
    for (int i = 0; i < MB; i++) for (int j = 0; j < NB; j++) acc[i][j] = _mm256_setzero_ps();     \
    int64_t k = 0;                                                                                 \
    for (; k + 8 <= K; k += 8) {                                                                   \
        __m256 wv[NB];                                                                             \
        for (int j = 0; j < NB; j++) {                                                             \
            _mm_prefetch((const char*)(w + j * K + k) + PF, _MM_HINT_T0);                          \
            wv[j] = wload(w + j * K + k);                                                          \
        }                                                                                          \
        for (int i = 0; i < MB; i++) {                                                             \
            __m256 xv = _mm256_loadu_ps(x + i * ldx + k);                                          \
            for (int j = 0; j < NB; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);        \
        }                                                                                          \
    }                                                                                              \
    for (int i = 0; i < MB; i++)                                                                   \
        for (int j = 0; j < NB; j++) {                                                             \
            float s = hsum(acc[i][j]);                                                             \
            for (int64_t t = k; t < K; t++) s += x[i * ldx + t] * (float)w[j * K + t];             \
            s *= scale[j];                                                                         \
            y[i * ldy + j] = bias ? s + bias[j] : s;                                               \
        }                                                                                          \
}
BLOCK(1, 4) BLOCK(2, 4) BLOCK(3, 4) BLOCK(4, 2) BLOCK(1, 1) BLOCK(2, 1) BLOCK(3, 1) BLOCK(4, 1)

static void rows(const float* x, int64_t ldx, int64_t M, int64_t K, const int8_t* w, const float* scale,
                 const float* bias, float* y, int64_t ldy, int64_t nb) {
    /* nb (<= 4) outputs for every row of x, 4 rows at a time */
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
        if (nb == 4) {
            block_4_2(x + m * ldx, ldx, K, w, scale, bias ? bias : 0, y + m * ldy, ldy);
            block_4_2(x + m * ldx, ldx, K, w + 2 * K, scale + 2, bias ? bias + 2 : 0, y + m * ldy + 2, ldy);
        } else {
            for (int64_t j = 0; j < nb; j++)
                block_4_1(x + m * ldx, ldx, K, w + j * K, scale + j, bias ? bias + j : 0, y + m * ldy + j, ldy);
        }
    }
    int64_t left = M - m;
    if (!left) return;
    x += m * ldx; y += m * ldy;
    if (nb == 4) {
        if (left == 1) block_1_4(x, ldx, K, w, scale, bias, y, ldy);
        else if (left == 2) block_2_4(x, ldx, K, w, scale, bias, y, ldy);
        else block_3_4(x, ldx, K, w, scale, bias, y, ldy);
    } else {
        for (int64_t j = 0; j < nb; j++) {
            const float* b = bias ? bias + j : 0;
            if (left == 1) block_1_1(x, ldx, K, w + j * K, scale + j, b, y + j, ldy);
            else if (left == 2) block_2_1(x, ldx, K, w + j * K, scale + j, b, y + j, ldy);
            else block_3_1(x, ldx, K, w + j * K, scale + j, b, y + j, ldy);
        }
    }
}

void dl_int8_linear(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale,
                    const float* bias, float* y, int64_t N) {
    int64_t tasks = (N + 3) / 4;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t n0 = t * 4, nb = N - n0 < 4 ? N - n0 : 4;
        rows(x, K, M, K, w + n0 * K, scale + n0, bias ? bias + n0 : 0, y + n0, N, nb);
    }
}
