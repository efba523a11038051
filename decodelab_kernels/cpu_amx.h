/* The few AMX tile operations the AMX build of the int8 matmul uses (cpu_int8_vnni.c with -DDL_AMX), as the
   hardware's intrinsics (-mamx-tile -mamx-int8) or, with -DDL_AMX_EMULATE, as plain C over 8 thread-local tiles of
   1 KiB: how tests check that build's logic (layouts, strides, signs) on CPUs without AMX, as SIMDe does for
   AVX-512. decodelab_kernels/_cbuild.py hashes this header with each source.

   A tile is up to 16 rows of up to 64 bytes, shaped by a 64-byte configuration (palette 1). TDPBSUD(c, a, b):
   c[m][n] += sum over k of a[m][4k + j] * b[k][4n + j], j = 0..3, a's bytes signed and b's unsigned, in int32 (no
   saturation): vpdpbusd's products with a row of a broadcast against b's rows. */
#pragma once
#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* Linux hands AMX's 8 KiB of tile state to a process only when it asks (arch_prctl ARCH_REQ_XCOMP_PERM, once per
   process, for every thread): without it the first tile instruction is SIGILL. 0 once granted, else -1. */
#ifdef DL_AMX_EMULATE
static inline int amx_request(void) { return 0; }
#else
#include <sys/syscall.h>
#include <unistd.h>
static inline int amx_request(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 0 : -1;
}
#endif

#ifdef DL_AMX_EMULATE
static _Thread_local amx_config amx_cfg;
static _Thread_local uint8_t amx_tiles[8][16][64];

static inline void amx_load_config(const amx_config* c) { amx_cfg = *c; }
static inline void amx_release(void) { memset(&amx_cfg, 0, sizeof amx_cfg); }
static inline void amx_zero(int t) { memset(amx_tiles[t], 0, sizeof amx_tiles[t]); }
static inline void amx_load(int t, const void* p, int64_t stride) {
    for (int r = 0; r < amx_cfg.rows[t]; r++) memcpy(amx_tiles[t][r], (const uint8_t*)p + r * stride, amx_cfg.colsb[t]);
}
static inline void amx_store(int t, void* p, int64_t stride) {
    for (int r = 0; r < amx_cfg.rows[t]; r++) memcpy((uint8_t*)p + r * stride, amx_tiles[t][r], amx_cfg.colsb[t]);
}
static inline void amx_dpbsud(int c, int a, int b) {
    for (int m = 0; m < amx_cfg.rows[c]; m++)
        for (int n = 0; n < amx_cfg.colsb[c] / 4; n++) {
            int32_t s;
            memcpy(&s, &amx_tiles[c][m][4 * n], 4);
            for (int k = 0; k < amx_cfg.colsb[a] / 4; k++)
                for (int j = 0; j < 4; j++)
                    s += (int32_t)(int8_t)amx_tiles[a][m][4 * k + j] * (int32_t)amx_tiles[b][k][4 * n + j];
            memcpy(&amx_tiles[c][m][4 * n], &s, 4);
        }
}
#define AMX_ZERO(t) amx_zero(t)
#define AMX_LOAD(t, p, stride) amx_load(t, p, stride)
#define AMX_STORE(t, p, stride) amx_store(t, p, stride)
#define AMX_DPBSUD(c, a, b) amx_dpbsud(c, a, b)
#else
#include <immintrin.h>
static inline void amx_load_config(const amx_config* c) { _tile_loadconfig(c); }
static inline void amx_release(void) { _tile_release(); }
/* the intrinsics take tile numbers as immediates: macros keep them constants */
#define AMX_ZERO(t) _tile_zero(t)
#define AMX_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define AMX_STORE(t, p, stride) _tile_stored(t, p, stride)
#define AMX_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#endif
