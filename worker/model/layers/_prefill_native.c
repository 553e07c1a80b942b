/* worker.layers._prefill_native: causal prompt attention on AVX-512, in bf16 or fp32, read from the paged pool.

   torch's CPU flash kernel runs bf16 at fp32's speed where the CPU has no AMX: its small blocked
   GEMMs go through oneDNN's generic bf16 path and convert every block. In bf16 this kernel multiplies
   bf16 pairs with VDPBF16PS (fp32 accumulation), as oneDNN's large GEMMs do, and keeps what
   must stay exact in fp32: the scores, the softmax (max, exp, sum) and the output accumulators.
   Like the flash kernel, the exponentials are rounded to bf16 before they weigh V and the
   sum that normalises them is taken in fp32 before rounding. In fp32 the same blocks run on FMAs
   and nothing is rounded below fp32 (torch's flash kernel reaches about a third of the FMA peak there).
   Where the CPU has AMX, bf16's scores and weighted values run on its tiles instead (_prefill_amx.h).

   One sequence per call: n query rows at positions ctx - n .. ctx - 1, each sees keys 0 .. its
   position. K and V are read from the paged pool through the block table (the step has
   written this chunk's rows there already), packed once per KV head into the layouts the dot
   products want: K in tiles of 16 keys (bf16: x (d / 2) pairs; fp32: x d), V as pairs of consecutive
   keys (bf16) or as rows (fp32).

   Layouts: q rows (n, heads, d) with row stride q_stride (elements), heads contiguous;
   one layer's K or V plane (blocks, block_size, kv_heads, d); table (max_blocks,) int64;
   out (n, heads, d), contiguous; q, K, V and out all bf16 or all fp32. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_avx512.h"

#define QB 48          /* query rows per block: their scores (QB x context, fp32) stay in L2 */
#define QK_ROWS 12     /* score micro-kernel: 12 rows x 32 keys, 24 accumulators */
#define PV_ROWS 12     /* value micro-kernel: 12 rows x 32 dims, 24 accumulators */
#define PV_VECS 2      /* vectors of 16 dims a value micro-kernel row holds */
#define KEY_TILE 32    /* keys per score micro-kernel step (two vectors of 16) */

typedef struct {
    int64_t n, heads, kv_heads, head_dim, q_stride, num_blocks, block_size, max_blocks, ctx;
    int64_t elem;                   /* bytes of one element of q, K, V, out and the softmax's weights: 2 or 4 */
    int64_t first_head, end_head;   /* the KV heads this call computes (callers split heads across threads) */
    float scale;                    /* 1 / sqrt(head_dim) times log2(e): what turns a score into a power of 2 */
} Dims;

#define OK 0
#define BAD_BLOCK (-1)
#define NO_MEMORY (-2)

/* 2^x for x <= 0: 2^round(x) (VSCALEFPS) times a polynomial for 2^f, |f| <= 1/2, fitted for relative
   error (least squares reweighted toward minimax); underflows to 0. The scores are in units of log2(e), so
   this is exp of the natural ones. fp32 keeps degree 6 (relative error 1e-7, about 2 half-ulps); bf16
   rounds the result to 8 bits, where degree 4 (3e-6) is already a thousand times finer. */
#define EXP2_PS(NAME, ...)                                                                                      \
TARGET_F32 static inline __m512 NAME(__m512 x)                                                                  \
{                                                                                                               \
    static const float c[] = {__VA_ARGS__};                                                                     \
    const int degree = sizeof c / sizeof c[0] - 1;                                                              \
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));                                                              \
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                     \
    const __m512 f = _mm512_sub_ps(x, n);                                                                       \
    __m512 p = _mm512_set1_ps(c[degree]);                                                                       \
    for (int i = degree - 1; i >= 0; i--)                                                                       \
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));                                                        \
    return _mm512_scalef_ps(p, n);                                                                              \
}
EXP2_PS(exp2_f32, 1.0f, 0.693147182f, 0.240226462f, 0.0555032864f, 0.00961848907f, 0.00133999309f, 0.000153458124f)
EXP2_PS(exp2_bf16, 0.999999285f, 0.693121791f, 0.240247443f, 0.0559178628f, 0.00957010128f)

/* The largest of the scores s[from .. valid) and of top, in every lane. */
TARGET_F32 static inline __m512 row_max(const float *s, int64_t from, int64_t valid, float top)
{
    __m512 mx = _mm512_set1_ps(top);
    for (int64_t j = from; j < valid; j += 16)
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes(valid - j), s + j));
    return _mm512_set1_ps(_mm512_reduce_max_ps(mx));
}

/* Scores of QK_ROWS rows x KEY_TILE keys into s at column j; where tops is given, each row's running largest
   score takes them in too. */
TARGET_F32 static inline void store_scores(__m512 acc[QK_ROWS][2], float *s, int64_t s_stride, int64_t j, __m512 *tops)
{
    for (int r = 0; r < QK_ROWS; r++) {
        _mm512_storeu_ps(s + r * s_stride + j, acc[r][0]);
        _mm512_storeu_ps(s + r * s_stride + j + 16, acc[r][1]);
        if (tops != NULL)
            tops[r] = _mm512_max_ps(tops[r], _mm512_max_ps(acc[r][0], acc[r][1]));
    }
}

/* Row t of one KV head in the pool, or NULL if the table points outside it. */
static const char *pool_row(const char *plane, const int64_t *table, int64_t t, int64_t h, const Dims *d)
{
    int64_t block = table[t / d->block_size];
    if (block < 0 || block >= d->num_blocks)
        return NULL;
    return plane + ((block * d->block_size + t % d->block_size) * d->kv_heads + h) * d->head_dim * d->elem;
}

/* One dtype's steps: pack a KV head, score a block of rows, weigh a row, sum the weighted values; `rows` is what
   one call of scores or values takes, `tiles` whether they run on AMX tiles (configured around a call). */
typedef struct {
    int (*pack)(const char *k, const char *v, const int64_t *table, int64_t h, int64_t padded, void *kp, void *vp,
                const Dims *d);
    void (*scores)(const void *qb, const void *kp, int64_t keys, int64_t shared, float *s, int64_t s_stride,
                   float *tops, const Dims *d);
    float (*softmax)(const float *s, int64_t valid, float top, int64_t from, int64_t width, float scale, void *p);
    void (*values)(const void *p, int64_t p_stride, const void *vp, int64_t keys, const float *sums, int rows,
                   void *out, int64_t out_stride, const Dims *d);
    int rows, tiles;
} Kernel;

/* r[c] = column c of the 16 x 16 matrix of 32-bit words whose rows r held (four rounds of interleaving). */
TARGET_F32 static inline void transpose16(__m512i r[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2)   /* per 128-bit lane: words 0, 1 (lo) or 2, 3 (hi) of two rows */
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]), t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    for (int g = 0; g < 16; g += 4) {   /* u[g + j], lane L: word 4L + j of rows g .. g + 3 */
        u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]), u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
        u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]), u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
    }
    for (int j = 0; j < 4; j++) {   /* the lanes of u[j], u[4 + j], u[8 + j], u[12 + j], transposed */
        const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88), r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88), r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* kp[tile][pair][16 keys] and vp[key pair][dim] as bf16 pairs (uint32); keys past ctx are zeros. Per tile of 16
   keys: K's pairs transposed 16 x 16 words at a time, V's rows interleaved two at a time. */
TARGET_F32 static int pack_head_bf16(const char *k, const char *v, const int64_t *table, int64_t h, int64_t padded,
                                     void *kp_, void *vp_, const Dims *d)
{
    uint32_t *kp = kp_, *vp = vp_;
    const int64_t D = d->head_dim, pairs = D / 2;
    /* Qwords of the two interleavings (lo, hi: 4 dims a lane each) in the order of the dims. */
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (int64_t t0 = 0; t0 < padded; t0 += 16) {
        const uint16_t *kr[16], *vr[16];
        __mmask16 live[16];
        for (int n = 0; n < 16; n++) {
            live[n] = t0 + n < d->ctx ? 0xFFFF : 0;
            kr[n] = live[n] ? (const uint16_t *)pool_row(k, table, t0 + n, h, d) : (const uint16_t *)k;
            vr[n] = live[n] ? (const uint16_t *)pool_row(v, table, t0 + n, h, d) : (const uint16_t *)v;
            if (kr[n] == NULL || vr[n] == NULL)
                return BAD_BLOCK;
        }
        uint32_t *tile = kp + t0 * pairs;
        for (int64_t c = 0; c < pairs; c += 16) {
            __m512i r[16];
            for (int n = 0; n < 16; n++)
                r[n] = _mm512_maskz_loadu_epi32(live[n], kr[n] + 2 * c);
            transpose16(r);
            for (int p = 0; p < 16; p++)
                _mm512_storeu_si512(tile + (c + p) * 16, r[p]);
        }
        for (int n = 0; n < 16; n += 2) {
            uint32_t *row = vp + (t0 + n) / 2 * D;
            for (int64_t i = 0; i < D; i += 32) {
                const __m512i a = _mm512_maskz_loadu_epi32(live[n], vr[n] + i);
                const __m512i b = _mm512_maskz_loadu_epi32(live[n + 1], vr[n + 1] + i);
                const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
                _mm512_storeu_si512(row + i, _mm512_permutex2var_epi64(lo, first, hi));
                _mm512_storeu_si512(row + i + 16, _mm512_permutex2var_epi64(lo, second, hi));
            }
        }
    }
    return OK;
}

/* fp32: kp[tile][dim][16 keys] and vp[key][dim]; keys past ctx are zeros. */
static int pack_head_f32(const char *k, const char *v, const int64_t *table, int64_t h, int64_t padded,
                         void *kp_, void *vp_, const Dims *d)
{
    float *kp = kp_, *vp = vp_;
    const int64_t D = d->head_dim;
    memset(kp, 0, (size_t)(padded * D) * sizeof(float));
    memset(vp, 0, (size_t)(padded * D) * sizeof(float));
    for (int64_t t = 0; t < d->ctx; t++) {
        const float *kr = (const float *)pool_row(k, table, t, h, d), *vr = (const float *)pool_row(v, table, t, h, d);
        if (kr == NULL || vr == NULL)
            return BAD_BLOCK;
        float *tile = kp + (t / 16) * D * 16 + t % 16;
        for (int64_t i = 0; i < D; i++)
            tile[i * 16] = kr[i];
        memcpy(vp + t * D, vr, (size_t)D * sizeof(float));
    }
    return OK;
}

/* The three steps that differ by dtype only in their vector operations, written once. A "unit" is what one
   broadcast lane holds: a pair of bf16 values (PER_UNIT 2: VDPBF16PS multiplies pairs) or one fp32 value (1).
   K tiles hold units x 16 keys; V rows (or pairs of rows) hold units x d; the weights p are one element a key. */
#define DEFINE_STEPS(NAME, TGT, UNIT, PER_UNIT, VEC, LOADV, BCAST, MAC, ELEM, STORE16, EXP2)                    \
/* s[r][0 .. keys) = q[r] . K for QK_ROWS rows of qb (padded rows are zeros); tops[r] = the largest of          \
   s[r][0 .. shared_end), where shared_end is `shared` (keys every row sees) rounded down to a tile. */         \
TGT static void scores_##NAME(const void *qb_, const void *kp_, int64_t keys, int64_t shared, float *s,         \
                              int64_t s_stride, float *tops, const Dims *d)                                     \
{                                                                                                               \
    const UNIT *qb = qb_, *kp = kp_;                                                                            \
    const int64_t units = d->head_dim / PER_UNIT;                                                               \
    __m512 top[QK_ROWS];                                                                                        \
    for (int r = 0; r < QK_ROWS; r++)                                                                           \
        top[r] = _mm512_set1_ps(-INFINITY);                                                                     \
    for (int64_t j = 0; j < keys; j += KEY_TILE) {                                                              \
        __m512 acc[QK_ROWS][2];                                                                                 \
        for (int r = 0; r < QK_ROWS; r++)                                                                       \
            acc[r][0] = acc[r][1] = _mm512_setzero_ps();                                                        \
        const UNIT *t0 = kp + (j / 16) * units * 16, *t1 = t0 + units * 16;                                     \
        for (int64_t u = 0; u < units; u++) {                                                                   \
            const VEC b0 = LOADV(t0 + u * 16), b1 = LOADV(t1 + u * 16);                                         \
            for (int r = 0; r < QK_ROWS; r++) {                                                                 \
                const VEC a = BCAST(qb[r * units + u]);                                                         \
                acc[r][0] = MAC(acc[r][0], a, b0);                                                              \
                acc[r][1] = MAC(acc[r][1], a, b1);                                                              \
            }                                                                                                   \
        }                                                                                                       \
        store_scores(acc, s, s_stride, j, j + KEY_TILE <= shared ? top : NULL);                                 \
    }                                                                                                           \
    for (int r = 0; r < QK_ROWS; r++)                                                                           \
        tops[r] = _mm512_reduce_max_ps(top[r]);                                                                 \
}                                                                                                               \
                                                                                                                \
/* Turns scores s[0 .. valid) into 2^(scale (s - max)) in p[0 .. width) (zeros past valid), where `top` is      \
   the largest of s[0 .. from); returns their fp32 sum. */                                                      \
TGT static float softmax_##NAME(const float *s, int64_t valid, float top, int64_t from, int64_t width,          \
                                float scale, void *p_)                                                          \
{                                                                                                               \
    ELEM *p = p_;                                                                                               \
    const __m512 k = _mm512_set1_ps(scale), mxk = _mm512_mul_ps(row_max(s, from, valid, top), k);               \
    __m512 sum = _mm512_setzero_ps();                                                                           \
    for (int64_t j = 0; j < valid; j += 16) {                                                                   \
        const __mmask16 m = lanes(valid - j);                                                                   \
        const __m512 e = _mm512_maskz_mov_ps(m, EXP2(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, s + j), k, mxk)));\
        sum = _mm512_add_ps(sum, e);                                                                            \
        STORE16(p + j, e);                                                                                      \
    }                                                                                                           \
    const int64_t written = (valid + 15) / 16 * 16;                                                             \
    if (written < width)                                                                                        \
        memset(p + written, 0, (size_t)(width - written) * sizeof(ELEM));                                       \
    return _mm512_reduce_add_ps(sum);                                                                           \
}                                                                                                               \
                                                                                                                \
/* out rows = (P @ V) / sums for PV_ROWS rows of p (p_stride weights apart, keys up to `keys`), 16 * PV_VECS    \
   dims at a time (head_dim is a multiple of that: loops of fixed length keep the accumulators in registers). */ \
TGT static void values_##NAME(const void *p_, int64_t p_stride, const void *vp_, int64_t keys,                  \
                              const float *sums, int rows, void *out_, int64_t out_stride, const Dims *d)       \
{                                                                                                               \
    const UNIT *p = p_, *vp = vp_;                                                                              \
    ELEM *out = out_;                                                                                           \
    const int64_t D = d->head_dim;                                                                              \
    p_stride /= PER_UNIT;                                                                                       \
    for (int64_t c = 0; c < D; c += 16 * PV_VECS) {                                                             \
        __m512 acc[PV_ROWS][PV_VECS];                                                                           \
        for (int r = 0; r < PV_ROWS; r++)                                                                       \
            for (int x = 0; x < PV_VECS; x++)                                                                   \
                acc[r][x] = _mm512_setzero_ps();                                                                \
        for (int64_t m = 0; m < keys / PER_UNIT; m++) {                                                         \
            VEC b[PV_VECS];                                                                                     \
            for (int x = 0; x < PV_VECS; x++)                                                                   \
                b[x] = LOADV(vp + m * D + c + 16 * x);                                                          \
            for (int r = 0; r < PV_ROWS; r++) {                                                                 \
                const VEC a = BCAST(p[r * p_stride + m]);                                                       \
                for (int x = 0; x < PV_VECS; x++)                                                               \
                    acc[r][x] = MAC(acc[r][x], a, b[x]);                                                        \
            }                                                                                                   \
        }                                                                                                       \
        for (int r = 0; r < rows; r++) {                                                                        \
            const __m512 inv = _mm512_set1_ps(1.0f / sums[r]);                                                  \
            for (int x = 0; x < PV_VECS; x++)                                                                   \
                STORE16(out + r * out_stride + c + 16 * x, _mm512_mul_ps(acc[r][x], inv));                      \
        }                                                                                                       \
    }                                                                                                           \
}

/* bf16: pairs multiplied by VDPBF16PS, results rounded to bf16 (round to nearest even) as they are stored. */
#define LOAD_BF16(ptr) ((__m512bh)_mm512_loadu_si512(ptr))
#define BCAST_BF16(pair) ((__m512bh)_mm512_set1_epi32((int)(pair)))
#define MAC_BF16(acc, a, b) _mm512_dpbf16_ps((acc), (a), (b))
#define STORE_BF16(ptr, v) _mm256_storeu_si256((__m256i *)(ptr), (__m256i)_mm512_cvtneps_pbh(v))
DEFINE_STEPS(bf16, TARGET_BF16, uint32_t, 2, __m512bh, LOAD_BF16, BCAST_BF16, MAC_BF16, uint16_t, STORE_BF16,
             exp2_bf16)

/* fp32: FMAs, nothing rounded below fp32. */
#define MAC_F32(acc, a, b) _mm512_fmadd_ps((a), (b), (acc))
DEFINE_STEPS(f32, TARGET_F32, float, 1, __m512, _mm512_loadu_ps, _mm512_set1_ps, MAC_F32, float, _mm512_storeu_ps,
             exp2_f32)

#include "_prefill_amx.h"

static const Kernel BF16 = {pack_head_bf16, scores_bf16, softmax_bf16, values_bf16, QK_ROWS, 0};
static const Kernel F32 = {pack_head_f32, scores_f32, softmax_f32, values_f32, QK_ROWS, 0};
_Static_assert(QK_ROWS == PV_ROWS, "one Kernel.rows for both AVX-512 steps");
static const Kernel AMX = {pack_head_bf16, scores_amx, softmax_bf16, values_amx, AMX_ROWS, 1};

/* All query heads of one KV head: per block of QB rows, scores, softmax, then P @ V. */
static void attend_head(const Kernel *kern, const char *q, int64_t hq, const void *kp, const void *vp,
                        int64_t padded, char *qb, float *s, char *p, float *sums, char *out, const Dims *d)
{
    const int64_t D = d->head_dim, E = d->elem, first = d->ctx - d->n;
    float tops[QB];
    for (int64_t i0 = 0; i0 < d->n; i0 += QB) {
        const int64_t rows = d->n - i0 < QB ? d->n - i0 : QB;
        const int64_t keys = (first + i0 + rows + KEY_TILE - 1) / KEY_TILE * KEY_TILE;   /* <= padded */
        memset(qb, 0, (size_t)(QB * D * E));
        for (int64_t r = 0; r < rows; r++)
            memcpy(qb + r * D * E, q + ((i0 + r) * d->q_stride + hq * D) * E, (size_t)(D * E));
        /* Every row of the block sees keys 0 .. first + i0: the score kernel takes their largest as it goes. */
        const int64_t shared = first + i0 + 1, from = shared / KEY_TILE * KEY_TILE;
        for (int64_t r = 0; r < rows; r += kern->rows)
            kern->scores(qb + r * D * E, kp, keys, shared, s + r * padded, padded, tops + r, d);
        for (int64_t r = 0; r < rows; r++)
            sums[r] = kern->softmax(s + r * padded, first + i0 + r + 1, tops[r], from, keys, d->scale,
                                    p + r * padded * E);
        for (int64_t r = rows; r < (rows + kern->rows - 1) / kern->rows * kern->rows; r++)
            memset(p + r * padded * E, 0, (size_t)(keys * E));
        for (int64_t r = 0; r < rows; r += kern->rows) {
            const int take = (int)(rows - r < kern->rows ? rows - r : kern->rows);
            kern->values(p + r * padded * E, padded, vp, keys, sums + r, take,
                         out + ((i0 + r) * d->heads + hq) * D * E, d->heads * D, d);
        }
    }
}

static int attention(const Kernel *kern, const char *q, const char *k, const char *v, const int64_t *table,
                     char *out, const Dims *d)
{
    const int64_t padded = (d->ctx + KEY_TILE - 1) / KEY_TILE * KEY_TILE, group = d->heads / d->kv_heads;
    const size_t E = (size_t)d->elem;
    void *kp = malloc((size_t)(padded * d->head_dim) * E), *vp = malloc((size_t)(padded * d->head_dim) * E);
    char *qb = malloc((size_t)(QB * d->head_dim) * E), *p = malloc((size_t)(QB * padded) * E);
    float *s = malloc((size_t)(QB * padded) * sizeof(float));
    float sums[QB];
    int rc = kp && vp && qb && s && p ? OK : NO_MEMORY;
    if (kern->tiles)
        amx_configure();
    for (int64_t h = d->first_head; rc == OK && h < d->end_head; h++) {
        rc = kern->pack(k, v, table, h, padded, kp, vp, d);
        for (int64_t g = 0; rc == OK && g < group; g++)
            attend_head(kern, q, h * group + g, kp, vp, padded, qb, s, p, sums, out, d);
    }
    if (kern->tiles)
        amx_release();
    free(kp), free(vp), free(qb), free(s), free(p);
    return rc;
}

static int amx_ok;   /* whether the "amx" kernel runs here: asked once, as the module loads */

/* supported(kernel): whether this CPU runs the kernel "float32" (AVX-512F), "bfloat16" (AVX-512 BF16) or "amx"
   (bf16 on AMX tiles). */
static PyObject *supported(PyObject *module, PyObject *kernel)
{
    (void)module;
    const char *name = PyUnicode_AsUTF8(kernel);
    if (name == NULL)
        return NULL;
    return strcmp(name, "amx") == 0 ? PyBool_FromLong(amx_ok) : avx512_supported(kernel, "prompt attention");
}

static PyObject *prefill(PyObject *module, PyObject *args)
{
    unsigned long long q, k, v, table, out;
    Dims d;
    double scale = 0;
    const char *name;
    int rc;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLLLLLdLLs", &q, &k, &v, &table, &out, &d.n, &d.heads, &d.kv_heads,
                          &d.head_dim, &d.q_stride, &d.num_blocks, &d.block_size, &d.max_blocks, &d.ctx, &scale,
                          &d.first_head, &d.end_head, &name))
        return NULL;
    const Kernel *kern = strcmp(name, "float32") == 0 ? &F32 : strcmp(name, "bfloat16") == 0 ? &BF16
                         : strcmp(name, "amx") == 0 && amx_ok ? &AMX : NULL;
    if (kern == NULL) {
        PyErr_Format(PyExc_ValueError, "no prompt attention kernel %s here: float32, bfloat16 or, where "
                                       "supported('amx') says so, amx", name);
        return NULL;
    }
    d.scale = (float)(scale * M_LOG2E);
    d.elem = kern == &F32 ? 4 : 2;
    if (d.head_dim % 32 || d.kv_heads < 1 || d.heads % d.kv_heads || d.block_size < 1 || d.n < 1 || d.n > d.ctx
        || d.max_blocks * d.block_size < d.ctx || d.first_head < 0 || d.end_head > d.kv_heads
        || d.first_head >= d.end_head) {
        PyErr_SetString(PyExc_ValueError, "head_dim must be a multiple of 32, heads a multiple of kv_heads, "
                                          "0 < n <= ctx, the table must cover ctx and the head range be in range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = attention(kern, (const char *)(uintptr_t)q, (const char *)(uintptr_t)k,
                   (const char *)(uintptr_t)v, (const int64_t *)(uintptr_t)table, (char *)(uintptr_t)out, &d);
    Py_END_ALLOW_THREADS
    if (rc != OK) {
        if (rc == NO_MEMORY)
            return PyErr_NoMemory();
        PyErr_SetString(PyExc_ValueError, "a block table holds a block id outside the pool");
        return NULL;
    }
    return Py_NewRef(Py_None);
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_O,
     "supported(kernel): whether this CPU runs the kernel 'float32' (AVX-512F), 'bfloat16' (AVX-512 BF16) or 'amx' "
     "(bf16 on AMX tiles, where this process may use them)."},
    {"prefill", prefill, METH_VARARGS,
     "prefill(q, k_plane, v_plane, table, out, n, heads, kv_heads, head_dim, q_stride, num_blocks, block_size, "
     "max_blocks, ctx, scale, first_head, end_head, kernel): causal attention of one sequence's last n positions "
     "over its context, for KV heads first_head .. end_head - 1 (and their query heads); every tensor fp32 for "
     "kernel 'float32', else bf16."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefill_native", NULL, 0, methods};

PyMODINIT_FUNC PyInit__prefill_native(void)
{
    amx_ok = amx_usable();
    return PyModule_Create(&module);
}
