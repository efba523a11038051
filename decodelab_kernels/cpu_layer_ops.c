/* The per-row ops between a decoder layer's matmuls on x86 CPUs with AVX2 and FMA: RMSNorm (with the residual add
   before it), RoPE in place, and SiLU(gate) * up. Each is several small PyTorch ops (5-15 us each at one row,
   mostly their own overhead); here each is one call. Rows are independent, so results do not depend on the batch.
   No threads: a decode step has a few rows of a few hundred values. Built and loaded by decodelab_kernels/cpu_layer_ops.py. */
#include <immintrin.h>
#include "cpu_simd.h"
#include <math.h>
#include <stdint.h>

/* y = x * rsqrt(mean(x^2) + eps) * w for each of the M rows of x [M, N] (row stride ldx); with h (not NULL,
   [M, N] contiguous) the rows are x + h, written to s [M, N] first (the residual stream the layer goes on with) */
void dl_rms_norm(const float* x, int64_t ldx, const float* h, float* s, const float* w, float* y, int64_t M,
                 int64_t N, float eps) {
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * ldx;
        if (h) {
            float* sr = s + m * N;
            const float* hr = h + m * N;
            int64_t n = 0;
            for (; n + 8 <= N; n += 8)
                _mm256_storeu_ps(sr + n, _mm256_add_ps(_mm256_loadu_ps(xr + n), _mm256_loadu_ps(hr + n)));
            for (; n < N; n++) sr[n] = xr[n] + hr[n];
            xr = sr;
        }
        __m256 acc = _mm256_setzero_ps();
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) {
            __m256 v = _mm256_loadu_ps(xr + n);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = hsum(acc);
        for (; n < N; n++) ss += xr[n] * xr[n];
        float r = 1.0f / sqrtf(ss / (float)N + eps);
        __m256 rv = _mm256_set1_ps(r);
        float* yr = y + m * N;
        for (n = 0; n + 8 <= N; n += 8)
            _mm256_storeu_ps(yr + n, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + n), rv), _mm256_loadu_ps(w + n)));
        for (; n < N; n++) yr[n] = (xr[n] * r) * w[n];
    }
}

/* In each of the M rows of x (row stride ldx), the first `heads` heads of D values are rotated in place:
   x * cos + roll(x, D / 2) * ssin, with cos / ssin [M, D] (ssin: sin with its first half negated), the same
   multiplies and adds, in the same order, as model.apply_rope: the same bits */
__attribute__((optimize("fp-contract=off"))) /* a * c + b * s rounded as two products and a sum, like PyTorch */
void dl_rope(float* x, int64_t ldx, int64_t M, int64_t heads, int64_t D, const float* cos, const float* ssin) {
    int64_t half = D / 2;
    for (int64_t m = 0; m < M; m++) {
        const float* c = cos + m * D;
        const float* s = ssin + m * D;
        for (int64_t hd = 0; hd < heads; hd++) {
            float* p = x + m * ldx + hd * D;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(p + i), b = _mm256_loadu_ps(p + half + i);
                _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                                      _mm256_mul_ps(b, _mm256_loadu_ps(s + i))));
                _mm256_storeu_ps(p + half + i, _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                                             _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i))));
            }
            for (; i < half; i++) {
                float a = p[i], b = p[half + i];
                float lo = a * c[i], lo2 = b * s[i], hi = b * c[half + i], hi2 = a * s[half + i];
                p[i] = lo + lo2;
                p[half + i] = hi + hi2;
            }
        }
    }
}

/* y [M, I] = silu(g) * u, where each row of gu [M, 2I] (row stride ldg) is g then u; silu(g) = g / (1 + exp(-g)) */
void dl_silu_mul(const float* gu, int64_t ldg, int64_t M, int64_t I, float* y) {
    __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t m = 0; m < M; m++) {
        const float* g = gu + m * ldg;
        const float* u = g + I;
        float* yr = y + m * I;
        int64_t i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, gv))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Around fbgemm's int8 matmul (engine_service/engine/models/int8_linear.py): r[m] = max(max |x_m|, 1e-30) and
   xn_m = x_m / r[m] for each of the M rows of x [M, N] (row stride ldx), xn [M, N] contiguous. The same division
   as PyTorch's x / r: the same bits. */
void dl_row_absmax_div(const float* x, int64_t ldx, int64_t M, int64_t N, float* xn, float* r) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t m = 0; m < M; m++) {
        const float* xr = x + m * ldx;
        __m256 mx = _mm256_setzero_ps();
        int64_t n = 0;
        for (; n + 8 <= N; n += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + n)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float a = _mm_cvtss_f32(h);
        for (; n < N; n++) a = fmaxf(a, fabsf(xr[n]));
        a = fmaxf(a, 1e-30f);
        r[m] = a;
        __m256 av = _mm256_set1_ps(a);
        float* yr = xn + m * N;
        for (n = 0; n + 8 <= N; n += 8) _mm256_storeu_ps(yr + n, _mm256_div_ps(_mm256_loadu_ps(xr + n), av));
        for (; n < N; n++) yr[n] = xr[n] / a;
    }
}

/* y [M, N] (contiguous) = y * r[m] in place, or b[n] + y * r[m] (one FMA) when b is not NULL: undoes
   dl_row_absmax_div after the matmul, the same bits as PyTorch's out * r and addcmul(b, out, r) */
void dl_row_scale(float* y, int64_t M, int64_t N, const float* r, const float* b) {
    for (int64_t m = 0; m < M; m++) {
        float* yr = y + m * N;
        __m256 rv = _mm256_set1_ps(r[m]);
        int64_t n = 0;
        if (b) {
            for (; n + 8 <= N; n += 8)
                _mm256_storeu_ps(yr + n, _mm256_fmadd_ps(_mm256_loadu_ps(yr + n), rv, _mm256_loadu_ps(b + n)));
            for (; n < N; n++) yr[n] = fmaf(yr[n], r[m], b[n]);
        } else {
            for (; n + 8 <= N; n += 8) _mm256_storeu_ps(yr + n, _mm256_mul_ps(_mm256_loadu_ps(yr + n), rv));
            for (; n < N; n++) yr[n] = yr[n] * r[m];
        }
    }
}
