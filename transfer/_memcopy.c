/* transfer._memcopy: one call copies (or checksums) many byte ranges, without the GIL.

   A transfer between two pools mapped in this process is thousands of chunk copies of
   16-32 KiB each; one Python call per chunk costs about as much as the copy itself and
   holds the GIL the engine loop needs. The ranges come as int64 arrays (offsets from the
   base addresses, and lengths) built by transfer.blocks. CRC-32C values in and out are the
   usual ones (as `crc32c.crc32c(data, value)`), so calls chain over planes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_crc32c.h"

/* Chunks of a transfer lie far apart in 4 KiB pages: touching the first pages of the range
   AHEAD places on starts their address translation while this range copies (measured here:
   +20% on sparse block sets, neutral on dense ones). */
#define AHEAD 2
#define PAGE 4096
#define PREFETCH_BYTES (16 * PAGE)

static void prefetch_range(const char *src, char *dst, int64_t len)
{
    for (int64_t at = 0; at < len && at < PREFETCH_BYTES; at += PAGE) {
        __builtin_prefetch(src + at, 0, 0);
        if (dst)
            __builtin_prefetch(dst + at, 1, 0);
    }
}

/* The ranges of one call: `dst_off` is unused (NULL) when nothing is copied. */
struct ranges {
    Py_buffer dst_off, src_off, len;
    Py_ssize_t count;
};

static int check_ranges(struct ranges *r, int copying)
{
    Py_ssize_t n = r->len.len;
    if (r->src_off.len != n || (copying && r->dst_off.len != n) || n % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "offsets and lengths must be int64 buffers of one size");
        return 0;
    }
    r->count = n / (Py_ssize_t)sizeof(int64_t);
    return 1;
}

static void release_ranges(struct ranges *r, int copying)
{
    if (copying)
        PyBuffer_Release(&r->dst_off);
    PyBuffer_Release(&r->src_off);
    PyBuffer_Release(&r->len);
}

/* Landing marks (transfer.landing): a word the copy raises to "bytes of this push in place" as it
   goes, so the receiver can check what landed while the rest is copied. The fence orders the
   bytes (memmove may store them non-temporally) before the mark. */
#define MARK_STEP (256 * 1024)

struct mark {
    int64_t *word;   /* NULL: no mark */
    int64_t base;    /* bytes of the push in place before this call */
};

static void publish(const struct mark *m, int64_t done)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(m->word, m->base + done, __ATOMIC_RELAXED);
}

/* Copies (to non-NULL `to`) and/or sums every range; returns the raw CRC state. */
static uint32_t walk(char *to, const char *from, const struct ranges *r, int summing, uint32_t state,
                     const struct mark *m)
{
    const int64_t *d = r->dst_off.buf, *s = r->src_off.buf, *n = r->len.buf;
    struct crc32c_shift shift = {0, 0};
    int64_t done = 0, told = 0;
    for (Py_ssize_t i = 0; i < r->count; i++) {
        if (i + AHEAD < r->count)
            prefetch_range(from + s[i + AHEAD], to ? to + d[i + AHEAD] : NULL, n[i + AHEAD]);
        if (summing)
            state = crc32c_run(state, from + s[i], (size_t)n[i], to ? to + d[i] : NULL, &shift);
        else
            memmove(to + d[i], from + s[i], (size_t)n[i]);
        done += n[i];
        if (m->word && done - told >= MARK_STEP)
            publish(m, told = done);
    }
    if (m->word)
        publish(m, done);
    return state;
}

static PyObject *copy_ranges(PyObject *module, PyObject *args)
{
    unsigned long long dst, src, word = 0;
    struct ranges r = {0};
    struct mark m = {NULL, 0};
    (void)module;
    if (!PyArg_ParseTuple(args, "KKy*y*y*|KL:copy_ranges", &dst, &src, &r.dst_off, &r.src_off, &r.len,
                          &word, &m.base))
        return NULL;
    m.word = (int64_t *)(uintptr_t)word;
    if (!check_ranges(&r, 1)) {
        release_ranges(&r, 1);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    walk((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, &r, 0, 0, &m);
    Py_END_ALLOW_THREADS
    release_ranges(&r, 1);
    Py_RETURN_NONE;
}

static PyObject *copy_ranges_crc32c(PyObject *module, PyObject *args)
{
    unsigned long long dst, src, word = 0;
    unsigned int crc;
    struct ranges r = {0};
    struct mark m = {NULL, 0};
    (void)module;
    if (!PyArg_ParseTuple(args, "KKy*y*y*I|KL:copy_ranges_crc32c", &dst, &src, &r.dst_off, &r.src_off, &r.len,
                          &crc, &word, &m.base))
        return NULL;
    m.word = (int64_t *)(uintptr_t)word;
    if (!check_ranges(&r, 1)) {
        release_ranges(&r, 1);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    crc = ~walk((char *)(uintptr_t)dst, (const char *)(uintptr_t)src, &r, 1, ~crc, &m);
    Py_END_ALLOW_THREADS
    release_ranges(&r, 1);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *crc32c_ranges(PyObject *module, PyObject *args)
{
    unsigned long long base;
    unsigned int crc;
    struct ranges r = {0};
    struct mark none = {NULL, 0};
    (void)module;
    if (!PyArg_ParseTuple(args, "Ky*y*I:crc32c_ranges", &base, &r.src_off, &r.len, &crc))
        return NULL;
    if (!check_ranges(&r, 0)) {
        release_ranges(&r, 0);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    crc = ~walk(NULL, (const char *)(uintptr_t)base, &r, 1, ~crc, &none);
    Py_END_ALLOW_THREADS
    release_ranges(&r, 0);
    return PyLong_FromUnsignedLong(crc);
}

static PyObject *crc32c_path_(PyObject *module, PyObject *args)
{
    int choice = -1;
    (void)module;
    if (!PyArg_ParseTuple(args, "|i:crc32c_path", &choice))
        return NULL;
    return PyLong_FromLong(crc32c_path(choice));
}

/* Handoff fences (transfer.fences): one int64 word per destination block, shared with the writer
   when the pool is in shared memory. A word is 0 (closed) or generation << 2 | state, state OPEN
   (the owner holds the block for that handoff), BUSY (a writer of that handoff is writing) or
   REVOKED (the owner closed the handoff while a writer was writing: quarantined until it lets go).
   Every change is a compare-and-swap, so a writer and the owner never both win a block. */
enum { CLOSED = 0, OPEN = 1, BUSY = 2, REVOKED = 3 };

static int ids_arg(Py_buffer *ids, Py_ssize_t *count)
{
    if (ids->len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "block ids must be an int64 buffer");
        return 0;
    }
    *count = ids->len / (Py_ssize_t)sizeof(int64_t);
    return 1;
}

static int cas(int64_t *word, int64_t expected, int64_t desired)
{
    return __atomic_compare_exchange_n(word, &expected, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

/* One pass over the ids: op 0 open, 1 acquire, 2 release, 3 close, 4 count held (BUSY or REVOKED),
   5 reclaim (the writer died holding them: closed now).
   acquire returns 1 when every block was OPEN for the generation (all BUSY now), else 0 and takes none;
   release returns how many blocks were REVOKED meanwhile (closed now); close returns how many stay
   quarantined (a writer holds them); open returns 0. */
static int64_t fence_walk(int64_t *words, const int64_t *ids, Py_ssize_t n, int64_t gen, int op)
{
    int64_t open = gen << 2 | OPEN, busy = gen << 2 | BUSY, revoked = gen << 2 | REVOKED, out = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t *w = words + ids[i];
        switch (op) {
        case 0: __atomic_store_n(w, open, __ATOMIC_RELEASE); break;
        case 1:
            if (!cas(w, open, busy)) {
                for (Py_ssize_t j = 0; j < i; j++)   /* let go of those taken: the owner may have revoked them */
                    if (!cas(words + ids[j], busy, open))
                        cas(words + ids[j], revoked, CLOSED);
                return 0;
            }
            break;
        case 2:
            if (!cas(w, busy, open) && cas(w, revoked, CLOSED))
                out++;
            break;
        case 3:
            if (!cas(w, open, CLOSED) && (cas(w, busy, revoked) || __atomic_load_n(w, __ATOMIC_ACQUIRE) == revoked))
                out++;
            break;
        case 5:
            if (!cas(w, busy, CLOSED))
                cas(w, revoked, CLOSED);
            break;
        default: {
            int64_t v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
            out += v == busy || v == revoked;
        }
        }
    }
    return op == 1 ? 1 : out;
}

static PyObject *fence(PyObject *module, PyObject *args)
{
    unsigned long long words;
    long long gen;
    int op;
    Py_buffer ids = {0};
    Py_ssize_t n;
    int64_t out;
    (void)module;
    if (!PyArg_ParseTuple(args, "Ky*Li:fence", &words, &ids, &gen, &op))
        return NULL;
    if (!ids_arg(&ids, &n) || op < 0 || op > 5 || gen <= 0 || gen >= ((long long)1 << 61)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "fence: op in 0..5, generation in [1, 2**61)");
        PyBuffer_Release(&ids);
        return NULL;
    }
    out = fence_walk((int64_t *)(uintptr_t)words, (const int64_t *)ids.buf, n, gen, op);
    PyBuffer_Release(&ids);
    return PyLong_FromLongLong(out);
}

static PyObject *mark(PyObject *module, PyObject *args)
{
    unsigned long long word;
    long long value = -1;
    struct mark m;
    (void)module;
    if (!PyArg_ParseTuple(args, "K|L:mark", &word, &value))
        return NULL;
    m.word = (int64_t *)(uintptr_t)word;
    m.base = 0;
    if (value >= 0)
        publish(&m, value);
    return PyLong_FromLongLong(__atomic_load_n(m.word, __ATOMIC_ACQUIRE));
}

static PyMethodDef methods[] = {
    {"fence", fence, METH_VARARGS,
     "fence(words, ids, generation, op) -> int: one atomic pass of op (0 open, 1 acquire, 2 release, "
     "3 close, 4 held, 5 reclaim) over the int64 words at `words` indexed by the int64 block ids."},
    {"mark", mark, METH_VARARGS,
     "mark(word, value=-1) -> int: stores `value` (if >= 0) into the int64 landing mark at `word` after "
     "every store before it, then returns the mark (an acquire load)."},
    {"copy_ranges", copy_ranges, METH_VARARGS,
     "copy_ranges(dst, src, dst_offsets, src_offsets, lengths, mark=0, mark_base=0): memmove each range, "
     "GIL released; with a mark address, raises it to mark_base + bytes copied as the copy goes."},
    {"copy_ranges_crc32c", copy_ranges_crc32c, METH_VARARGS,
     "copy_ranges_crc32c(dst, src, dst_offsets, src_offsets, lengths, crc, mark=0, mark_base=0) -> crc: "
     "copies each range (non-overlapping) and extends the CRC-32C `crc` by its bytes in the same pass, "
     "GIL released; the mark as for copy_ranges."},
    {"crc32c_ranges", crc32c_ranges, METH_VARARGS,
     "crc32c_ranges(base, offsets, lengths, crc) -> crc: extends the CRC-32C `crc` by each range, GIL released."},
    {"crc32c_path", crc32c_path_, METH_VARARGS,
     "crc32c_path(choice=-1) -> int: switches the CRC-32C to `choice` (0 table, 1 sse4.2, 2 vpclmulqdq; "
     "-1 keeps it) and returns the one in use, or -1 when this CPU cannot run `choice`."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_memcopy", NULL, 0, methods};

PyMODINIT_FUNC PyInit__memcopy(void)
{
    crc32c_init();
    return PyModule_Create(&module);
}
