/* shmcache.cache._hit: the hit of an int key, compiled (see hit.py).
 *
 * CacheView.lookup's hot path - an int key at its own position in the table, in memory, with a
 * layout and a size class this process has mapped - as one call: a warm ds[i] was three Python
 * calls and some thirty bytecodes of checks around one copy. It makes the checks of that path, in
 * its order (NOTE [publish order]: the root's epoch word, then the entry's state word on its own,
 * with acquire order, before its key and location words and before the record's bytes; the chunk
 * among those handed out, the length within the chunk and covering the layout), and one more (the
 * record inside the class segment's mapping). It answers ABSENT where the entry at the key's own
 * position is EMPTY and LONG_WAY for anything else: the caller then goes the long way, which reads
 * everything again and names any damage. Nothing here knows the entry's bit layout: the shifts
 * and masks come from cache.index through hit.py, and the class and layout tables are the view's
 * own dicts (read here, never changed).
 *
 * get() counts the hit into this process's counters (target()); peek() does not, for a batch read
 * key by key, which counts its hits at once (CacheView.lookup_batch).
 *
 * A Hits object belongs to one mapping of one generation's table (CacheView._map_epoch makes a new
 * one for each); it holds the root's, the table's and the meta segment's buffers for its lifetime
 * (a segment is never unmapped by hand: shm.Segment).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

/* forks since this module loaded, counted in the child: a target of the hit counts set before a
   fork is the parent's row, never the child's (Hits.target) */
static unsigned long forks;

static void
after_fork_in_child(void)
{
    forks++;
}

typedef struct {
    PyObject_HEAD
    Py_buffer root, table;
    int have_root, have_table;
    Py_ssize_t epoch_at, entries_at, entry_bytes, capacity, data_at;
    uint64_t epoch, state_mask, state_want, layout_mask, loc_mask;
    unsigned layout_shift, length_shift, class_shift;
    PyObject *classes, *layouts; /* the view's dicts: class -> (segment, view, chunk size, handed out),
                                    layout id -> (bytes, decoder, end, private decoder) */
    PyObject *undecodable;       /* what a decoder raises on damaged bytes: the long way names it */
    PyObject *long_way, *absent; /* get's answers other than a value */
    /* the hit counts: this process's totals (the view's list; item 0, hits) and their word in the
       meta segment, set by target() in this process; else count_hit() counts one (the view) */
    Py_buffer meta;
    int have_meta;
    PyObject *count_hit, *counters;
    Py_ssize_t counter_at;
    unsigned long counter_forks;
} Hits;

static int
hits_traverse(Hits *self, visitproc visit, void *arg)
{
    Py_VISIT(self->classes);
    Py_VISIT(self->layouts);
    Py_VISIT(self->undecodable);
    Py_VISIT(self->long_way);
    Py_VISIT(self->absent);
    Py_VISIT(self->count_hit);
    Py_VISIT(self->counters);
    return 0;
}

static int
hits_clear(Hits *self)
{
    Py_CLEAR(self->classes);
    Py_CLEAR(self->layouts);
    Py_CLEAR(self->undecodable);
    Py_CLEAR(self->long_way);
    Py_CLEAR(self->absent);
    Py_CLEAR(self->count_hit);
    Py_CLEAR(self->counters);
    return 0;
}

static void
hits_dealloc(Hits *self)
{
    PyObject_GC_UnTrack(self);
    if (self->have_root)
        PyBuffer_Release(&self->root);
    if (self->have_table)
        PyBuffer_Release(&self->table);
    if (self->have_meta)
        PyBuffer_Release(&self->meta);
    hits_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
hits_init(Hits *self, PyObject *args, PyObject *kwds)
{
    PyObject *root, *table, *meta, *classes, *layouts, *undecodable, *long_way, *absent, *count_hit;
    if (self->have_root || self->have_table || self->have_meta) {
        PyErr_SetString(PyExc_TypeError, "Hits: made once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OnKOnnnnKKIKIIKO!O!O!OOOO:Hits", &root, &self->epoch_at, &self->epoch, &table,
                          &self->entries_at, &self->entry_bytes, &self->capacity, &self->data_at, &self->state_mask,
                          &self->state_want, &self->layout_shift, &self->layout_mask, &self->length_shift,
                          &self->class_shift, &self->loc_mask, &PyDict_Type, &classes, &PyDict_Type, &layouts,
                          &PyTuple_Type, &undecodable, &long_way, &absent, &meta, &count_hit))
        return -1;
    if (self->layout_shift > 63 || self->length_shift > 63 || self->class_shift > 63) {
        PyErr_SetString(PyExc_ValueError, "Hits: a shift past 63 bits");
        return -1;
    }
    if (PyObject_GetBuffer(root, &self->root, PyBUF_SIMPLE) < 0)
        return -1;
    self->have_root = 1;
    if (PyObject_GetBuffer(table, &self->table, PyBUF_SIMPLE) < 0)
        return -1;
    self->have_table = 1;
    if (PyObject_GetBuffer(meta, &self->meta, PyBUF_WRITABLE) < 0) { /* each hit is written there */
        PyErr_Format(PyExc_TypeError, "Hits: the meta segment must be a writable buffer (each hit is counted "
                     "into it); this %.100s is not", Py_TYPE(meta)->tp_name);
        return -1;
    }
    self->have_meta = 1;
    if (!PyCallable_Check(count_hit)) {
        PyErr_SetString(PyExc_TypeError, "Hits: count_hit must be callable");
        return -1;
    }
    if (self->epoch_at < 0 || self->epoch_at % 8 || self->epoch_at > self->root.len - 8
        || (uintptr_t)self->root.buf % 8) {
        PyErr_Format(PyExc_ValueError, "Hits: the epoch word at %zd is not an aligned word of the root's %zd bytes",
                     self->epoch_at, self->root.len);
        return -1;
    }
    if (self->entries_at < 0 || self->entries_at % 8 || self->entry_bytes < 24 || self->entry_bytes % 8
        || self->capacity < 0 || (uintptr_t)self->table.buf % 8 || self->entries_at > self->table.len
        || (self->capacity && self->entry_bytes > (self->table.len - self->entries_at) / self->capacity)) {
        PyErr_Format(PyExc_ValueError, "Hits: %zd entries of %zd bytes from %zd do not fit a table of %zd bytes",
                     self->capacity, self->entry_bytes, self->entries_at, self->table.len);
        return -1;
    }
    if (self->data_at < 0) {
        PyErr_SetString(PyExc_ValueError, "Hits: a negative data offset");
        return -1;
    }
    Py_INCREF(classes);
    self->classes = classes;
    Py_INCREF(layouts);
    self->layouts = layouts;
    Py_INCREF(undecodable);
    self->undecodable = undecodable;
    Py_INCREF(long_way);
    self->long_way = long_way;
    Py_INCREF(absent);
    self->absent = absent;
    Py_INCREF(count_hit);
    self->count_hit = count_hit;
    self->counter_at = -1;
    return 0;
}

static PyObject *
hits_target(Hits *self, PyObject *args)
{
    PyObject *counters;
    Py_ssize_t at;
    if (!PyArg_ParseTuple(args, "On:target", &counters, &at))
        return NULL;
    if (at < 0 || counters == Py_None) {
        Py_CLEAR(self->counters);
        self->counter_at = -1;
        Py_RETURN_NONE;
    }
    if (!PyList_CheckExact(counters) || PyList_GET_SIZE(counters) < 1) {
        PyErr_SetString(PyExc_TypeError, "target: counters must be a list (item 0: this process's hits)");
        return NULL;
    }
    if (at % 8 || (uintptr_t)self->meta.buf % 8 || at > self->meta.len - 8) {
        PyErr_Format(PyExc_ValueError, "target: the word at %zd is not an aligned word of the meta segment's %zd bytes",
                     at, self->meta.len);
        return NULL;
    }
    Py_INCREF(counters);
    Py_XSETREF(self->counters, counters);
    self->counter_at = at;
    self->counter_forks = forks;
    Py_RETURN_NONE;
}

/* one hit counted: into the target (the list's item 0 and its word in meta), or by count_hit() */
static int
count_one(Hits *self)
{
    if (self->counters != NULL && self->counter_forks == forks && PyList_GET_SIZE(self->counters) > 0) {
        PyObject *old = PyList_GET_ITEM(self->counters, 0);
        const long long v = PyLong_CheckExact(old) ? PyLong_AsLongLong(old) : -1;
        if (v >= 0 && v < (1LL << 62)) { /* a total past that (a damaged slot's): the view's count() */
            PyObject *now = PyLong_FromLongLong(v + 1);
            if (now == NULL)
                return -1;
            PyList_SET_ITEM(self->counters, 0, now);
            Py_DECREF(old);
            __atomic_store_n((uint64_t *)((char *)self->meta.buf + self->counter_at), (uint64_t)(v + 1),
                             __ATOMIC_RELAXED);
            return 0;
        }
        PyErr_Clear();
    }
    PyObject *r = PyObject_CallNoArgs(self->count_hit);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* a non-negative int of a tuple's item, or -1 (no error left set) */
static Py_ssize_t
item_size(PyObject *tuple, Py_ssize_t i)
{
    PyObject *v = PyTuple_GET_ITEM(tuple, i);
    if (!PyLong_CheckExact(v))
        return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    if (n < 0) {
        PyErr_Clear();
        return -1;
    }
    return n;
}

/* the value of dict ``d`` at int ``k`` if it is a tuple of at least 4, else NULL (borrowed) */
static PyObject *
tuple_at(PyObject *d, uint64_t k)
{
    PyObject *key = PyLong_FromUnsignedLongLong(k);
    if (key == NULL)
        return NULL;
    PyObject *v = PyDict_GetItemWithError(d, key); /* an int's hash never raises */
    Py_DECREF(key);
    if (v == NULL || !PyTuple_CheckExact(v) || PyTuple_GET_SIZE(v) < 4)
        return NULL;
    return v;
}

static PyObject *read_record(Hits *self, PyObject *cls, PyObject *layout, uint64_t w0, uint64_t w2, int count);

/* get and peek: the value of int ``key`` on the hot path (its hit counted if ``count``), absent,
   or long_way */
static PyObject *
hit(Hits *self, PyObject *key, int count)
{
    if (self->classes == NULL) { /* cleared by the cycle collector (no Python code sees that: PEP 442) */
        PyErr_SetString(PyExc_ReferenceError, "Hits: cleared by the garbage collector");
        return NULL;
    }
    if (!PyLong_CheckExact(key)) /* a bool, an int subclass: the long way */
        return Py_NewRef(self->long_way);
    int overflow;
    const long long k = PyLong_AsLongLongAndOverflow(key, &overflow);
    if (overflow || k < 0 || k >= self->capacity) {
        PyErr_Clear();
        return Py_NewRef(self->long_way);
    }
    const uint64_t *epoch = (const uint64_t *)((const char *)self->root.buf + self->epoch_at);
    if (__atomic_load_n(epoch, __ATOMIC_ACQUIRE) != self->epoch) /* another generation or table now */
        return Py_NewRef(self->long_way);
    const uint64_t *row = (const uint64_t *)((const char *)self->table.buf + self->entries_at
                                             + (Py_ssize_t)k * self->entry_bytes);
    const uint64_t w0 = __atomic_load_n(row, __ATOMIC_ACQUIRE); /* first, on its own */
    if (w0 == 0)
        return Py_NewRef(self->absent); /* EMPTY at the key's own position */
    if ((w0 & self->state_mask) != self->state_want)
        return Py_NewRef(self->long_way);
    const uint64_t w1 = __atomic_load_n(row + 1, __ATOMIC_RELAXED), w2 = __atomic_load_n(row + 2, __ATOMIC_RELAXED);
    if (w1 != (uint64_t)k)
        return Py_NewRef(self->long_way);
    PyObject *cls = tuple_at(self->classes, w2 >> self->class_shift);
    PyObject *layout = cls ? tuple_at(self->layouts, (w0 >> self->layout_shift) & self->layout_mask) : NULL;
    if (layout == NULL) {
        if (PyErr_Occurred())
            return NULL;
        return Py_NewRef(self->long_way); /* a class or layout not mapped here yet: the long way maps it */
    }
    Py_INCREF(cls); /* held while used: another thread may replace them in the dicts */
    Py_INCREF(layout);
    PyObject *out = read_record(self, cls, layout, w0, w2, count);
    Py_DECREF(layout);
    Py_DECREF(cls);
    return out;
}

/* the value of entry (w0, w2) - its record copied into a bytearray and decoded by the layout's
   private decoder, its hit counted if ``count`` - or long_way, after the checks of the class and
   layout records (hit) */
static PyObject *
read_record(Hits *self, PyObject *cls, PyObject *layout, uint64_t w0, uint64_t w2, int count)
{
    const Py_ssize_t chunk_size = item_size(cls, 2), handed_out = item_size(cls, 3), end = item_size(layout, 2);
    const uint64_t chunk = w2 & self->loc_mask, n = w0 >> self->length_shift;
    if (chunk_size < 0 || handed_out < 0 || end < 0 || chunk >= (uint64_t)handed_out || n < (uint64_t)end
        || n > (uint64_t)chunk_size)
        return Py_NewRef(self->long_way);
    Py_buffer data;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(cls, 1), &data, PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        return Py_NewRef(self->long_way);
    }
    /* the record's bytes inside the segment (chunk < handed out and n <= chunk size were checked
       against the class record; this against the mapping itself): no product can overflow */
    const Py_ssize_t room = data.len - self->data_at;
    PyObject *record = NULL;
    if (room >= 0 && chunk_size > 0 && chunk < (uint64_t)(room / chunk_size)
        && (Py_ssize_t)chunk * chunk_size <= room - (Py_ssize_t)n)
        record = PyByteArray_FromStringAndSize((const char *)data.buf + self->data_at + (Py_ssize_t)chunk * chunk_size,
                                               (Py_ssize_t)n);
    else
        record = Py_NewRef(self->long_way);
    PyBuffer_Release(&data);
    if (record == NULL || record == self->long_way)
        return record;
    PyObject *value = PyObject_CallOneArg(PyTuple_GET_ITEM(layout, 3), record);
    Py_DECREF(record);
    if (value == NULL) {
        if (!PyErr_ExceptionMatches(self->undecodable))
            return NULL;
        PyErr_Clear(); /* damaged bytes: the long way reads them again and names them */
        return Py_NewRef(self->long_way);
    }
    if (count && count_one(self) < 0) {
        Py_DECREF(value);
        return NULL;
    }
    return value;
}

static PyObject *
hits_get(Hits *self, PyObject *key)
{
    return hit(self, key, 1);
}

static PyObject *
hits_peek(Hits *self, PyObject *key)
{
    return hit(self, key, 0);
}

static PyMethodDef hits_methods[] = {
    {"peek", (PyCFunction)hits_peek, METH_O,
     "peek(key): get(key) without counting the hit (a batch counts its hits at once)."},
    {"target", (PyCFunction)hits_target, METH_VARARGS,
     "target(counters, word_at): count each hit into counters[0] and the meta segment's word at word_at (-1: "
     "by count_hit() instead), in this process (a fork undoes it)."},
    {"get", (PyCFunction)hits_get, METH_O,
     "get(key): the value of an int key on the hot path (its record copied and decoded; the hit counted); "
     "absent where its entry is EMPTY; long_way for anything else."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HitsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "shmcache.cache._hit.Hits",
    .tp_doc = "The compiled hot path of one mapping of a generation's table (see hit.py).",
    .tp_basicsize = sizeof(Hits),
    .tp_dealloc = (destructor)hits_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)hits_traverse,
    .tp_clear = (inquiry)hits_clear,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hits_init,
    .tp_methods = hits_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hit", NULL, -1, NULL};

PyMODINIT_FUNC
PyInit__hit(void)
{
    if (PyType_Ready(&HitsType) < 0)
        return NULL;
    static int registered;
    if (!registered) {
        if (pthread_atfork(NULL, NULL, after_fork_in_child) != 0) {
            PyErr_SetString(PyExc_OSError, "_hit: pthread_atfork failed");
            return NULL;
        }
        registered = 1;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HitsType);
    if (PyModule_AddObject(m, "Hits", (PyObject *)&HitsType) < 0) {
        Py_DECREF(&HitsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
