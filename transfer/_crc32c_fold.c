/* CRC-32C by folding with carry-less multiplication on 512-bit lanes (AVX-512 VPCLMULQDQ).

   The bit-reflected CRC reads a 16-byte lane loaded little-endian as a polynomial A of degree
   < 128 whose low quadword holds the high-degree half: A = hi(x) x^64 + lo(x). The CRC of a
   message depends only on the message mod P, so a prefix can be carried as any A congruent to
   it: appending D bits of data B gives A x^D + B, and
       A x^D = hi x^(D+64) + lo x^D  ==  clmul(hi, x^(D+63) mod P) + clmul(lo, x^(D-1) mod P)
   (clmul of two reflected quadwords yields the product times x, hence the -1). Each product
   has degree < 128, so one lane stays one lane; sixteen lanes (four registers) fold side by
   side, 256 bytes a step, and at the end fold into one register whose 64 bytes go through the
   crc32 instruction. A constant congruent to x^m, of degree < 64, is (x^(m-32) mod P) x^32:
   the 32-bit reflected value in the low half of the quadword.

   The fused copy stores each register it loads, so a checked copy reads memory once. */
#include "_crc32c_fold.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <string.h>

#define FOLD __attribute__((target("avx512f,vpclmulqdq,sse4.2")))

/* Per 128-bit lane: {low quadword's factor, high quadword's factor} for a shift of D bits. */
static uint64_t by_block[2], by_register[2];

static void shift_constants(uint64_t *k, uint64_t bits, uint32_t (*xpow)(uint64_t))
{
    k[0] = xpow(bits + 63 - 32);
    k[1] = xpow(bits - 1 - 32);
}

int crc32c_fold_init(uint32_t (*xpow)(uint64_t bits))
{
    shift_constants(by_block, 8 * CRC32C_FOLD_BLOCK, xpow);
    shift_constants(by_register, 512, xpow);
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
}

FOLD static inline __m512i fold(__m512i acc, __m512i k, __m512i data)
{
    __m512i high = _mm512_clmulepi64_epi128(acc, k, 0x00);
    __m512i low = _mm512_clmulepi64_epi128(acc, k, 0x11);
    return _mm512_ternarylogic_epi64(high, low, data, 0x96);   /* three-way xor */
}

FOLD static inline __m512i load(const char *src, char *dst, size_t at)
{
    __m512i v = _mm512_loadu_si512((const void *)(src + at));
    if (dst)
        _mm512_storeu_si512((void *)(dst + at), v);
    return v;
}

FOLD uint32_t crc32c_fold(uint32_t state, const char *src, size_t n, char *dst)
{
    __m512i a = load(src, dst, 0), b = load(src, dst, 64), c = load(src, dst, 128), d = load(src, dst, 192);
    a = _mm512_xor_si512(a, _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)state)));
    __m512i k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)by_block));
    for (size_t at = CRC32C_FOLD_BLOCK; at < n; at += CRC32C_FOLD_BLOCK) {
        a = fold(a, k, load(src, dst, at));
        b = fold(b, k, load(src, dst, at + 64));
        c = fold(c, k, load(src, dst, at + 128));
        d = fold(d, k, load(src, dst, at + 192));
    }
    k = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)by_register));
    d = fold(fold(fold(a, k, b), k, c), k, d);
    uint64_t words[8], crc = 0;
    _mm512_storeu_si512((void *)words, d);
    for (int i = 0; i < 8; i++)
        crc = _mm_crc32_u64(crc, words[i]);
    return (uint32_t)crc;
}

#else

int crc32c_fold_init(uint32_t (*xpow)(uint64_t bits))
{
    (void)xpow;
    return 0;
}

uint32_t crc32c_fold(uint32_t state, const char *src, size_t n, char *dst)
{
    (void)src, (void)n, (void)dst;
    return state;
}

#endif
