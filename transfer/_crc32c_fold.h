/* CRC-32C by carry-less multiplication on 512-bit lanes, for transfer/_crc32c.c. */
#ifndef NEURON_DI_CRC32C_FOLD_H
#define NEURON_DI_CRC32C_FOLD_H

#include <stddef.h>
#include <stdint.h>

#define CRC32C_FOLD_BLOCK 256   /* bytes one step of the folding loop consumes */

/* Prepares the constants from `xpow` (x^bits mod P, bit-reflected); returns 1 when this CPU and
   OS run AVX-512 VPCLMULQDQ, else 0 and crc32c_fold must not be called. The caller has run
   __builtin_cpu_init() and found SSE4.2 (the tail's crc32 instruction). */
int crc32c_fold_init(uint32_t (*xpow)(uint64_t bits));

/* Raw state after `n` bytes of `src` (n a non-zero multiple of CRC32C_FOLD_BLOCK); with `dst`
   (not overlapping src), copies them there in the same pass. */
uint32_t crc32c_fold(uint32_t state, const char *src, size_t n, char *dst);

#endif
