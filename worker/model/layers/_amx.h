/* What the AMX kernels of worker.model.layers share: their target attribute, whether this process may use the
   tiles, and one tile configuration. Included after _avx512.h. */
#ifndef NEURON_DI_AMX_H
#define NEURON_DI_AMX_H

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,amx-tile,amx-bf16")))
#define AMX_ROWS 16
#define ARCH_REQ_XCOMP_PERM 0x1023   /* Linux: ask to use an extended state component */
#define XFEATURE_XTILEDATA 18        /* the tile data */

/* Whether the AMX kernels run here: this CPU has AVX-512 BF16 (their loads, stores and softmax), AMX-TILE and
   AMX-BF16, and the kernel lets this process use the tiles. */
static int amx_usable(void)
{
    unsigned int a, b, c, d;
    if (avx512_runs("bfloat16") != 1 || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))
        || !(d & (1u << 22)))
        return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* Palette 1, every tile 16 rows x 64 bytes. Written out whole rather than filled in: GCC 12 drops the stores to
   a local configuration before LDTILECFG, as if the instruction read only the palette byte. */
static const struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TILE_CONFIG = {1, 0, {0}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};

TARGET_AMX static void amx_configure(void)
{
    _tile_loadconfig(&TILE_CONFIG);
}

/* Back to the initial tile state (the configuration and the tiles' contents dropped). */
TARGET_AMX static void amx_release(void)
{
    _tile_release();
}

#endif
