/* worker.layers._paged_decode: decode attention that reads K and V straight from the pool.

   The torch path gathers every sequence's context out of the paged pool into a fresh tensor
   in every layer of every step, then SDPA reads that copy again: three passes over the
   context's bytes where one would do, and at a few hundred tokens those passes cost more
   than the attention's arithmetic. These two loops walk each sequence's block table and
   read every K and V row once, in pool order. The softmax between them stays in torch.

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
        for (int64_t r = 0; r < rows; r++)                                                              \
            for (int64_t t = lens[s]; t < T_; t++)                                                      \
                out[r * T_ + t] = -INFINITY;                                                            \
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

#define ARGS_FORMAT "KKKKKLLLLLLLLdp"

/* Both entry points take: a (q or probs), plane, tables, lens, out addresses, then the dims, the scale and
   whether the plane holds bf16 (else fp32). */
static PyObject *run(PyObject *args, int scores)
{
    unsigned long long a, plane, tables, lens, out;
    Dims d;
    double scale = 0;
    int rc, bf16 = 0;

    if (!PyArg_ParseTuple(args, ARGS_FORMAT, &a, &plane, &tables, &lens, &out, &d.num_seqs, &d.max_blocks,
                          &d.block_size, &d.num_blocks, &d.kv_heads, &d.group, &d.head_dim, &d.max_context,
                          &scale, &bf16))
        return NULL;
    if (d.head_dim % LANES || d.block_size < 1 || d.max_blocks * d.block_size < d.max_context) {
        PyErr_SetString(PyExc_ValueError, "head_dim must be a multiple of 16 and tables must cover max_context");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    const float *in = (const float *)(uintptr_t)a;
    const int64_t *table_ptr = (const int64_t *)(uintptr_t)tables, *len_ptr = (const int64_t *)(uintptr_t)lens;
    float *dst = (float *)(uintptr_t)out;
    if (bf16)
        rc = scores ? scores_bf16(in, (const uint16_t *)(uintptr_t)plane, table_ptr, len_ptr, (float)scale, dst, &d)
                    : values_bf16(in, (const uint16_t *)(uintptr_t)plane, table_ptr, len_ptr, dst, &d);
    else
        rc = scores ? scores_f32(in, (const float *)(uintptr_t)plane, table_ptr, len_ptr, (float)scale, dst, &d)
                    : values_f32(in, (const float *)(uintptr_t)plane, table_ptr, len_ptr, dst, &d);
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
