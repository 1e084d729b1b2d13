/* shmcache.base._rowcopy: copy rows out of a strided source in one pass (see rowcopy.py).
 *
 * numpy has no gather from a strided source into a given buffer: np.take copies a source that is
 * not C-contiguous whole first, and a fancy index makes a temporary that a second copy then moves
 * into the destination. gather() is the one loop numpy lacks, a memcpy per row (the next row asked
 * for ahead: see PREFETCH_MIN), nothing else: it knows no cache format. Every row is checked
 * against the source's bounds before anything is copied (a bad index raises and writes nothing),
 * and the copy runs without the GIL (a pin-memory thread gathers next to the main thread). The
 * exported buffers stay held for the whole call: an mmap passed as the source cannot be closed
 * while it is read (BufferError); an array over one does not pin it, which is why shm.Segment never
 * unmaps. A destination that overlaps the source or the indices is refused: memcpy of overlapping
 * bytes is undefined, and numpy reads every row first.
 *
 * match() is the other loop a warm batch spends numpy calls on: it compares each key's three
 * words of a table with what the caller expects, fused into one pass (cache.gather.planned_chunks
 * says what is expected and why; this file only compares words). The first word of each row is
 * loaded on its own with acquire order, before the other two and before any later read of the
 * data it guards (the reader's side of NOTE [publish order]).
 *
 * write_all() is the writer's side: a run's records pwritten from their buffers (shm.Segment.write_at).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <sys/uio.h>
#include <unistd.h>

/* gather's software prefetch: the next row's first PREFETCH_BYTES, for rows of PREFETCH_MIN bytes
 * or more (measured on x86-64, benchmarks/bench_batch.py; a line size smaller than the CPU's only
 * asks twice for a line) */
#define CACHE_LINE 64
#define PREFETCH_MIN 256
#define PREFETCH_BYTES 1024

static int
index_format_ok(const Py_buffer *rows)
{
    /* 8-byte signed integers: numpy's intp and int64 on the 64-bit hosts shmcache runs on */
    const char *f = rows->format ? rows->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    return rows->itemsize == 8 && (strcmp(f, "l") == 0 || strcmp(f, "q") == 0 || strcmp(f, "n") == 0);
}

/* one index, read whatever its alignment (a view of a byte buffer may start anywhere) */
static inline Py_ssize_t
row_at(const char *at)
{
    Py_ssize_t r;
    memcpy(&r, at, sizeof r);
    return r;
}

/* whether [a, a + na) and [b, b + nb) share a byte */
static int
overlap(const char *a, Py_ssize_t na, const char *b, Py_ssize_t nb)
{
    return na > 0 && nb > 0 && (uintptr_t)a < (uintptr_t)b + (size_t)nb && (uintptr_t)b < (uintptr_t)a + (size_t)na;
}

static PyObject *
gather(PyObject *module, PyObject *args)
{
    PyObject *src_obj, *rows_obj, *dst_obj;
    Py_ssize_t offset, stride, nbytes;
    Py_buffer src, rows, dst;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OnnnOO:gather", &src_obj, &offset, &stride, &nbytes, &rows_obj, &dst_obj))
        return NULL;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_SIMPLE) < 0)
        return NULL;
    /* strided: the chunk column of the gather plan's (n, 3) words is read in place */
    if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&src);
        return NULL;
    }
    if (!index_format_ok(&rows) || rows.ndim != 1) {
        PyErr_Format(PyExc_TypeError, "gather: row indices must be one dimension of 8-byte integers (intp), "
                     "not %d of format '%s'", rows.ndim, rows.format ? rows.format : "B");
        goto done;
    }
    const Py_ssize_t n = rows.shape[0], step = rows.strides[0];
    if (offset < 0 || stride <= 0 || nbytes < 0 || offset > src.len || nbytes > src.len - offset) {
        PyErr_Format(PyExc_ValueError, "gather: offset %zd, stride %zd and row of %zd bytes do not fit a source "
                     "of %zd bytes", offset, stride, nbytes, src.len);
        goto done;
    }
    if (nbytes && n > dst.len / nbytes) {
        PyErr_Format(PyExc_ValueError, "gather: %zd rows of %zd bytes do not fit a destination of %zd bytes",
                     n, nbytes, dst.len);
        goto done;
    }
    /* the indices' bytes: from the lowest to the highest index (a negative step walks backwards) */
    const char *first = (const char *)rows.buf, *end = first + (n ? (n - 1) * step : 0);
    const char *lo = first < end ? first : end;
    const Py_ssize_t span = n ? (first < end ? end - first : first - end) + 8 : 0;
    if (overlap((const char *)dst.buf, n * nbytes, (const char *)src.buf, src.len)
        || overlap((const char *)dst.buf, n * nbytes, lo, span)) {
        PyErr_SetString(PyExc_ValueError, "gather: the destination overlaps the source or the row indices: "
                        "gather into a buffer of its own");
        goto done;
    }
    /* the last row whose bytes end inside the source: offset + r * stride + nbytes <= len */
    const Py_ssize_t last = (src.len - offset - nbytes) / stride;
#define ROW(i) row_at((const char *)rows.buf + (i) * step)
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ROW(i) < 0 || ROW(i) > last) {
            PyErr_Format(PyExc_IndexError, "gather: row %zd (at %zd) is outside the source's %zd rows",
                         ROW(i), i, last + 1);
            goto done;
        }
    }
    const char *from = (const char *)src.buf + offset;
    char *to = (char *)dst.buf;
    /* the first bytes of the next row asked for while this one is copied: random rows in memory
     * the CPU caches do not hold start with a stall the hardware's prefetchers cannot foresee
     * (they follow a stream within a page). A row of PREFETCH_MIN bytes or more takes long enough
     * to copy to hide it (3 KB rows: ~20% faster per batch); a smaller one is not worth an
     * instruction (the CPU overlaps such copies by itself). */
    const Py_ssize_t ahead = nbytes >= PREFETCH_MIN ? (nbytes < PREFETCH_BYTES ? nbytes : PREFETCH_BYTES) : 0;
    Py_ssize_t moved = -1;  /* a row that changed past the bounds since the check: another thread's */
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t r = ROW(i);
        if (r < 0 || r > last) {
            moved = i;
            break;
        }
        if (ahead && i + 1 < n) {
            const Py_ssize_t q = ROW(i + 1);
            if (q >= 0 && q <= last)  /* a hint only (it never faults), but never outside the source */
                for (Py_ssize_t b = 0; b < ahead; b += CACHE_LINE)
                    __builtin_prefetch(from + q * stride + b, 0, 3);
        }
        memcpy(to + i * nbytes, from + r * stride, (size_t)nbytes);
    }
    Py_END_ALLOW_THREADS
#undef ROW
    if (moved >= 0) {
        PyErr_Format(PyExc_RuntimeError, "gather: the row index at %zd changed during the copy", moved);
        goto done;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&src);
    return result;
}

/* 8-byte integers, as index_format_ok; unsigned too (the table's words) */
static int
word_format_ok(const Py_buffer *b, int is_unsigned)
{
    const char *f = b->format ? b->format : "B";
    if (*f == '@' || *f == '=' || *f == '<')
        f++;
    if (b->itemsize != 8)
        return 0;
    return is_unsigned ? (strcmp(f, "L") == 0 || strcmp(f, "Q") == 0 || strcmp(f, "N") == 0) : index_format_ok(b);
}

static PyObject *
match(PyObject *module, PyObject *args)
{
    PyObject *words_obj, *keys_obj, *chunks_obj;
    unsigned long long first, base, limit;
    Py_buffer words, keys, chunks;
    PyObject *result = NULL;

    if (!PyArg_ParseTuple(args, "OOKKKO:match", &words_obj, &keys_obj, &first, &base, &limit, &chunks_obj))
        return NULL;
    if (PyObject_GetBuffer(words_obj, &words, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(keys_obj, &keys, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&words);
        return NULL;
    }
    if (PyObject_GetBuffer(chunks_obj, &chunks, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&keys);
        PyBuffer_Release(&words);
        return NULL;
    }
    if (!word_format_ok(&words, 1) || words.ndim != 2 || words.shape[1] != 3 || (uintptr_t)words.buf % 8) {
        PyErr_SetString(PyExc_TypeError, "match: words must be an aligned, C-contiguous (rows, 3) array of uint64");
        goto done;
    }
    if (!index_format_ok(&keys) || keys.ndim != 1 || !index_format_ok(&chunks) || chunks.ndim != 1) {
        PyErr_SetString(PyExc_TypeError, "match: keys and chunks must be one dimension of 8-byte integers");
        goto done;
    }
    const Py_ssize_t n = keys.shape[0], step = keys.strides[0], capacity = words.shape[0];
    if (chunks.shape[0] < n) {
        PyErr_Format(PyExc_ValueError, "match: %zd keys, room for %zd chunks", n, chunks.shape[0]);
        goto done;
    }
    if (overlap((const char *)chunks.buf, n * 8, (const char *)words.buf, words.len)) {
        PyErr_SetString(PyExc_ValueError, "match: chunks overlaps the words: give it a buffer of its own");
        goto done;
    }
    const uint64_t *w = (const uint64_t *)words.buf;
    const char *k_at = (const char *)keys.buf;
    char *to = (char *)chunks.buf;
    int ok = 1;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        const Py_ssize_t k = row_at(k_at + i * step);
        if (k < 0 || k >= capacity) {
            ok = 0;
            break;
        }
        const uint64_t *row = w + 3 * k;
        if (__atomic_load_n(row, __ATOMIC_ACQUIRE) != first
            || __atomic_load_n(row + 1, __ATOMIC_RELAXED) != (uint64_t)k) {
            ok = 0;
            break;
        }
        /* below base, the difference wraps around to a huge number: refused with the rest */
        const uint64_t c = __atomic_load_n(row + 2, __ATOMIC_RELAXED) - base;
        if (c >= limit) {
            ok = 0;
            break;
        }
        const Py_ssize_t chunk = (Py_ssize_t)c;
        memcpy(to + i * 8, &chunk, sizeof chunk);
    }
    Py_END_ALLOW_THREADS
    result = ok ? Py_True : Py_False;
    Py_INCREF(result);
done:
    PyBuffer_Release(&chunks);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&words);
    return result;
}

/* write_all(fd, offset, buffers, end): pwritev of ``buffers`` (contiguous, one after the other)
 * at ``offset``, all of them: a short write (a signal) or more buffers than IOV_MAX go on where the
 * last call stopped. The bytes are counted as the buffers are taken, before anything is written:
 * ValueError, nothing written, when they would end past ``end`` (a pwritev past a segment's end
 * grows the object). The calls run without the GIL. Returns the number of bytes written. What
 * shm.Segment.write_at does in Python, where taking each buffer twice (a memoryview to count it,
 * then os.pwritev's own) cost about 1 us a record of a run's eight buffers. */
static PyObject *
write_all(PyObject *module, PyObject *args)
{
    int fd;
    long long offset, end;
    PyObject *seq;
    if (!PyArg_ParseTuple(args, "iLOL:write_all", &fd, &offset, &seq, &end))
        return NULL;
    PyObject *fast = PySequence_Fast(seq, "write_all: buffers must be a sequence");
    if (fast == NULL)
        return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    struct iovec *iov = PyMem_Calloc(n ? (size_t)n : 1, sizeof *iov);
    Py_ssize_t taken = 0, count = 0;
    long long total = 0;
    PyObject *result = NULL;
    if (views == NULL || iov == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; taken < n; taken++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, taken), &views[taken], PyBUF_SIMPLE) < 0)
            goto done;
        if (views[taken].len) {
            iov[count].iov_base = views[taken].buf;
            iov[count++].iov_len = (size_t)views[taken].len;
            total += views[taken].len;
        }
    }
    /* end < offset first: end - offset must not overflow (an end of -2**63 would come out a room
     * of nearly 2**64 bytes); the message's last byte in unsigned arithmetic for the same reason */
    if (offset < 0 || end < offset || total > end - offset) {
        PyErr_Format(PyExc_ValueError, "write_all: bytes %lld..%llu end past %lld (a pwritev past a segment's end "
                     "grows it): write fewer bytes or at a lower offset", offset,
                     (unsigned long long)offset + (unsigned long long)total, end);
        goto done;
    }
    static long iov_max;
    if (!iov_max) {
        long m = sysconf(_SC_IOV_MAX);
        iov_max = m > 0 && m < 1024 ? m : 1024;
    }
    Py_ssize_t i = 0;
    long long at = offset;
    while (i < count) {
        const int m = (int)(count - i < iov_max ? count - i : iov_max);
        ssize_t w;
        Py_BEGIN_ALLOW_THREADS
        w = pwritev(fd, iov + i, m, (off_t)at);
        Py_END_ALLOW_THREADS
        if (w < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0)  /* a handler that raised (Ctrl-C): as os.pwritev */
                    goto done;
                continue;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        if (w == 0) { /* bounded: a call that copies nothing would loop for ever */
            errno = EIO;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        at += w;
        while (w > 0 && i < count) {
            if ((size_t)w >= iov[i].iov_len) {
                w -= (ssize_t)iov[i++].iov_len;
            } else {
                iov[i].iov_base = (char *)iov[i].iov_base + w;
                iov[i].iov_len -= (size_t)w;
                w = 0;
            }
        }
    }
    result = PyLong_FromLongLong(total);
done:
    for (Py_ssize_t j = 0; j < taken; j++)
        PyBuffer_Release(&views[j]);
    PyMem_Free(views);
    PyMem_Free(iov);
    Py_DECREF(fast);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(src, offset, stride, nbytes, rows, dst): dst's row i = src[offset + rows[i] * stride:][:nbytes]."},
    {"match", match, METH_VARARGS,
     "match(words, keys, first, base, limit, chunks): True if each row keys[i] of words is (first, keys[i], "
     "base + c) with c < limit (chunks[i] = c); False at the first that is not."},
    {"write_all", write_all, METH_VARARGS,
     "write_all(fd, offset, buffers, end): pwritev of all of buffers at offset (ValueError, nothing written, "
     "where they would end past end); the bytes written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rowcopy", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__rowcopy(void)
{
    return PyModule_Create(&module);
}
