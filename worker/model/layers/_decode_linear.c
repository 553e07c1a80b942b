/* A bf16 linear layer for the few rows of a decode step, on AMX tiles: out = x W^T (+ bias), fp32 accumulation.

   oneDNN runs such a product in a few microseconds, but torch's call into it takes ~20-30 more (oneDNN's own
   verbose log times a 256 x 256 product of 8 rows at ~5 us, the call at ~25-30), most of a small layer's time.
   This kernel does what oneDNN's AMX kernel does for up to 32 rows, in the same order: W packed once into blocks
   of 32 outputs, each block for each pair of inputs holding the 32 outputs' two weights side by side (a tile's
   16 rows are 16 pairs, its columns 16 outputs); x copied into zero-padded tiles of 16 rows x 32 inputs;
   TDPBF16PS sums each output's pairs in input order into fp32; the bias is added in fp32 and the sum rounded to
   bf16 (to nearest even). The results equal oneDNN's bit for bit (tests/worker/test_decode_linear.py). Tiles:
   tmm0 x, tmm2 and tmm3 the weights of a block's two halves, tmm4 and tmm5 their sums. */
#define PY_SSIZE_T_CLEAN
#include "_avx512.h"
#include "_amx.h"

#include <stdlib.h>

#define BLOCK 32     /* outputs per block: two tiles of 16 columns */
#define K_TILE 32    /* inputs per tile: 16 pairs */

typedef struct {
    int64_t rows, in_features, out_features, x_stride, out_stride;
} Shape;

/* Inputs rounded up to whole tiles: the packed weight's and the copied rows' width. */
static int64_t padded_inputs(const Shape *s)
{
    return (s->in_features + K_TILE - 1) / K_TILE * K_TILE;
}

/* sums (AMX_ROWS x BLOCK fp32) + bias, rounded to bf16, into the first `rows` rows and `width` columns (at most
   BLOCK) of out. */
TARGET_AMX static void store_block(const float *sums, const uint16_t *bias, uint16_t *out, int64_t rows,
                                   int64_t width, const Shape *s)
{
    const __mmask16 m0 = lanes(width), m1 = lanes(width > 16 ? width - 16 : 0);
    const __m512 b0 = bias ? load_bf16(bias, m0) : _mm512_setzero_ps();
    const __m512 b1 = bias ? load_bf16(bias + 16, m1) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; r++) {
        const float *row = sums + r * BLOCK;
        uint16_t *o = out + r * s->out_stride;
        store_bf16(o, m0, _mm512_add_ps(_mm512_load_ps(row), b0));
        store_bf16(o + 16, m1, _mm512_add_ps(_mm512_load_ps(row + 16), b1));
    }
}

/* out = x W^T + bias over every block of outputs, each block's rows AMX_ROWS at a time from `tiles` (x's rows
   copied, zero-padded to whole tiles). */
TARGET_AMX static void linear(const uint16_t *tiles, const uint16_t *packed, const uint16_t *bias, uint16_t *out,
                              const Shape *s)
{
    const int64_t width = padded_inputs(s);
    float sums[AMX_ROWS * BLOCK] __attribute__((aligned(64)));
    amx_configure();
    for (int64_t n = 0; n < s->out_features; n += BLOCK) {
        const uint16_t *block = packed + n * width;
        for (int64_t r = 0; r < s->rows; r += AMX_ROWS) {
            const uint16_t *x = tiles + r * width;
            _tile_zero(4);
            _tile_zero(5);
            for (int64_t k = 0; k < width; k += K_TILE) {
                _tile_loadd(0, x + k, width * 2);
                _tile_loadd(2, block + k * BLOCK, BLOCK * 4);
                _tile_loadd(3, block + k * BLOCK + 32, BLOCK * 4);
                _tile_dpbf16ps(4, 0, 2);
                _tile_dpbf16ps(5, 0, 3);
            }
            _tile_stored(4, sums, BLOCK * 4);
            _tile_stored(5, sums + 16, BLOCK * 4);
            store_block(sums, bias ? bias + n : NULL, out + r * s->out_stride + n,
                        s->rows - r < AMX_ROWS ? s->rows - r : AMX_ROWS, s->out_features - n, s);
        }
    }
    amx_release();
}

static int amx_ok;   /* whether this process may run the tiles: asked once, as the module loads */

/* supported(): whether this CPU and process run the kernel (AVX-512 BF16 and AMX). */
static PyObject *supported(PyObject *module, PyObject *noargs)
{
    (void)module;
    (void)noargs;
    return PyBool_FromLong(amx_ok);
}

static PyObject *run(PyObject *module, PyObject *args)
{
    unsigned long long x, packed, bias, out;
    Shape s;
    (void)module;
    if (!PyArg_ParseTuple(args, "KKKKLLLLL", &x, &packed, &bias, &out, &s.rows, &s.in_features, &s.out_features,
                          &s.x_stride, &s.out_stride))
        return NULL;
    if (!amx_ok) {
        PyErr_SetString(PyExc_RuntimeError, "no AMX here: supported() says so");
        return NULL;
    }
    if (s.rows < 0 || s.in_features < 1 || s.out_features < 1 || s.x_stride < s.in_features
        || s.out_stride < s.out_features) {
        PyErr_SetString(PyExc_ValueError, "rows must not be negative, features positive and rows no narrower "
                                          "than their features");
        return NULL;
    }
    const int64_t width = padded_inputs(&s), groups = (s.rows + AMX_ROWS - 1) / AMX_ROWS;
    const size_t bytes = (size_t)(groups * AMX_ROWS * width) * sizeof(uint16_t);
    uint16_t *tiles = aligned_alloc(64, (bytes + 63) / 64 * 64 + 64);
    if (tiles == NULL)
        return PyErr_NoMemory();
    const uint16_t *rows = (const uint16_t *)(uintptr_t)x;
    Py_BEGIN_ALLOW_THREADS
    memset(tiles, 0, bytes);
    for (int64_t r = 0; r < s.rows; r++)
        memcpy(tiles + r * width, rows + r * s.x_stride, sizeof(uint16_t) * s.in_features);
    linear(tiles, (const uint16_t *)(uintptr_t)packed, bias ? (const uint16_t *)(uintptr_t)bias : NULL,
           (uint16_t *)(uintptr_t)out, &s);
    Py_END_ALLOW_THREADS
    free(tiles);
    return Py_NewRef(Py_None);
}

static PyMethodDef methods[] = {
    {"supported", supported, METH_NOARGS, "supported(): whether this CPU and process run the kernel (AMX)."},
    {"run", run, METH_VARARGS,
     "run(x, packed, bias, out, rows, in_features, out_features, x_stride, out_stride): out = x W^T + bias in "
     "bf16, W packed by decode_linear.pack, bias 0 for none."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decode_linear", NULL, 0, methods};

PyMODINIT_FUNC PyInit__decode_linear(void)
{
    amx_ok = amx_usable();
    return PyModule_Create(&module);
}
