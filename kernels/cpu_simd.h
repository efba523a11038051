/* Helpers shared by the AVX2 kernels (cpu_*.c); kernels/_cbuild.py hashes this header with each source. */
#pragma once
#include <immintrin.h>

/* the sum of v's 8 lanes */
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
