/* CRC-32C (Castagnoli), alone or fused with a copy, for transfer._memcopy.

   x86-64 CPUs since 2008 compute CRC-32C in hardware (SSE4.2 crc32), one 8-byte word per
   cycle but with a 3-cycle latency: one dependency chain runs at a third of the unit's
   speed, so a range is cut in three equal segments summed side by side and the three
   values joined by multiplying with x^(8n) mod P. CPUs with AVX-512 VPCLMULQDQ fold 256 bytes
   a step by carry-less multiplication instead (_crc32c_fold.c), twice as fast here (54
   against 24 GB/s in cache, and one core's read bandwidth from memory); the crc32 chains
   take the tail. The fused copy loads each word once, sums it and stores it, so
   the check adds no pass over memory. Other CPUs use a table.

   States here are raw (not inverted): crc32c(data) = ~update(~0, data). */
#include "_crc32c.h"

#include <string.h>

#include "_crc32c_fold.h"

#define POLY 0x82F63B78u        /* Castagnoli, bit-reflected */
#define MIN_SPLIT 768           /* below this one chain is as fast as joining three */
#define MIN_FOLD 512            /* below this the crc32 chains are as fast as folding */

static uint32_t table[256];
static uint32_t x2n[64];        /* x^(2^k) mod P */
static int best, path;          /* enum crc32c_path: the fastest this CPU runs, the one in use */

/* a * b mod P, both bit-reflected polynomials. */
static uint32_t multmodp(uint32_t a, uint32_t b)
{
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m; m >>= 1) {
        if (a & m)
            product ^= b;
        b = (b & 1) ? (b >> 1) ^ POLY : b >> 1;
    }
    return product;
}

/* x^bits mod P. */
static uint32_t xpow(uint64_t bits)
{
    uint32_t power = 1u << 31;  /* x^0 */
    for (int k = 0; bits; bits >>= 1, k++)
        if (bits & 1)
            power = multmodp(x2n[k], power);
    return power;
}

/* x^(8 * nbytes) mod P: the factor that moves a state past nbytes zero bytes. */
static uint32_t x8n(size_t nbytes)
{
    return xpow(8 * (uint64_t)nbytes);
}

static uint32_t sw_update(uint32_t state, const char *p, size_t n, char *dst)
{
    if (dst)
        memcpy(dst, p, n);
    while (n--)
        state = (state >> 8) ^ table[(state ^ (unsigned char)*p++) & 0xff];
    return state;
}

void crc32c_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1) ? (c >> 1) ^ POLY : c >> 1;
        table[i] = c;
    }
    x2n[0] = 1u << 30;          /* x^1 */
    for (int k = 1; k < 64; k++)
        x2n[k] = multmodp(x2n[k - 1], x2n[k - 1]);
#if defined(__x86_64__)
    __builtin_cpu_init();
    best = __builtin_cpu_supports("sse4.2") ? CRC32C_SSE42 : CRC32C_TABLE;
#endif
    if (best == CRC32C_SSE42 && crc32c_fold_init(xpow))
        best = CRC32C_FOLD;
    path = best;
}

int crc32c_path(int choice)
{
    if (choice > best)
        return -1;
    if (choice >= 0)
        path = choice;
    return path;
}

#if defined(__x86_64__)
#include <nmmintrin.h>
#define HW __attribute__((target("sse4.2")))

/* One chain over n bytes; with dst, stores every word it loads. */
HW static uint32_t hw_chain(uint32_t state, const char *p, size_t n, char *dst)
{
    uint64_t c = state, v;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        memcpy(&v, p + i, 8);
        c = _mm_crc32_u64(c, v);
        if (dst)
            memcpy(dst + i, &v, 8);
    }
    uint32_t c32 = (uint32_t)c;
    for (; i < n; i++) {
        c32 = _mm_crc32_u8(c32, (unsigned char)p[i]);
        if (dst)
            dst[i] = p[i];
    }
    return c32;
}

/* Three chains over three equal segments of `seg` bytes (a multiple of 8). */
HW static uint32_t hw_three(uint32_t state, const char *p, size_t seg, char *dst, struct crc32c_shift *shift)
{
    uint64_t a = state, b = 0, c = 0, va, vb, vc;
    const char *p1 = p + seg, *p2 = p + 2 * seg;
    for (size_t i = 0; i < seg; i += 8) {
        memcpy(&va, p + i, 8);
        memcpy(&vb, p1 + i, 8);
        memcpy(&vc, p2 + i, 8);
        a = _mm_crc32_u64(a, va);
        b = _mm_crc32_u64(b, vb);
        c = _mm_crc32_u64(c, vc);
        if (dst) {
            memcpy(dst + i, &va, 8);
            memcpy(dst + seg + i, &vb, 8);
            memcpy(dst + 2 * seg + i, &vc, 8);
        }
    }
    if (shift->bytes != seg) {
        shift->bytes = seg;
        shift->factor = x8n(seg);
    }
    uint32_t ab = multmodp(shift->factor, (uint32_t)a) ^ (uint32_t)b;
    return multmodp(shift->factor, ab) ^ (uint32_t)c;
}
#endif

uint32_t crc32c_run(uint32_t state, const char *src, size_t n, char *dst, struct crc32c_shift *shift)
{
#if defined(__x86_64__)
    if (path == CRC32C_FOLD && n >= MIN_FOLD) {
        size_t whole = n / CRC32C_FOLD_BLOCK * CRC32C_FOLD_BLOCK;
        state = crc32c_fold(state, src, whole, dst);
        src += whole;
        dst = dst ? dst + whole : NULL;
        n -= whole;
    }
    if (path >= CRC32C_SSE42) {
        if (n >= MIN_SPLIT) {
            size_t seg = n / 24 * 8;
            state = hw_three(state, src, seg, dst, shift);
            src += 3 * seg;
            dst = dst ? dst + 3 * seg : NULL;
            n -= 3 * seg;
        }
        return hw_chain(state, src, n, dst);
    }
#endif
    (void)shift;
    return sw_update(state, src, n, dst);
}
