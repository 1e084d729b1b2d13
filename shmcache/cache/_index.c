/* shmcache.cache._index: a batch of int keys looked up in the index table in one pass (see
 * index.py, TableView.lookup_ints).
 *
 * numpy's probe of a batch is some twenty calls, and each gather of the table's words walks the
 * batch again: in a cold epoch's table (megabytes, rows at random) each pass misses the CPU's
 * caches once a key (1.5 us a row of a cold Hugging Face epoch, two lookups a batch). This is
 * the same probe in one pass, every key's home row asked for first (the loads overlap). It holds
 * no rule of its own: the home (a key below the capacity at its own position, else Fibonacci
 * hashing), the state bits a READY int key's entry has, the step to the next entry and the bound
 * (the capacity) are the caller's, as index.py gives them. Each entry's state word is loaded on its
 * own with acquire order before its key and location words (the reader's side of NOTE [publish
 * order]); it runs without the GIL, reading shared memory other processes write.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define CACHE_LINE 64

/* 8-byte integers (signed or not), one dimension, C-contiguous and aligned: the keys and outputs */
static int
words_ok(const Py_buffer *b)
{
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return b->itemsize == 8 && b->ndim == 1 && strlen(f) == 1 && strchr("lLqQnN", *f) != NULL
           && (uintptr_t)b->buf % 8 == 0;
}

static PyObject *
lookup_ints(PyObject *module, PyObject *args)
{
    PyObject *table_obj, *keys_obj, *w0_obj, *w2_obj;
    unsigned long long fib, want;
    int shift;
    Py_buffer table, keys, w0, w2;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOKiKOO:lookup_ints", &table_obj, &keys_obj, &fib, &shift, &want, &w0_obj,
                          &w2_obj))
        return NULL;
    if (PyObject_GetBuffer(table_obj, &table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(keys_obj, &keys, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&table);
        return NULL;
    }
    if (PyObject_GetBuffer(w0_obj, &w0, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&keys);
        PyBuffer_Release(&table);
        return NULL;
    }
    if (PyObject_GetBuffer(w2_obj, &w2, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&w0);
        PyBuffer_Release(&keys);
        PyBuffer_Release(&table);
        return NULL;
    }
    const Py_ssize_t n = keys.ndim == 1 ? keys.shape[0] : -1;
    if (table.itemsize != 8 || table.ndim != 2 || table.shape[1] != 3 || (uintptr_t)table.buf % 8
        || !words_ok(&keys) || !words_ok(&w0) || !words_ok(&w2)) {
        PyErr_SetString(PyExc_TypeError, "lookup_ints: an aligned, C-contiguous (capacity, 3) table of 8-byte words, "
                        "and one dimension of 8-byte integers for the keys and both outputs");
        goto done;
    }
    const uint64_t capacity = (uint64_t)table.shape[0];
    if (w0.shape[0] < n || w2.shape[0] < n || shift < 0 || (capacity & (capacity - 1))) {
        PyErr_Format(PyExc_ValueError, "lookup_ints: %zd keys, room for %zd and %zd; shift %d; capacity %llu (a "
                     "power of two)", n, w0.shape[0], w2.shape[0], shift, (unsigned long long)capacity);
        goto done;
    }
    const char *t = (const char *)table.buf;
    const Py_ssize_t tlen = table.len;
    if ((w0.buf < (void *)(t + tlen) && (const char *)w0.buf + n * 8 > t)
        || (w2.buf < (void *)(t + tlen) && (const char *)w2.buf + n * 8 > t)) {
        PyErr_SetString(PyExc_ValueError, "lookup_ints: an output overlaps the table: give it a buffer of its own");
        goto done;
    }
    const uint64_t *words = (const uint64_t *)table.buf, *k = (const uint64_t *)keys.buf;
    uint64_t *out0 = (uint64_t *)w0.buf, *out2 = (uint64_t *)w2.buf;
    const uint64_t mask = capacity ? capacity - 1 : 0;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    if (n && !capacity) {
        ok = 0; /* no entry to probe: a damaged table (index.py names it) */
    } else {
        /* the homes first, each row asked for: a batch's rows lie at random in the table */
        for (Py_ssize_t i = 0; i < n; i++) {
            const uint64_t key = k[i];
            const uint64_t home = key < capacity ? key : (shift >= 64 ? 0 : (key * fib) >> shift);
            __builtin_prefetch(words + 3 * (home & mask), 0, 1);
        }
        for (Py_ssize_t i = 0; i < n && ok; i++) {
            const uint64_t key = k[i];
            uint64_t pos = (key < capacity ? key : (shift >= 64 ? 0 : (key * fib) >> shift)) & mask;
            uint64_t s0 = 0, s2 = 0;
            uint64_t steps = 0;
            for (;; steps++) {
                if (steps >= capacity) { /* no EMPTY entry on the whole way round: damage */
                    ok = 0;
                    break;
                }
                const uint64_t *row = words + 3 * pos;
                const uint64_t s = __atomic_load_n(row, __ATOMIC_ACQUIRE);
                if ((s & want) == want && __atomic_load_n(row + 1, __ATOMIC_RELAXED) == key) {
                    s0 = s;
                    s2 = __atomic_load_n(row + 2, __ATOMIC_RELAXED);
                    break;
                }
                if (s == 0)
                    break;
                pos = (pos + 1) & mask;
            }
            out0[i] = s0;
            out2[i] = s2;
        }
    }
    Py_END_ALLOW_THREADS
    result = ok ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&w2);
    PyBuffer_Release(&w0);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&table);
    return result;
}

static PyMethodDef methods[] = {
    {"lookup_ints", lookup_ints, METH_VARARGS,
     "lookup_ints(table, keys, fib, shift, want, w0, w2): w0[i], w2[i] = the state and location words of the entry "
     "of int key keys[i] (0, 0 where absent); False where a probe met no EMPTY entry (damage)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_index", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__index(void)
{
    return PyModule_Create(&module);
}
