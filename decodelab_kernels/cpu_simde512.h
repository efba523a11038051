/* The AVX-512 int8 builds (cpu_int8_avx512.c, cpu_int8_vnni.c) compiled with -DDL_SIMDE (and without -mavx512*):
   SIMDe's portable versions of their intrinsics (Debian's libsimde-dev), how tests check those kernels' logic on
   CPUs without the instructions. decodelab_kernels/_cbuild.py hashes this header with each source. */
#pragma once
#ifdef DL_SIMDE
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#undef _mm512_madd_epi16  /* SIMDe 0.7.4 (Debian 12) aliases it with the masked form's four arguments */
#define _mm512_madd_epi16(a, b) simde_mm512_madd_epi16(a, b)
/* ... and has no _mm512_cvtepu8_epi16 or _mm512_cvtepi32_ps: the same operations on two 256-bit halves */
static inline simde__m512i cvtepu8_epi16(simde__m256i v) {
    return simde_mm512_inserti64x4(simde_mm512_castsi256_si512(simde_mm256_cvtepu8_epi16(simde_mm256_castsi256_si128(v))),
                                   simde_mm256_cvtepu8_epi16(simde_mm256_extracti128_si256(v, 1)), 1);
}
static inline simde__m512 cvtepi32_ps(simde__m512i v) {
    return simde_mm512_insertf32x8(simde_mm512_castps256_ps512(simde_mm256_cvtepi32_ps(simde_mm512_castsi512_si256(v))),
                                   simde_mm256_cvtepi32_ps(simde_mm512_extracti64x4_epi64(v, 1)), 1);
}
#define _mm512_cvtepu8_epi16 cvtepu8_epi16
#define _mm512_cvtepi32_ps cvtepi32_ps
#endif
