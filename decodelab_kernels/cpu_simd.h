/* Helpers shared by the AVX2 kernels (cpu_*.c); decodelab_kernels/_cbuild.py hashes this header with each source. */
#pragma once
#include <immintrin.h>
#include <stdlib.h>
#include <strings.h>

/* whether OpenMP's threads sleep while they wait (OMP_WAIT_POLICY=PASSIVE, play's default where the engine takes
   every core): waking one then costs a futex, so the kernels split less work between threads */
static inline int omp_passive(void) {
    const char* policy = getenv("OMP_WAIT_POLICY");
    return policy && strcasecmp(policy, "passive") == 0;
}

/* the sum of v's 8 lanes */
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* exp of 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; ~1 ulp); inputs clamped to
   [-87.3, 88.3], so large negative ones give ~1e-38, not 0 (callers that need 0 mask it) */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
    __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
