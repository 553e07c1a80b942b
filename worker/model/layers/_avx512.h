/* What the AVX-512 kernels of worker.model.layers share: their target attributes, the lanes of a partial vector,
   bf16 loads and stores, and whether this CPU runs them in a dtype. Included after Python.h. */
#ifndef NEURON_DI_AVX512_H
#define NEURON_DI_AVX512_H

#include <Python.h>
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TARGET_F32 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

/* Lanes 0 .. left - 1 of a vector of 16 (all of them when left >= 16). */
static inline __mmask16 lanes(int64_t left)
{
    return left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
}

/* 16 bf16 values as fp32: each one's bits in the upper half of its lane. */
TARGET_BF16 static inline __m512 widen_bf16(__m256i v)
{
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* The lanes `m` of 16 bf16 at p as fp32 (0 in the others; memory past them is not read). */
TARGET_BF16 static inline __m512 load_bf16(const void *p, __mmask16 m)
{
    return widen_bf16(_mm256_maskz_loadu_epi16(m, p));
}

/* v rounded to bf16 (to nearest even) into the lanes `m` of 16 at p. */
TARGET_BF16 static inline void store_bf16(void *p, __mmask16 m, __m512 v)
{
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

/* Whether this CPU runs the kernels in dtype "float32" (AVX-512F, BW, VL, DQ) or "bfloat16" (those and AVX-512
   BF16): 1 or 0; -1 for any other name. */
static inline int avx512_runs(const char *dtype)
{
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                       && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (strcmp(dtype, "float32") == 0)
        return avx512;
    if (strcmp(dtype, "bfloat16") == 0)
        return avx512 && __builtin_cpu_supports("avx512bf16");
    return -1;
}

/* supported(dtype) of a kernel module: avx512_runs as a bool; ValueError naming `what` for any other dtype. */
static inline PyObject *avx512_supported(PyObject *dtype, const char *what)
{
    const char *name = PyUnicode_AsUTF8(dtype);
    if (name == NULL)
        return NULL;
    const int runs = avx512_runs(name);
    if (runs >= 0)
        return PyBool_FromLong(runs);
    PyErr_Format(PyExc_ValueError, "no native %s in %s: bfloat16 or float32", what, name);
    return NULL;
}

#endif
