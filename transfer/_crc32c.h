/* CRC-32C for transfer._memcopy (see _crc32c.c). */
#ifndef NEURON_DI_CRC32C_H
#define NEURON_DI_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* The factor for the last segment length, kept by the caller across ranges of one call. */
struct crc32c_shift {
    size_t bytes;
    uint32_t factor;
};

/* The ways to compute it, slowest first: each CPU runs those up to the one it supports. */
enum crc32c_path { CRC32C_TABLE, CRC32C_SSE42, CRC32C_FOLD };

void crc32c_init(void);

/* Switches to `choice` (an enum crc32c_path; -1 keeps the current one) and returns the one in
   use, or -1 when this CPU cannot run `choice`. For tests and benchmarks. */
int crc32c_path(int choice);

/* Raw state after `n` bytes of `src`; with `dst` (not overlapping src), copies them there in
   the same pass. */
uint32_t crc32c_run(uint32_t state, const char *src, size_t n, char *dst, struct crc32c_shift *shift);

#endif
