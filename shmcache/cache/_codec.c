/* shmcache.cache._codec: a flat value packed into a shape's layout, compiled (see codec.py, "The
 * compiled pack").
 *
 * codec.encode_many walks a batch's first value of each shape with encode and packs the others
 * into the same layout (_encode_like): the same checks a leaf at a time, the same Encoded. In
 * Python that was most of a cold batch's encode (about 4 us a row of a Hugging Face sample: three
 * leaves). pack() makes the same checks in the same order and builds the same Encoded, for every
 * leaf a flat shape holds: int, float, bool, None, str, bytes, numpy arrays and scalars, and
 * registered types (a tensor: its handler is called, as in Python). It holds no rule of its own:
 * codec builds the spec from the shape (codec._native_spec), and a value this file is not sure of
 * it gives back to Python:
 *   - None: the value is not of this shape (a key, a type, a dtype, a shape or a length differs);
 *   - NotImplemented: it is, but an array cannot be viewed as C-contiguous bytes here (strided,
 *     empty, or a dtype without a buffer): codec._encode_like converts it.
 * Every leaf is checked before any is converted, as in Python. No user code runs during the checks:
 * the types are exact (a dict, its str and int keys, the leaves); the leaves are held (a reference
 * each) for the handlers, which may run any code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the record format's numbers are little-endian: on this host codec packs them in Python"
#endif

/* the spec's items (codec._native_spec) */
enum { S_KEYS, S_KEY_TYPES, S_KINDS, S_WANTS, S_LAYOUT, S_BODY_LEN, S_OFFSETS, S_ENCODED, S_NDARRAY, S_EXT_TO,
       S_MEMMAP, S_ITEMS };
#define MAX_LEAVES 64 /* codec gives no spec to a wider shape */

static PyObject *s_layout, *s_body_len, *s_scalars, *s_pieces, *s_pickled, *s_dtype, *s_shape, *s_cast, *s_B,
    *s_tobytes;
static PyObject *empty_tuple;

/* 1 if a == b (identity first: numpy's builtin dtypes are one object each), 0 if not, -1 error */
static int
same(PyObject *a, PyObject *b)
{
    return a == b ? 1 : PyObject_RichCompareBool(a, b, Py_EQ);
}

/* 1 if attribute ``name`` of ``x`` equals ``want``, 0 if not, -1 error */
static int
attr_is(PyObject *x, PyObject *name, PyObject *want)
{
    PyObject *got = PyObject_GetAttr(x, name);
    if (got == NULL)
        return -1;
    int eq = same(got, want);
    Py_DECREF(got);
    return eq;
}

/* ``arr`` (a C-contiguous, non-empty ndarray) as a 1-D byte memoryview; NULL with no error set
 * where it cannot be one (Python converts it), NULL with an error set on failure */
static PyObject *
byte_view(PyObject *arr)
{
    PyObject *mv = PyMemoryView_FromObject(arr);
    if (mv == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_MemoryError))
            PyErr_Clear(); /* a dtype with no buffer (datetime64, ...) */
        return NULL;
    }
    const Py_buffer *b = PyMemoryView_GET_BUFFER(mv);
    if (b->len == 0 || !PyBuffer_IsContiguous(b, 'C')) {
        Py_DECREF(mv);
        return NULL;
    }
    PyObject *bytes = PyObject_CallMethodOneArg(mv, s_cast, s_B);
    Py_DECREF(mv);
    if (bytes == NULL && !PyErr_ExceptionMatches(PyExc_MemoryError))
        PyErr_Clear(); /* a format memoryview does not cast */
    return bytes;
}

/* the bytes of a later leaf ``x`` of kind ``k`` other than an array (pack views those first),
 * checked against ``want``, into *data: 1, 0 where a handler's parts differ from the shape's (not
 * this shape), -1 on error. A numpy scalar's bytes as tobytes() gives them (the builder's 0-d
 * array holds the same); a registered type's buffer as its handler gives it (the handler runs, as
 * in Python). */
static int
convert(char k, PyObject *x, PyObject *want, PyObject **data)
{
    *data = NULL;
    if (k == 'g') {
        *data = PyObject_CallMethodNoArgs(x, s_tobytes);
        return *data == NULL ? -1 : 1;
    }
    PyObject *ext = PyTuple_GET_ITEM(want, 4); /* register_type's (tag, to_parts) */
    if (!PyTuple_Check(ext) || PyTuple_GET_SIZE(ext) < 2) {
        PyErr_SetString(PyExc_TypeError, "pack: a registered type's entry is not register_type's (tag, to_parts)");
        return -1;
    }
    PyObject *parts = PyObject_CallOneArg(PyTuple_GET_ITEM(ext, 1), x);
    if (parts == NULL)
        return -1;
    PyObject *tag = NULL, *dims = NULL, *dims_t = NULL, *buf = NULL, *mv = NULL;
    int got = 0;
    if (parts == Py_None)
        goto out;
    if ((tag = PySequence_GetItem(parts, 0)) == NULL || (dims = PySequence_GetItem(parts, 1)) == NULL
        || (buf = PySequence_GetItem(parts, 2)) == NULL || (dims_t = PySequence_Tuple(dims)) == NULL
        || (mv = PyMemoryView_FromObject(buf)) == NULL) {
        got = -1;
        goto out;
    }
    int eq = same(tag, PyTuple_GET_ITEM(want, 1));
    if (eq > 0)
        eq = same(dims_t, PyTuple_GET_ITEM(want, 2));
    if (eq < 0) {
        got = -1;
        goto out;
    }
    const Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(want, 3));
    if (nbytes == -1 && PyErr_Occurred()) {
        got = -1;
        goto out;
    }
    if (eq && PyMemoryView_GET_BUFFER(mv)->len == nbytes) {
        *data = Py_NewRef(buf);
        got = 1;
    }
out:
    Py_XDECREF(mv);
    Py_XDECREF(buf);
    Py_XDECREF(dims_t);
    Py_XDECREF(dims);
    Py_XDECREF(tag);
    Py_DECREF(parts);
    return got;
}

static PyObject *
pack(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_CheckExact(args[1]) || PyTuple_GET_SIZE(args[1]) != S_ITEMS) {
        PyErr_SetString(PyExc_TypeError, "pack(value, spec): spec is codec._native_spec's tuple");
        return NULL;
    }
    PyObject *value = args[0], *spec = args[1];
    PyObject *keys = PyTuple_GET_ITEM(spec, S_KEYS), *key_types = PyTuple_GET_ITEM(spec, S_KEY_TYPES);
    PyObject *kinds_obj = PyTuple_GET_ITEM(spec, S_KINDS), *wants = PyTuple_GET_ITEM(spec, S_WANTS);
    PyObject *ndarray = PyTuple_GET_ITEM(spec, S_NDARRAY), *ext_to = PyTuple_GET_ITEM(spec, S_EXT_TO);
    PyObject *memmap = PyTuple_GET_ITEM(spec, S_MEMMAP); /* np.memmap: an ndarray of a file's bytes */
    if (!PyBytes_CheckExact(kinds_obj) || !PyTuple_CheckExact(wants) || !PyType_Check(ndarray) || !PyDict_Check(ext_to)
        || !PyType_Check(memmap) || !PyType_Check(PyTuple_GET_ITEM(spec, S_ENCODED))) {
        PyErr_SetString(PyExc_TypeError, "pack: a spec of the wrong types");
        return NULL;
    }
    const char *kind = PyBytes_AS_STRING(kinds_obj);
    const Py_ssize_t n = PyBytes_GET_SIZE(kinds_obj);
    if (n > MAX_LEAVES || PyTuple_GET_SIZE(wants) != n
        || (keys != Py_None && (!PyTuple_CheckExact(keys) || !PyTuple_CheckExact(key_types)
                                || PyTuple_GET_SIZE(keys) != n || PyTuple_GET_SIZE(key_types) != n))
        || (keys == Py_None && n != 1)) {
        PyErr_SetString(PyExc_TypeError, "pack: a spec whose parts disagree");
        return NULL;
    }

    PyObject *leaves[MAX_LEAVES];
    PyObject *var[MAX_LEAVES]; /* str and bytes leaves' bytes (new references) */
    Py_ssize_t later[MAX_LEAVES]; /* the leaves converted once all matched (codec._LATER), in order */
    PyObject *views[MAX_LEAVES] = {NULL}; /* the byte views of the arrays among them (new references) */
    long long numbers[MAX_LEAVES];
    Py_ssize_t nleaves = 0, nvar = 0, nlater = 0, nnumbers = 0;
    PyObject *result = Py_None, *scalars = NULL, *pieces = NULL, *enc = NULL;

    if (keys == Py_None) {
        leaves[nleaves++] = Py_NewRef(value);
    } else {
        if (!PyDict_CheckExact(value) || PyDict_GET_SIZE(value) != n)
            return Py_NewRef(Py_None);
        Py_ssize_t pos = 0;
        PyObject *k, *v;
        while (nleaves < n && PyDict_Next(value, &pos, &k, &v)) {
            /* the key's type first: then it is a str or an int, whose == runs no code of anyone's */
            PyObject *want = PyTuple_GET_ITEM(keys, nleaves);
            if ((PyObject *)Py_TYPE(k) != PyTuple_GET_ITEM(key_types, nleaves))
                goto done;
            int eq = same(k, want);
            if (eq < 0)
                goto fail;
            if (!eq)
                goto done;
            leaves[nleaves++] = Py_NewRef(v);
        }
        if (nleaves != n)
            goto done;
    }

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *x = leaves[i], *want = PyTuple_GET_ITEM(wants, i);
        switch (kind[i]) {
        case 'a': { /* an ndarray of the shape's dtype and shape: (dtype, shape) */
            if ((Py_TYPE(x) != (PyTypeObject *)ndarray && Py_TYPE(x) != (PyTypeObject *)memmap)
                || !PyTuple_CheckExact(want) || PyTuple_GET_SIZE(want) != 2)
                goto done;
            int eq = attr_is(x, s_dtype, PyTuple_GET_ITEM(want, 0));
            if (eq > 0)
                eq = attr_is(x, s_shape, PyTuple_GET_ITEM(want, 1));
            if (eq < 0)
                goto fail;
            if (!eq)
                goto done;
            later[nlater++] = i;
            break;
        }
        case 'g': /* a numpy scalar of the shape's type and dtype: (type, dtype) */
        case 'e': { /* a registered type, by the same handler: (type, tag, dims, nbytes, handler) */
            if (!PyTuple_CheckExact(want) || PyTuple_GET_SIZE(want) != (kind[i] == 'g' ? 2 : 5)
                || (PyObject *)Py_TYPE(x) != PyTuple_GET_ITEM(want, 0))
                goto done;
            if (kind[i] == 'g') {
                int eq = attr_is(x, s_dtype, PyTuple_GET_ITEM(want, 1));
                if (eq < 0)
                    goto fail;
                if (!eq)
                    goto done;
            } else {
                PyObject *ext = PyDict_GetItemWithError(ext_to, (PyObject *)Py_TYPE(x)); /* borrowed */
                if (ext == NULL && PyErr_Occurred())
                    goto fail;
                if (ext != PyTuple_GET_ITEM(want, 4))
                    goto done;
            }
            later[nlater++] = i;
            break;
        }
        case 'i': {
            if (!PyLong_CheckExact(x))
                goto done;
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
            if (overflow)
                goto done;
            if (v == -1 && PyErr_Occurred())
                goto fail;
            numbers[nnumbers++] = v;
            break;
        }
        case 'f': {
            if (!PyFloat_CheckExact(x))
                goto done;
            double d = PyFloat_AS_DOUBLE(x);
            memcpy(&numbers[nnumbers++], &d, sizeof d);
            break;
        }
        case 'b':
            if (!PyBool_Check(x))
                goto done;
            numbers[nnumbers++] = x == Py_True;
            break;
        case 'n':
            if (x != Py_None)
                goto done;
            break;
        case 's': {
            if (!PyUnicode_CheckExact(x))
                goto done;
            PyObject *b = PyUnicode_AsEncodedString(x, "utf-8", "surrogatepass");
            if (b == NULL)
                goto fail;
            var[nvar++] = b;
            if (PyBytes_GET_SIZE(b) != PyLong_AsSsize_t(want)) {
                if (PyErr_Occurred())
                    goto fail;
                goto done;
            }
            break;
        }
        case 'y':
            if (!PyBytes_CheckExact(x) || PyBytes_GET_SIZE(x) != PyLong_AsSsize_t(want)) {
                if (PyErr_Occurred())
                    goto fail;
                goto done;
            }
            var[nvar++] = Py_NewRef(x);
            break;
        default:
            PyErr_Format(PyExc_TypeError, "pack: a leaf kind %c this file does not pack", kind[i]);
            goto fail;
        }
    }

    /* every leaf matched: the later leaves' bytes, then the Encoded _encode_like builds */
    PyObject *offsets = PyTuple_GET_ITEM(spec, S_OFFSETS);
    if (!PyTuple_CheckExact(offsets) || PyTuple_GET_SIZE(offsets) != nvar + nlater) {
        PyErr_SetString(PyExc_TypeError, "pack: the spec's offsets do not match its leaves");
        goto fail;
    }
    /* the arrays' byte views first (numpy's buffer, no user code): an array Python must convert is
     * known before any handler runs, as Python then converts every later leaf again (a handler
     * would run twice for one value) */
    for (Py_ssize_t j = 0; j < nlater; j++) {
        if (kind[later[j]] != 'a')
            continue;
        if ((views[j] = byte_view(leaves[later[j]])) == NULL) {
            if (PyErr_Occurred())
                goto fail;
            result = Py_NotImplemented;
            goto done;
        }
    }
    pieces = PyList_New(nvar + nlater);
    if (pieces == NULL)
        goto fail;
    for (Py_ssize_t j = 0; j < nvar + nlater; j++) {
        PyObject *data;
        if (j < nvar) {
            data = Py_NewRef(var[j]);
        } else if (views[j - nvar] != NULL) {
            data = views[j - nvar]; /* taken */
            views[j - nvar] = NULL;
        } else {
            const Py_ssize_t i = later[j - nvar];
            const int got = convert(kind[i], leaves[i], PyTuple_GET_ITEM(wants, i), &data);
            if (got < 0)
                goto fail;
            if (got == 0)
                goto done; /* a handler that gave other parts: not this shape */
        }
        PyObject *pair = PyTuple_Pack(2, PyTuple_GET_ITEM(offsets, j), data);
        Py_DECREF(data);
        if (pair == NULL)
            goto fail;
        PyList_SET_ITEM(pieces, j, pair);
    }
    scalars = PyBytes_FromStringAndSize((const char *)numbers, nnumbers * 8);
    if (scalars == NULL)
        goto fail;
    PyTypeObject *tp = (PyTypeObject *)PyTuple_GET_ITEM(spec, S_ENCODED);
    enc = tp->tp_alloc(tp, 0); /* Encoded's __init__ only stores its arguments: stored here */
    if (enc == NULL || PyObject_SetAttr(enc, s_layout, PyTuple_GET_ITEM(spec, S_LAYOUT)) < 0
        || PyObject_SetAttr(enc, s_body_len, PyTuple_GET_ITEM(spec, S_BODY_LEN)) < 0
        || PyObject_SetAttr(enc, s_scalars, scalars) < 0 || PyObject_SetAttr(enc, s_pieces, pieces) < 0
        || PyObject_SetAttr(enc, s_pickled, empty_tuple) < 0)
        goto fail;
    result = enc;
    enc = NULL;
    goto out;
fail:
    result = NULL;
    goto out;
done:
out:
    if (result == Py_None || result == Py_NotImplemented)
        Py_INCREF(result);
    Py_XDECREF(enc);
    Py_XDECREF(scalars);
    Py_XDECREF(pieces);
    for (Py_ssize_t j = 0; j < nvar; j++)
        Py_DECREF(var[j]);
    for (Py_ssize_t j = 0; j < nlater; j++)
        Py_XDECREF(views[j]);
    for (Py_ssize_t j = 0; j < nleaves; j++)
        Py_DECREF(leaves[j]);
    return result;
}

static PyMethodDef methods[] = {
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL,
     "pack(value, spec): value packed into the layout of spec (codec._native_spec), as codec._encode_like; "
     "None where value is not of that shape, NotImplemented where Python must convert an array."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codec", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__codec(void)
{
#define INTERN(var, text)                                    \
    if ((var = PyUnicode_InternFromString(text)) == NULL) \
        return NULL;
    INTERN(s_layout, "layout")
    INTERN(s_body_len, "body_len")
    INTERN(s_scalars, "scalars")
    INTERN(s_pieces, "pieces")
    INTERN(s_pickled, "pickled")
    INTERN(s_dtype, "dtype")
    INTERN(s_shape, "shape")
    INTERN(s_cast, "cast")
    INTERN(s_B, "B")
    INTERN(s_tobytes, "tobytes")
#undef INTERN
    if ((empty_tuple = PyTuple_New(0)) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
