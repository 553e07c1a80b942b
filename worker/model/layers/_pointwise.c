/* worker.layers._pointwise: the decoder's element-wise steps on AVX-512, each one pass over its rows, in bf16 or
   fp32: silu(gate) * up, RMSNorm and the rotary embedding.

   torch runs each of them as three to eight separate ops, each a pass over memory, and in bf16 each converts its
   input to fp32 and its result back. These compute in fp32 and round to the storage dtype where torch's op
   sequence (the HF formulas the model follows) rounds: silu(gate) before it multiplies up; RMSNorm's normalised
   row before the weight multiplies it; each rotary product before their sum. So bf16 results are torch's but
   where an fp32 intermediate lands on the other side of a bf16 rounding boundary (the exponential, the row's
   sum of squares in another order), and fp32 results are within a few ulps of torch's.

   Each call walks `rows` rows, `in_stride` and `out_stride` elements apart; the columns of a row are contiguous. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "_avx512.h"

/* Up to 16 elements at p as fp32 (zeros in the masked-off lanes), and back; bf16 rounds to nearest even. */
TARGET_F32 static inline __m512 load_f32(const void *p, __mmask16 m)
{
    return _mm512_maskz_loadu_ps(m, p);
}

TARGET_F32 static inline void store_f32(void *p, __mmask16 m, __m512 v)
{
    _mm512_mask_storeu_ps(p, m, v);
}

/* v rounded to bf16 and widened again: where torch's op sequence stores a bf16 intermediate. */
TARGET_BF16 static inline __m512 round_bf16(__m512 v)
{
    return widen_bf16((__m256i)_mm512_cvtneps_pbh(v));
}

TARGET_F32 static inline __m512 round_f32(__m512 v)
{
    return v;
}

/* e^x: 2^n (VSCALEFPS) times a polynomial for e^f, f = x - n ln(2) in [-ln(2)/2, ln(2)/2], fitted for relative
   error (degree 6, about 1e-7); ln(2) is split in two so that f stays exact for large |x| (silu's gates reach
   +-100). Past about 88.7 the result is infinite, as torch's is (silu(x) is then -0); x is clamped below at
   -104, where it is 0. */
TARGET_F32 static inline __m512 exp_ps(__m512 x)
{
    static const float c[] = {1.0f, 1.0f, 0.499999911f, 0.166664198f, 0.0416682251f, 0.00837481581f, 0.00138368458f};
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194442e-4f), f);
    __m512 p = _mm512_set1_ps(c[6]);
    for (int i = 5; i >= 0; i--)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

typedef struct {
    int64_t rows, cols, in_stride, out_stride;
} Rows;

/* The three steps, written once for both dtypes (LOAD / STORE / ROUND move between the storage dtype and fp32). */
#define DEFINE_STEPS(NAME, TGT, ELEM, LOAD, STORE, ROUND)                                                       \
/* out[r][i] = silu(in[r][i]) * in[r][cols + i]: a fused gate and up projection's halves. */                    \
TGT static void silu_mul_##NAME(const void *in_, void *out_, const Rows *d)                                     \
{                                                                                                               \
    const ELEM *in = in_;                                                                                       \
    ELEM *out = out_;                                                                                           \
    for (int64_t r = 0; r < d->rows; r++) {                                                                     \
        const ELEM *gate = in + r * d->in_stride, *up = gate + d->cols;                                         \
        ELEM *o = out + r * d->out_stride;                                                                      \
        for (int64_t i = 0; i < d->cols; i += 16) {                                                             \
            const __mmask16 m = lanes(d->cols - i);                                                             \
            const __m512 g = LOAD(gate + i, m);                                                                 \
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g));                                     \
            const __m512 silu = ROUND(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));                \
            STORE(o + i, m, _mm512_mul_ps(silu, LOAD(up + i, m)));                                              \
        }                                                                                                       \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
/* out[r] = weight * (in[r] / sqrt(mean(in[r]^2) + eps)), the normalised row rounded before the weight. */      \
TGT static void rms_norm_##NAME(const void *in_, const void *weight_, float eps, void *out_, const Rows *d)     \
{                                                                                                               \
    const ELEM *in = in_, *weight = weight_;                                                                    \
    ELEM *out = out_;                                                                                           \
    for (int64_t r = 0; r < d->rows; r++) {                                                                     \
        const ELEM *x = in + r * d->in_stride;                                                                  \
        ELEM *o = out + r * d->out_stride;                                                                      \
        __m512 sum = _mm512_setzero_ps();                                                                       \
        for (int64_t i = 0; i < d->cols; i += 16) {                                                             \
            const __m512 v = LOAD(x + i, lanes(d->cols - i));                                                   \
            sum = _mm512_fmadd_ps(v, v, sum);                                                                   \
        }                                                                                                       \
        const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(sum) / (float)d->cols + eps));    \
        for (int64_t i = 0; i < d->cols; i += 16) {                                                             \
            const __mmask16 m = lanes(d->cols - i);                                                             \
            const __m512 h = ROUND(_mm512_mul_ps(LOAD(x + i, m), scale));                                       \
            STORE(o + i, m, _mm512_mul_ps(LOAD(weight + i, m), h));                                             \
        }                                                                                                       \
    }                                                                                                           \
}                                                                                                               \
                                                                                                                \
/* Each head of in[r] (heads x cols) rotated: x * cos + rotate_half(x) * signed_sin, each product rounded       \
   before the sum; cos and signed_sin (rows x cols) are one row per position. */                                \
TGT static void rotary_##NAME(const void *in_, const void *cos_, const void *sin_, int64_t heads, void *out_,   \
                              const Rows *d)                                                                    \
{                                                                                                               \
    const ELEM *in = in_, *cos = cos_, *sin = sin_;                                                             \
    ELEM *out = out_;                                                                                           \
    const int64_t half = d->cols / 2;                                                                           \
    for (int64_t r = 0; r < d->rows; r++) {                                                                     \
        const ELEM *c = cos + r * d->cols, *s = sin + r * d->cols;                                              \
        for (int64_t h = 0; h < heads; h++) {                                                                   \
            const ELEM *x = in + r * d->in_stride + h * d->cols;                                                \
            ELEM *o = out + r * d->out_stride + h * d->cols;                                                    \
            for (int64_t i = 0; i < half; i += 16) {                                                            \
                const __mmask16 m = lanes(half - i);                                                            \
                const __m512 lo = LOAD(x + i, m), hi = LOAD(x + half + i, m);                                   \
                STORE(o + i, m, _mm512_add_ps(ROUND(_mm512_mul_ps(lo, LOAD(c + i, m))),                         \
                                              ROUND(_mm512_mul_ps(hi, LOAD(s + i, m)))));                       \
                STORE(o + half + i, m, _mm512_add_ps(ROUND(_mm512_mul_ps(hi, LOAD(c + half + i, m))),           \
                                                     ROUND(_mm512_mul_ps(lo, LOAD(s + half + i, m)))));         \
            }                                                                                                   \
        }                                                                                                       \
    }                                                                                                           \
}

DEFINE_STEPS(bf16, TARGET_BF16, uint16_t, load_bf16, store_bf16, round_bf16)
DEFINE_STEPS(f32, TARGET_F32, float, load_f32, store_f32, round_f32)

/* supported(dtype): whether this CPU runs the steps in "bfloat16" (AVX-512 BF16) or "float32" (AVX-512F). */
static PyObject *supported(PyObject *module, PyObject *dtype)
{
    (void)module;
    return avx512_supported(dtype, "element-wise steps");
}

static int valid(const Rows *d)
{
    if (d->rows < 0 || d->cols < 1 || d->in_stride < 0 || d->out_stride < d->cols) {
        PyErr_SetString(PyExc_ValueError, "rows must not be negative, cols positive and rows no narrower than cols");
        return 0;
    }
    return 1;
}

static PyObject *silu_mul(PyObject *module, PyObject *args)
{
    unsigned long long in, out;
    Rows d;
    int fp32;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKLLLLp", &in, &out, &d.rows, &d.cols, &d.in_stride, &d.out_stride, &fp32)
        || !valid(&d))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    (fp32 ? silu_mul_f32 : silu_mul_bf16)((const void *)(uintptr_t)in, (void *)(uintptr_t)out, &d);
    Py_END_ALLOW_THREADS
    return Py_NewRef(Py_None);
}

static PyObject *rms_norm(PyObject *module, PyObject *args)
{
    unsigned long long in, weight, out;
    Rows d;
    double eps;
    int fp32;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKdKLLLLp", &in, &weight, &eps, &out, &d.rows, &d.cols, &d.in_stride,
                          &d.out_stride, &fp32) || !valid(&d))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    (fp32 ? rms_norm_f32 : rms_norm_bf16)((const void *)(uintptr_t)in, (const void *)(uintptr_t)weight, (float)eps,
                                          (void *)(uintptr_t)out, &d);
    Py_END_ALLOW_THREADS
    return Py_NewRef(Py_None);
}

static PyObject *rotary(PyObject *module, PyObject *args)
{
    unsigned long long in, cos, sin, out;
    Rows d;
    int64_t heads;
    int fp32;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKKLKLLLLp", &in, &cos, &sin, &heads, &out, &d.rows, &d.cols, &d.in_stride,
                          &d.out_stride, &fp32) || !valid(&d))
        return NULL;
    if (d.cols % 2 || heads < 1 || d.out_stride < heads * d.cols) {
        PyErr_SetString(PyExc_ValueError, "head_dim must be even, heads positive and the rows hold every head");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    (fp32 ? rotary_f32 : rotary_bf16)((const void *)(uintptr_t)in, (const void *)(uintptr_t)cos,
                                      (const void *)(uintptr_t)sin, heads, (void *)(uintptr_t)out, &d);
    Py_END_ALLOW_THREADS
    return Py_NewRef(Py_None);
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_O,
     "supported(dtype): whether this CPU runs the steps in dtype ('bfloat16': AVX-512 BF16, 'float32': AVX-512F)."},
    {"silu_mul", silu_mul, METH_VARARGS,
     "silu_mul(in, out, rows, cols, in_stride, out_stride, fp32): out = silu(in[:, :cols]) * in[:, cols:2 cols]."},
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(in, weight, eps, out, rows, cols, in_stride, out_stride, fp32): HF's RMSNorm of each row."},
    {"rotary", rotary, METH_VARARGS,
     "rotary(in, cos, signed_sin, heads, out, rows, head_dim, in_stride, out_stride, fp32): the rotate-half "
     "rotary embedding of each row's heads."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pointwise", NULL, 0, methods};

PyMODINIT_FUNC PyInit__pointwise(void)
{
    return PyModule_Create(&module);
}
