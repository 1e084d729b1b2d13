/* shmcache.base._ahead: back a file's pages ahead, on a thread that never holds the GIL (see ahead.py).
 *
 * A cold batch's records go into fresh pages of a class segment: a posix_fallocate of the run's
 * chunks, then one pwritev. The fallocate is ~half of the kernel's part of a miss (allocating a
 * 24 KB record's pages costs as much as copying it) and sits on the thread that computes the next
 * batch. submit() hands the range the NEXT run will commit to one worker thread of this process,
 * which fallocates it while the caller goes on; result() tells the caller's commit that the range is
 * backed already, so that commit backs only what lies past it. A Python thread would need the GIL to start
 * the call and again to report it (up to the interpreter's switch interval, 5 ms, each, behind a
 * thread computing a batch): this one is a plain pthread, and no Python object ever crosses to it.
 *
 * One request waits at a time: a newer one replaces it (its descriptor is closed unused). The
 * worker closes each request's descriptor (a dup the caller's submit made, close-on-exec) after its
 * call. Results are kept for the last RESULTS requests, by sequence number. In a forked child the
 * worker does not exist: pthread_atfork holds the lock across the fork, and the child's handler resets
 * the rest (a request still waiting and the one in the worker's call - their descriptors closed -,
 * the worker's flag); the child's next submit starts its own worker.
 * The worker is never joined: at exit the process ends it wherever it is (a fallocate is harmless
 * to cut: pages backed or not, nothing relies on them until a commit says so).
 */
#define _GNU_SOURCE  /* SCHED_IDLE */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <unistd.h>

#define RESULTS 64

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER;
static int started;                     /* the worker runs in this process */
static int waiting_fd = -1;             /* the waiting request: its descriptor (-1: none), range, number */
static int running_fd = -1;             /* the request in the worker's call: a forked child closes it */
static long long waiting_off, waiting_len;
static unsigned long long waiting_seq;
static unsigned long long next_seq = 1; /* 0 is never a request's */
static struct { unsigned long long seq; int err; } results[RESULTS];  /* err: 0 backed, else errno */

static void *
worker(void *unused)
{
    (void)unused;
    /* only a CPU with nothing else to run backs pages ahead: on a host whose cores all compute (a
     * DataLoader worker per core, torch's own threads) the commit backs its range itself */
    const struct sched_param idle = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    for (;;) {
        pthread_mutex_lock(&lock);
        while (waiting_fd < 0)
            pthread_cond_wait(&wake, &lock);
        const int fd = waiting_fd;
        const long long off = waiting_off, len = waiting_len;
        const unsigned long long seq = waiting_seq;
        waiting_fd = -1;
        running_fd = fd;
        pthread_mutex_unlock(&lock);
        /* one call, as the commit it stands in for: a call that fails (ENOSPC: /dev/shm full)
         * gives back the pages it allocated, so a request that finds no room takes none of what
         * is left (a DataLoader's batches, another cache); pieces would keep those before the
         * one that failed. It holds the file's inode lock no longer than that commit would. */
        const int err = posix_fallocate(fd, (off_t)off, (off_t)len);
        /* closed under the lock: a child forked in between would inherit it with running_fd set
         * to a number that another thread of the parent may have opened again by then */
        pthread_mutex_lock(&lock);
        close(fd);
        running_fd = -1;
        results[seq % RESULTS].seq = seq;
        results[seq % RESULTS].err = err;
        pthread_mutex_unlock(&lock);
    }
    return NULL;
}

/* the lock is held across a fork (the worker holds it only around its calls, never during one), so
 * the child's copy is consistent and free */
static void
before_fork(void)
{
    pthread_mutex_lock(&lock);
}

static void
in_parent(void)
{
    pthread_mutex_unlock(&lock);
}

static void
in_child(void)
{
    /* only the forking thread lives on: the worker is gone, and no thread waits on the condition */
    pthread_mutex_unlock(&lock);
    pthread_cond_init(&wake, NULL);
    if (waiting_fd >= 0)
        close(waiting_fd);
    if (running_fd >= 0)  /* the duplicate the parent's worker was using at the fork: the child's copy */
        close(running_fd);
    waiting_fd = running_fd = -1;
    started = 0;
}

static PyObject *
submit(PyObject *module, PyObject *args)
{
    int fd;
    long long off, len;
    (void)module;
    if (!PyArg_ParseTuple(args, "iLL", &fd, &off, &len))
        return NULL;
    if (off < 0 || len <= 0) {
        PyErr_Format(PyExc_ValueError, "submit(fd, %lld, %lld): a range of at least one byte from offset >= 0", off, len);
        return NULL;
    }
    const int mine = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (mine < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    int old = -1, err = 0;
    unsigned long long seq;
    pthread_mutex_lock(&lock);
    if (!started) {
        pthread_attr_t attr;
        pthread_t thread;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 64 << 10);
        err = pthread_create(&thread, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        started = err == 0;
    }
    if (started) {
        old = waiting_fd;  /* replaced: never started, so never backed */
        waiting_fd = mine;
        waiting_off = off;
        waiting_len = len;
        seq = waiting_seq = next_seq++;
        pthread_cond_signal(&wake);
    }
    pthread_mutex_unlock(&lock);
    if (old >= 0)
        close(old);
    if (err) {
        close(mine);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(seq);
}

static PyObject *
result(PyObject *module, PyObject *arg)
{
    (void)module;
    const unsigned long long seq = PyLong_AsUnsignedLongLong(arg);
    if (seq == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    int found = 0, err = 0;
    pthread_mutex_lock(&lock);
    if (seq && results[seq % RESULTS].seq == seq) {
        found = 1;
        err = results[seq % RESULTS].err;
    }
    pthread_mutex_unlock(&lock);
    if (!found)
        Py_RETURN_NONE;
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"submit", submit, METH_VARARGS,
     "submit(fd, offset, length) -> request number: posix_fallocate a dup of fd's range on the worker thread."},
    {"result", result, METH_O,
     "result(request) -> None while it is not done (or replaced, or too old), else 0 (backed) or the errno."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ahead", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__ahead(void)
{
    static int registered;
    if (!registered) {
        const int err = pthread_atfork(before_fork, in_parent, in_child);
        if (err) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        registered = 1;
    }
    return PyModule_Create(&module);
}
