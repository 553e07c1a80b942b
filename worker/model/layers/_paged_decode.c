/* worker.layers._paged_decode: decode attention that reads K and V straight from the pool.

   The torch path gathers every sequence's context out of the paged pool into a fresh tensor
   in every layer of every step, then SDPA reads that copy again: three passes over the
   context's bytes where one would do, and at a few hundred tokens those passes cost more
   than the attention's arithmetic. These two loops walk each sequence's block table and
   read every K and V row once, in pool order. The softmax between them stays in torch.

   Where the CPU has AVX-512 and head_dim is 32, 64 or 128, both loops run on vectors written out:
   the scores take 16 positions at a time, each a vector of partial sums, and fold the 16 into one
   vector of their totals (`sum16`), instead of folding every dot product on its own; the values
   keep a KV head's query rows in registers while they walk its positions once. Elsewhere (or with
   `portable`) the plain loops below run, which compilers vectorize as they can.

   Layouts (all contiguous, fp32 / int64): q (seqs, kv_heads, group, d); one layer's K or V
   plane (blocks, block_size, kv_heads, d), fp32 or bf16 (read as fp32); tables (seqs, max_blocks); lens (seqs,);
   probs and scores (seqs, kv_heads, group, max_context); out (seqs, kv_heads, group, d). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* Dot products run in LANES independent partial sums, which compilers vectorize without
   reassociating a float reduction; head_dim must be a multiple of it (checked by the caller). */
#define LANES 16

typedef struct {
    int64_t num_seqs, max_blocks, block_size, num_blocks, kv_heads, group, head_dim, max_context;
} Dims;

/* Where position t's K or V row (all kv heads) starts in a plane, in elements; -1 if the table
   points outside the pool. */
static int64_t pool_row(const int64_t *table, int64_t t, const Dims *d)
{
    int64_t block = table[t / d->block_size];
    if (block < 0 || block >= d->num_blocks)
        return -1;
    return (block * d->block_size + t % d->block_size) * d->kv_heads * d->head_dim;
}

/* A bf16 pool element as fp32: its 16 bits are fp32's top half. */
static inline float bf16_value(uint16_t x)
{
    uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline float f32_value(float x)
{
    return x;
}

/* -inf past a sequence's context, in each of its rows of scores. */
static void mask_past(float *out, int64_t rows, int64_t max_context, int64_t len)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t t = len; t < max_context; t++)
            out[r * max_context + t] = -INFINITY;
}

/* Return codes of the loops. */
#define OK 0
#define BAD_BLOCK (-1)
#define BAD_LENGTH (-2)

/* The loops for a pool of element type T, each element read as fp32 by VALUE. q, probs, scores
   and out are fp32 whatever the pool holds. */
#define DECODE_LOOPS(SUFFIX, T, VALUE)                                                                  \
static inline __attribute__((always_inline)) float dot_##SUFFIX(const float *a, const T *b, int64_t n)                                     \
{                                                                                                       \
    float lanes[LANES] = {0};                                                                           \
    for (int64_t i = 0; i < n; i += LANES)                                                              \
        for (int j = 0; j < LANES; j++)                                                                 \
            lanes[j] += a[i + j] * VALUE(b[i + j]);                                                     \
    for (int width = LANES / 2; width > 0; width /= 2)   /* a tree: a serial sum of the lanes cost more */ \
        for (int j = 0; j < width; j++)                                                                 \
            lanes[j] += lanes[j + width];                                                               \
    return lanes[0];                                                                                    \
}                                                                                                       \
                                                                                                        \
/* scores[s, h, g, t] = scale * q[s, h, g] . K[t, h] for t < lens[s]; -inf beyond. */                  \
__attribute__((target_clones("avx512f", "avx2", "default")))                                            \
static int scores_##SUFFIX(const float *q, const T *k, const int64_t *tables, const int64_t *lens,      \
                           float scale, float *scores, const Dims *d)                                   \
{                                                                                                       \
    const int64_t rows = d->kv_heads * d->group, T_ = d->max_context, D = d->head_dim;                 \
    for (int64_t s = 0; s < d->num_seqs; s++) {                                                         \
        const float *qs = q + s * rows * D;                                                             \
        float *out = scores + s * rows * T_;                                                            \
        if (lens[s] < 0 || lens[s] > T_)                                                                \
            return BAD_LENGTH;                                                                          \
        for (int64_t t = 0; t < lens[s]; t++) {                                                         \
            const int64_t at = pool_row(tables + s * d->max_blocks, t, d);                              \
            if (at < 0)                                                                                 \
                return BAD_BLOCK;                                                                       \
            for (int64_t r = 0; r < rows; r++)                                                          \
                out[r * T_ + t] = scale * dot_##SUFFIX(qs + r * D, k + at + (r / d->group) * D, D);     \
        }                                                                                               \
        mask_past(out, rows, T_, lens[s]);                                                              \
    }                                                                                                   \
    return OK;                                                                                          \
}                                                                                                       \
                                                                                                        \
/* out[s, h, g] = sum over t < lens[s] of probs[s, h, g, t] * V[t, h]. */                              \
__attribute__((target_clones("avx512f", "avx2", "default")))                                            \
static int values_##SUFFIX(const float *probs, const T *v, const int64_t *tables, const int64_t *lens, \
                           float *out, const Dims *d)                                                   \
{                                                                                                       \
    const int64_t rows = d->kv_heads * d->group, T_ = d->max_context, D = d->head_dim;                 \
    memset(out, 0, (size_t)(d->num_seqs * rows * D) * sizeof(float));                                  \
    for (int64_t s = 0; s < d->num_seqs; s++) {                                                         \
        const float *ps = probs + s * rows * T_;                                                        \
        float *os = out + s * rows * D;                                                                 \
        if (lens[s] < 0 || lens[s] > T_)                                                                \
            return BAD_LENGTH;                                                                          \
        for (int64_t t = 0; t < lens[s]; t++) {                                                         \
            const int64_t at = pool_row(tables + s * d->max_blocks, t, d);                              \
            if (at < 0)                                                                                 \
                return BAD_BLOCK;                                                                       \
            for (int64_t r = 0; r < rows; r++) {                                                        \
                const float w = ps[r * T_ + t];                                                         \
                const T *src = v + at + (r / d->group) * D;                                             \
                float *dst = os + r * D;                                                                \
                for (int64_t i = 0; i < D; i++)                                                         \
                    dst[i] += w * VALUE(src[i]);                                                        \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    return OK;                                                                                          \
}

DECODE_LOOPS(f32, float, f32_value)
DECODE_LOOPS(bf16, uint16_t, bf16_value)

#if defined(__x86_64__)
#include <immintrin.h>
#define AVX512 __attribute__((target("avx512f")))

AVX512 static inline __m512 vec_f32(const float *p)
{
    return _mm512_loadu_ps(p);
}

AVX512 static inline __m512 vec_bf16(const uint16_t *p)   /* 16 bf16 values widened to fp32 */
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Asks for one position's KV row (all its heads) to be brought into cache ahead of its use: the rows lie in
   blocks spread over the pool, which the hardware's prefetchers, stopping at each page's end, do not run ahead
   into. Callers spread these over their work, a row at a time, so as not to fill the queue of misses. */
AVX512 static inline void prefetch_row(const char *row, int64_t bytes)
{
    for (int64_t at = 0; at < bytes; at += 64)
        _mm_prefetch(row + at, _MM_HINT_T0);
}

/* Lane j of the result: the sum of a[j]'s 16 lanes (a butterfly of 45 operations for 16 sums). */
AVX512 static inline __m512 sum16(const __m512 *a)
{
    __m512 s1[8], s2[4], s3[2];
    for (int k = 0; k < 8; k++)   /* per 128-bit lane: a0+a2, b0+b2, a1+a3, b1+b3 of a = a[2k], b = a[2k+1] */
        s1[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++)   /* per 128-bit lane: one partial sum of each of 4 consecutive vectors */
        s2[k] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * k], s1[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s1[2 * k], s1[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int k = 0; k < 2; k++)
        s3[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

/* The loops of DECODE_LOOPS on vectors, for head_dim = 16 * CH (CH a constant, so every accumulator is a
   register). Scores: per sequence, 16 positions at a time (fewer at its end, masked), per query row. Values:
   per sequence, VALUE_TILE positions at a time (their V rows stay in cache), per pair of query rows of a KV
   head, whose sums stay in registers over the tile. */
#define VALUE_TILE 32
#define SCORES_AHEAD 16   /* how far ahead of the positions in use the loops ask for rows (two or three tiles */
#define VALUES_AHEAD 32   /* ahead measured no better: this machine's memory is the limit) */
#define AVX512_LOOPS(SUFFIX, T, VEC, CH)                                                                \
AVX512 static int scores_##SUFFIX##_##CH(const float *q, const T *k, const int64_t *tables, const int64_t *lens, \
                                         float scale, float *scores, const Dims *d)                     \
{                                                                                                       \
    const int64_t rows = d->kv_heads * d->group, T_ = d->max_context, D = 16 * CH;                     \
    const __m512 scaled = _mm512_set1_ps(scale);                                                        \
    for (int64_t s = 0; s < d->num_seqs; s++) {                                                         \
        const float *qs = q + s * rows * D;                                                             \
        float *out = scores + s * rows * T_;                                                            \
        if (lens[s] < 0 || lens[s] > T_)                                                                \
            return BAD_LENGTH;                                                                          \
        for (int64_t t0 = 0; t0 < lens[s]; t0 += 16) {                                                  \
            const int64_t n = lens[s] - t0 < 16 ? lens[s] - t0 : 16;                                    \
            const T *at[16];                                                                            \
            for (int64_t j = 0; j < 16; j++) {                                                          \
                const int64_t row = pool_row(tables + s * d->max_blocks, t0 + (j < n ? j : 0), d);      \
                if (row < 0)                                                                            \
                    return BAD_BLOCK;                                                                   \
                at[j] = k + row;                                                                        \
            }                                                                                           \
            const int64_t from = t0 + SCORES_AHEAD, ahead = lens[s] - from < 16 ? lens[s] - from : 16;   \
            const int64_t bytes = d->kv_heads * D * (int64_t)sizeof(T);                                 \
            for (int64_t r = 0; r < rows; r++) {                                                        \
                const int64_t head = (r / d->group) * D;                                                \
                for (int64_t j = r; j < ahead; j += rows) {   /* 16 positions ahead, spread over the rows */ \
                    const int64_t row = pool_row(tables + s * d->max_blocks, from + j, d);              \
                    if (row >= 0)                                                                       \
                        prefetch_row((const char *)(k + row), bytes);                                  \
                }                                                                                       \
                __m512 qv[CH], acc[16];                                                                 \
                for (int c = 0; c < CH; c++)                                                            \
                    qv[c] = _mm512_loadu_ps(qs + r * D + 16 * c);                                       \
                for (int j = 0; j < 16; j++) {                                                          \
                    acc[j] = _mm512_mul_ps(qv[0], VEC(at[j] + head));                                   \
                    for (int c = 1; c < CH; c++)                                                        \
                        acc[j] = _mm512_fmadd_ps(qv[c], VEC(at[j] + head + 16 * c), acc[j]);            \
                }                                                                                       \
                _mm512_mask_storeu_ps(out + r * T_ + t0, (__mmask16)((1u << n) - 1),                   \
                                      _mm512_mul_ps(scaled, sum16(acc)));                               \
            }                                                                                           \
        }                                                                                               \
        mask_past(out, rows, T_, lens[s]);                                                              \
    }                                                                                                   \
    return OK;                                                                                          \
}                                                                                                       \
                                                                                                        \
AVX512 static int values_##SUFFIX##_##CH(const float *probs, const T *v, const int64_t *tables,        \
                                         const int64_t *lens, float *out, const Dims *d)                \
{                                                                                                       \
    const int64_t rows = d->kv_heads * d->group, T_ = d->max_context, D = 16 * CH;                     \
    memset(out, 0, (size_t)(d->num_seqs * rows * D) * sizeof(float));                                  \
    for (int64_t s = 0; s < d->num_seqs; s++) {                                                         \
        if (lens[s] < 0 || lens[s] > T_)                                                                \
            return BAD_LENGTH;                                                                          \
        for (int64_t t0 = 0; t0 < lens[s]; t0 += VALUE_TILE) {                                          \
            const int64_t n = lens[s] - t0 < VALUE_TILE ? lens[s] - t0 : VALUE_TILE;                    \
            const T *at[VALUE_TILE];                                                                    \
            for (int64_t j = 0; j < n; j++) {                                                           \
                const int64_t row = pool_row(tables + s * d->max_blocks, t0 + j, d);                    \
                if (row < 0)                                                                            \
                    return BAD_BLOCK;                                                                   \
                at[j] = v + row;                                                                        \
            }                                                                                           \
            for (int64_t r0 = 0; r0 < rows; r0 += 2) {   /* rows r0, r1 (= r0 for a head's last alone) */ \
                const int64_t r1 = (r0 + 1) % d->group ? r0 + 1 : r0, head = (r0 / d->group) * D;      \
                const float *p0 = probs + (s * rows + r0) * T_ + t0, *p1 = probs + (s * rows + r1) * T_ + t0; \
                float *o0 = out + (s * rows + r0) * D, *o1 = out + (s * rows + r1) * D;                 \
                __m512 acc0[CH], acc1[CH];                                                              \
                for (int c = 0; c < CH; c++) {                                                          \
                    acc0[c] = _mm512_loadu_ps(o0 + 16 * c);                                             \
                    acc1[c] = _mm512_loadu_ps(o1 + 16 * c);                                             \
                }                                                                                       \
                for (int64_t j = 0; j < n; j++) {                                                       \
                    const int64_t next = t0 + VALUES_AHEAD + j;   /* this head's part of a row ahead */ \
                    const int64_t ahead = next < lens[s] ? pool_row(tables + s * d->max_blocks, next, d) : -1; \
                    if (ahead >= 0)                                                                     \
                        prefetch_row((const char *)(v + ahead + head), D * (int64_t)sizeof(T));         \
                    const __m512 w0 = _mm512_set1_ps(p0[j]), w1 = _mm512_set1_ps(p1[j]);                \
                    for (int c = 0; c < CH; c++) {                                                      \
                        const __m512 x = VEC(at[j] + head + 16 * c);                                    \
                        acc0[c] = _mm512_fmadd_ps(w0, x, acc0[c]);                                      \
                        acc1[c] = _mm512_fmadd_ps(w1, x, acc1[c]);                                      \
                    }                                                                                   \
                }                                                                                       \
                for (int c = 0; c < CH; c++) {   /* r1 second: a row alone ends as its own acc1 */      \
                    _mm512_storeu_ps(o0 + 16 * c, acc0[c]);                                             \
                    _mm512_storeu_ps(o1 + 16 * c, acc1[c]);                                             \
                }                                                                                       \
                r0 -= r1 == r0;   /* a head's last row went alone: the next pair starts right after it */ \
            }                                                                                           \
        }                                                                                               \
    }                                                                                                   \
    return OK;                                                                                          \
}

#define AVX512_WIDTHS(SUFFIX, T, VEC) AVX512_LOOPS(SUFFIX, T, VEC, 2) AVX512_LOOPS(SUFFIX, T, VEC, 4) \
    AVX512_LOOPS(SUFFIX, T, VEC, 8)
AVX512_WIDTHS(f32, float, vec_f32)
AVX512_WIDTHS(bf16, uint16_t, vec_bf16)

/* The vector loops for these dims and pool type, if they apply here; 0 if not (rc untouched). */
static int run_avx512(int scores, int bf16, const float *in, const void *plane, const int64_t *tables,
                      const int64_t *lens, float scale, float *dst, const Dims *d, int *rc)
{
    const int64_t ch = d->head_dim / 16;
    if (!__builtin_cpu_supports("avx512f") || (ch != 2 && ch != 4 && ch != 8))
        return 0;
#define PICK(SUFFIX, T, CH) (scores ? scores_##SUFFIX##_##CH(in, (const T *)plane, tables, lens, scale, dst, d) \
                                    : values_##SUFFIX##_##CH(in, (const T *)plane, tables, lens, dst, d))
    if (bf16)
        *rc = ch == 2 ? PICK(bf16, uint16_t, 2) : ch == 4 ? PICK(bf16, uint16_t, 4) : PICK(bf16, uint16_t, 8);
    else
        *rc = ch == 2 ? PICK(f32, float, 2) : ch == 4 ? PICK(f32, float, 4) : PICK(f32, float, 8);
#undef PICK
    return 1;
}
#else
static int run_avx512(int scores, int bf16, const float *in, const void *plane, const int64_t *tables,
                      const int64_t *lens, float scale, float *dst, const Dims *d, int *rc)
{
    (void)scores, (void)bf16, (void)in, (void)plane, (void)tables, (void)lens, (void)scale, (void)dst, (void)d,
        (void)rc;
    return 0;   /* not an x86-64 CPU: the plain loops */
}
#endif

#define ARGS_FORMAT "KKKKKLLLLLLLLdp|p"

/* Both entry points take: a (q or probs), plane, tables, lens, out addresses, then the dims, the scale,
   whether the plane holds bf16 (else fp32), and optionally `portable` (the plain loops even where the
   vector ones apply). */
static PyObject *run(PyObject *args, int scores)
{
    unsigned long long a, plane, tables, lens, out;
    Dims d;
    double scale = 0;
    int rc, bf16 = 0, portable = 0;

    if (!PyArg_ParseTuple(args, ARGS_FORMAT, &a, &plane, &tables, &lens, &out, &d.num_seqs, &d.max_blocks,
                          &d.block_size, &d.num_blocks, &d.kv_heads, &d.group, &d.head_dim, &d.max_context,
                          &scale, &bf16, &portable))
        return NULL;
    if (d.head_dim % LANES || d.block_size < 1 || d.max_blocks * d.block_size < d.max_context) {
        PyErr_SetString(PyExc_ValueError, "head_dim must be a multiple of 16 and tables must cover max_context");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const float *in = (const float *)(uintptr_t)a;
    const int64_t *table_ptr = (const int64_t *)(uintptr_t)tables, *len_ptr = (const int64_t *)(uintptr_t)lens;
    float *dst = (float *)(uintptr_t)out;
    if (portable || !run_avx512(scores, bf16, in, (const void *)(uintptr_t)plane, table_ptr, len_ptr, (float)scale,
                                dst, &d, &rc)) {   /* the plain loops */
        if (bf16)
            rc = scores ? scores_bf16(in, (const uint16_t *)(uintptr_t)plane, table_ptr, len_ptr, (float)scale, dst, &d)
                        : values_bf16(in, (const uint16_t *)(uintptr_t)plane, table_ptr, len_ptr, dst, &d);
        else
            rc = scores ? scores_f32(in, (const float *)(uintptr_t)plane, table_ptr, len_ptr, (float)scale, dst, &d)
                        : values_f32(in, (const float *)(uintptr_t)plane, table_ptr, len_ptr, dst, &d);
    }
    Py_END_ALLOW_THREADS
    if (rc != OK) {
        PyErr_SetString(PyExc_ValueError, rc == BAD_BLOCK ? "a block table holds a block id outside the pool"
                                                          : "a context length is negative or above max_context");
        return NULL;
    }
    return Py_NewRef(Py_None);
}

static PyObject *scores(PyObject *module, PyObject *args)
{
    (void)module;
    return run(args, 1);
}

static PyObject *values(PyObject *module, PyObject *args)
{
    (void)module;
    return run(args, 0);
}

static PyMethodDef methods[] = {
    {"scores", scores, METH_VARARGS,
     "scores(q, k_plane, tables, lens, out, num_seqs, max_blocks, block_size, num_blocks, kv_heads, group, "
     "head_dim, max_context, scale, bf16): scaled q.K for every position; -inf past each context."},
    {"values", values, METH_VARARGS,
     "values(probs, v_plane, tables, lens, out, <same dims>, scale unused, bf16): probs @ V per sequence and head."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_paged_decode", NULL, 0, methods};

PyMODINIT_FUNC PyInit__paged_decode(void)
{
    return PyModule_Create(&module);
}
