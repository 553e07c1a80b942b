/* The bf16 score and value steps of _prefill_native.c on AMX tiles, for CPUs that have them (Intel Sapphire Rapids
   on): TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32, many times VDPBF16PS's work in
   one instruction. The tiles read the layouts the AVX-512 bf16 steps already use: query rows (16 x 32 dims a tile),
   K packed per 16 keys as pairs of dims (a tile's 16 rows are 16 pairs, its columns the 16 keys), V packed as pairs
   of consecutive keys (16 rows of key pairs, 16 dims as columns), the weights p as rows of bf16 (16 x 32 keys).
   Accumulation is fp32 as on VDPBF16PS; only the order of the sums differs. Included by _prefill_native.c after
   its definitions. All eight tiles are configured alike (16 rows of 64 bytes): tmm0 queries or weights, tmm2 and
   tmm3 keys or values, tmm4 .. tmm7 accumulators. */
#ifndef NEURON_DI_PREFILL_AMX_H
#define NEURON_DI_PREFILL_AMX_H

#include "_amx.h"

/* Like scores_bf16 for AMX_ROWS rows: s[r][0 .. keys) = q[r] . K, tops[r] the largest over whole tiles of 32 keys
   below `shared`. */
TARGET_AMX static void scores_amx(const void *qb_, const void *kp_, int64_t keys, int64_t shared, float *s,
                                  int64_t s_stride, float *tops, const Dims *d)
{
    const uint16_t *qb = qb_;
    const uint32_t *kp = kp_;
    const int64_t pairs = d->head_dim / 2;
    __m512 top[AMX_ROWS];
    for (int r = 0; r < AMX_ROWS; r++)
        top[r] = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < keys; j += KEY_TILE) {
        const uint32_t *t0 = kp + (j / 16) * pairs * 16, *t1 = t0 + pairs * 16;
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t c = 0; c < pairs; c += 16) {    /* 32 dims: 16 pairs a tile */
            _tile_loadd(0, qb + 2 * c, d->head_dim * 2);
            _tile_loadd(2, t0 + c * 16, 64);
            _tile_loadd(3, t1 + c * 16, 64);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
        }
        _tile_stored(4, s + j, s_stride * 4);
        _tile_stored(5, s + j + 16, s_stride * 4);
        if (j + KEY_TILE <= shared)
            for (int r = 0; r < AMX_ROWS; r++) {
                const float *row = s + r * s_stride + j;
                top[r] = _mm512_max_ps(top[r], _mm512_max_ps(_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16)));
            }
    }
    for (int r = 0; r < AMX_ROWS; r++)
        tops[r] = _mm512_reduce_max_ps(top[r]);
}

/* One group of TILES (2 or 4) accumulators of 16 dims from dim c: the weights of 32 keys at a time times V. */
#define AMX_VALUES_GROUP(TILES)                                                                                 \
    for (int64_t m = 0; m < keys; m += 32) {                                                                    \
        _tile_loadd(0, p + m, p_stride * 2);                                                                    \
        const uint32_t *vrow = vp + (m / 2) * D + c;                                                            \
        _tile_loadd(2, vrow, D * 4);                                                                            \
        _tile_dpbf16ps(4, 0, 2);                                                                                \
        _tile_loadd(3, vrow + 16, D * 4);                                                                       \
        _tile_dpbf16ps(5, 0, 3);                                                                                \
        if (TILES > 2) { _tile_loadd(2, vrow + 32, D * 4); _tile_dpbf16ps(6, 0, 2); }                           \
        if (TILES > 3) { _tile_loadd(3, vrow + 48, D * 4); _tile_dpbf16ps(7, 0, 3); }                           \
    }

/* Like values_bf16 for up to AMX_ROWS rows: out rows = (P @ V) / sums, rounded to bf16. */
TARGET_AMX static void values_amx(const void *p_, int64_t p_stride, const void *vp_, int64_t keys,
                                  const float *sums, int rows, void *out_, int64_t out_stride, const Dims *d)
{
    const uint16_t *p = p_;
    const uint32_t *vp = vp_;
    uint16_t *out = out_;
    const int64_t D = d->head_dim;
    float acc[AMX_ROWS][64];
    for (int64_t c = 0; c < D; c += 64) {
        const int tiles = D - c >= 64 ? 4 : (int)(D - c) / 16;   /* head_dim is a multiple of 32: 2 or 4 */
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        if (tiles == 4) {
            AMX_VALUES_GROUP(4)
        } else {
            AMX_VALUES_GROUP(2)
        }
        _tile_stored(4, acc[0], sizeof acc[0]);
        _tile_stored(5, acc[0] + 16, sizeof acc[0]);
        _tile_stored(6, acc[0] + 32, sizeof acc[0]);
        _tile_stored(7, acc[0] + 48, sizeof acc[0]);
        for (int r = 0; r < rows; r++) {
            const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);
            for (int x = 0; x < tiles; x++)
                _mm256_storeu_si256((__m256i *)(out + r * out_stride + c + 16 * x),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * x), inv)));
        }
    }
}

#endif
