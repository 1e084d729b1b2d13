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
 * Where the kernel has MADV_POPULATE_WRITE (5.14), the worker then maps the backed range (a
 * mapping of its own, MAP_SHARED) and makes every page of it present and writable in this
 * process's page tables: copy_into() then copies a run's records into it with memcpy, at about a
 * third of a pwritev's cost (no page-cache lookup, no per-page call), where a first store through
 * any other mapping would fault on each 4 KiB page. One such mapping is kept at a time, for the
 * request it was made for: the worker unmaps it once a newer request comes, or after MAP_KEEP_S
 * unused, never while a copy_into copies (map_users; the copy runs with the GIL held and the
 * worker never needs it). A mapping, like a request's descriptor, keeps its whole file alive after
 * the file is unlinked: this process's unlinks (a cache destroyed, cleared, collected) call
 * release(), which unmaps it, drops a waiting request and waits a while for the one in the
 * worker's call (RELEASE_WAIT_NS);
 * another process's destroy waits for MAP_KEEP_S (where the worker gets a CPU) or the next
 * request. A hugetlbfs file is not mapped (it maps whole huge pages only): its runs are copied
 * as Segment.write_at copies them there.
 *
 * One request waits at a time: a newer one replaces it (its descriptor is closed unused). The
 * worker closes each request's descriptor (a dup the caller's submit made, close-on-exec) after its
 * call. Results are kept for the last RESULTS requests, by sequence number. In a forked child the
 * worker does not exist: pthread_atfork holds the lock across the fork, and the child's handler resets
 * the rest (a request still waiting and the one in the worker's call - their descriptors closed -,
 * the worker's flag); the child's next submit starts its own worker. The worker's mappings are
 * MADV_DONTFORK, made so under the lock: no child has one.
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
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#define RESULTS 64
#define MAP_KEEP_S 1  /* a mapping no copy_into used within this long is unmapped (see above) */
/* release() waits this long at most for the worker's call to end: enough for its largest call
 * (AHEAD_BYTES backed and mapped present: ~10 ms) once it has a CPU - the one the waiting caller
 * leaves, or the priority release() gives it where the process may raise it (root, CAP_SYS_NICE;
 * an unprivileged thread cannot leave SCHED_IDLE). On a host whose every CPU computes otherwise,
 * that call ends later, and the file with it: release() does not hold its caller's lock that long */
#define RELEASE_WAIT_NS 200000000L
#define HUGETLBFS_MAGIC_ 0x958458f6  /* statfs f_type: mapped in huge pages only (no 4 KiB range) */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  /* Linux 5.14; an older kernel says EINVAL: no mapping, as before */
#endif

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake;  /* init_conditions: CLOCK_MONOTONIC */
static int started;                     /* the worker runs in this process */
static pthread_t worker_thread;         /* it, once started: release() raises its priority for a while */
static int boosted;                     /* release() raised it: the worker goes back to SCHED_IDLE */
static int waiting_fd = -1;             /* the waiting request: its descriptor (-1: none), range, number */
static int running_fd = -1;             /* the request in the worker's call: a forked child closes it */
static long long waiting_off, waiting_len;
static unsigned long long waiting_seq;
static unsigned long long next_seq = 1; /* 0 is never a request's */
static struct { unsigned long long seq; int err; } results[RESULTS];  /* err: 0 backed, else errno */
static pthread_cond_t unused;  /* map_users dropped to 0 */
static pthread_cond_t quiet;   /* the worker's call ended (running_fd back to -1), or its unmapping */
static int unmapping;          /* the worker unmaps a mapping it detached (the lock let go meanwhile) */
/* the mapping of the last request backed: its address and length, the file offset it starts at
 * (page-aligned), the request's range [map_lo, map_hi) and number, the copies in it now, when made */
static char *map_addr;
static size_t map_len;
static long long map_file_off, map_lo, map_hi;
static unsigned long long map_seq;
static int map_users;
static struct timespec map_born;
static unsigned long long map_floor;   /* release(): a request numbered below keeps no mapping */
static int map_tried, map_works = 1;    /* MADV_POPULATE_WRITE: stop trying where it is refused */

/* the mapping made for the last request, detached for the caller to unmap (NULL if none): waits
 * for a copy in it to end (copy_into holds it a memcpy long). Called with the lock held. */
static char *
detach_map(size_t *len)
{
    while (map_users)
        pthread_cond_wait(&unused, &lock);
    char *addr = map_addr;
    *len = map_len;
    map_addr = NULL;
    map_len = 0;
    map_seq = 0;
    return addr;
}

/* [off, off + len) of fd mapped and every page of it present and writable; NULL if the kernel
 * cannot (no MADV_POPULATE_WRITE, a file system that maps no such range): the copy goes by pwritev */
static char *
populated(int fd, long long off, long long len, unsigned long long seq, long long *file_off, size_t *map_len_out)
{
    const long page = sysconf(_SC_PAGESIZE);
    const long long start = off - off % page;
    const size_t size = (size_t)(off + len - start);
    struct statfs fs;
    /* hugetlbfs maps whole huge pages only: a range of base pages would be mapped, then neither
     * marked nor unmapped (EINVAL) - kept, and inherited, for the process's life */
    if (fstatfs(fd, &fs) || fs.f_type == HUGETLBFS_MAGIC_)
        return NULL;
    /* made and marked MADV_DONTFORK under the lock, which a fork takes first (before_fork): no
     * child ever inherits it, wherever the worker is (a DataLoader forks its workers at any
     * moment; an inherited mapping would keep the whole file in the child as long as it lives) */
    pthread_mutex_lock(&lock);
    /* not for a request made before a release(): its file may be unlinked, and the caller waits */
    char *addr = map_works && seq >= map_floor
        ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)start) : MAP_FAILED;
    if (addr != MAP_FAILED && madvise(addr, size, MADV_DONTFORK)) {
        munmap(addr, size);
        addr = MAP_FAILED;
    }
    pthread_mutex_unlock(&lock);
    if (addr == MAP_FAILED)
        return NULL;
    const int failed = madvise(addr, size, MADV_POPULATE_WRITE);
    const int why = errno;
    pthread_mutex_lock(&lock);
    if (!map_tried) {
        map_tried = 1;
        map_works = !(failed && why == EINVAL);  /* EINVAL: this kernel has no MADV_POPULATE_WRITE */
    }
    pthread_mutex_unlock(&lock);
    if (failed) {
        munmap(addr, size);
        return NULL;
    }
    *file_off = start;
    *map_len_out = size;
    return addr;
}

static int
expired(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec - map_born.tv_sec > MAP_KEEP_S
        || (now.tv_sec - map_born.tv_sec == MAP_KEEP_S && now.tv_nsec >= map_born.tv_nsec);
}

static void *
worker(void *unused)
{
    (void)unused;
    /* only a CPU with nothing else to run backs pages ahead: on a host whose cores all compute (a
     * DataLoader worker per core, torch's own threads) the commit backs its range itself */
    const struct sched_param idle = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    pthread_mutex_lock(&lock);
    for (;;) {
        while (waiting_fd < 0) {
            if (map_addr != NULL && expired()) {  /* unused for MAP_KEEP_S: let it go (after a copy in it) */
                size_t len;
                char *old = detach_map(&len);
                unmapping = 1;
                pthread_mutex_unlock(&lock);
                munmap(old, len);
                pthread_mutex_lock(&lock);
                unmapping = 0;
                pthread_cond_broadcast(&quiet);
                continue;
            }
            if (map_addr != NULL) {
                struct timespec until = map_born;
                until.tv_sec += MAP_KEEP_S;
                pthread_cond_timedwait(&wake, &lock, &until);
            } else {
                pthread_cond_wait(&wake, &lock);
            }
        }
        const int fd = waiting_fd;
        const long long off = waiting_off, len = waiting_len;
        const unsigned long long seq = waiting_seq;
        waiting_fd = -1;
        running_fd = fd;
        /* a newer request: the last one's range was used, or passed over, by now */
        size_t old_len;
        char *old = detach_map(&old_len);  /* unmapped inside the call: running_fd is set */
        pthread_mutex_unlock(&lock);
        if (old != NULL)
            munmap(old, old_len);
        /* one call, as the commit it stands in for: a call that fails (ENOSPC: /dev/shm full)
         * gives back the pages it allocated, so a request that finds no room takes none of what
         * is left (a DataLoader's batches, another cache); pieces would keep those before the
         * one that failed. It holds the file's inode lock no longer than that commit would. */
        const int err = posix_fallocate(fd, (off_t)off, (off_t)len);
        long long file_off = 0;
        size_t size = 0;
        char *addr = err ? NULL : populated(fd, off, len, seq, &file_off, &size);
        pthread_mutex_lock(&lock);
        if (addr != NULL && seq < map_floor) {  /* release() came while it was made: not kept */
            pthread_mutex_unlock(&lock);
            munmap(addr, size);
            pthread_mutex_lock(&lock);
            addr = NULL;
        }
        /* closed under the lock: a child forked in between would inherit it with running_fd set
         * to a number that another thread of the parent may have opened again by then */
        close(fd);
        running_fd = -1;
        pthread_cond_broadcast(&quiet);  /* a release() waiting for this call: nothing of it is left */
        if (boosted) {  /* release() raised it to wait for this call: idle again */
            boosted = 0;
            pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
        }
        results[seq % RESULTS].seq = seq;
        results[seq % RESULTS].err = err;
        if (addr != NULL) {
            map_addr = addr;
            map_len = size;
            map_file_off = file_off;
            map_lo = off;
            map_hi = off + len;
            map_seq = seq;
            clock_gettime(CLOCK_MONOTONIC, &map_born);
        }
    }
    return NULL;
}

/* the worker's timed wait counts in CLOCK_MONOTONIC (map_born's clock), not the wall clock */
static void
init_conditions(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&wake, &attr);
    pthread_cond_init(&unused, NULL);
    pthread_cond_init(&quiet, &attr);
    pthread_condattr_destroy(&attr);
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
    init_conditions();
    boosted = unmapping = 0;
    map_addr = NULL;  /* the parent's mappings: MADV_DONTFORK, not in this child */
    map_len = 0;
    map_seq = 0;
    map_users = 0;
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
        if (err == 0)
            worker_thread = thread;
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

/* copy_into(request, offset, buffers, end): ``buffers`` (contiguous, one after the other) copied
 * at file offset ``offset`` through the mapping the worker made for ``request``, if it has one
 * and the bytes lie inside the request's range: True; else nothing is copied and False (the caller
 * pwrites them). The bytes are counted before anything is copied: ValueError, nothing copied,
 * when they would end past ``end`` (the segment's size), as rowcopy.write_all. */
static PyObject *
copy_into(PyObject *module, PyObject *args)
{
    unsigned long long seq;
    long long offset, end;
    PyObject *seq_obj;
    (void)module;
    if (!PyArg_ParseTuple(args, "KLOL:copy_into", &seq, &offset, &seq_obj, &end))
        return NULL;
    PyObject *fast = PySequence_Fast(seq_obj, "copy_into: buffers must be a sequence");
    if (fast == NULL)
        return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_buffer *views = PyMem_Calloc(n ? (size_t)n : 1, sizeof *views);
    Py_ssize_t taken = 0;
    long long total = 0;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; taken < n; taken++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, taken), &views[taken], PyBUF_SIMPLE) < 0)
            goto done;
        total += views[taken].len;
    }
    if (offset < 0 || end < offset || total > end - offset) {
        PyErr_Format(PyExc_ValueError, "copy_into: %lld bytes at offset %lld end past %lld", total, offset, end);
        goto done;
    }
    pthread_mutex_lock(&lock);
    const int ok = map_addr != NULL && seq && map_seq == seq && offset >= map_lo && total <= map_hi - offset;
    char *at = ok ? map_addr + (offset - map_file_off) : NULL;
    if (ok)
        map_users++;
    pthread_mutex_unlock(&lock);
    if (ok) {
        for (Py_ssize_t i = 0; i < n; i++) {
            memcpy(at, views[i].buf, (size_t)views[i].len);
            at += views[i].len;
        }
        pthread_mutex_lock(&lock);
        if (--map_users == 0)
            pthread_cond_broadcast(&unused);
        pthread_mutex_unlock(&lock);
    }
    result = PyBool_FromLong(ok);
done:
    for (Py_ssize_t i = 0; i < taken; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(fast);
    return result;
}

/* release(): this process unlinked a file, and nothing of the worker's may keep one alive: its
 * mapping is unmapped, the waiting request dropped (its descriptor closed: never backed), and the
 * request in its call waited for (its descriptor held; no mapping made of it, map_floor) - without
 * the GIL, and with the worker raised from SCHED_IDLE meanwhile where the process may, for
 * RELEASE_WAIT_NS at most (see there). */
static PyObject *
release(PyObject *module, PyObject *unused_arg)
{
    (void)module;
    (void)unused_arg;
    size_t len;
    char *addr;
    int dropped;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&lock);
    map_floor = next_seq;
    addr = detach_map(&len);  /* after a copy another thread began since this one let the GIL go */
    dropped = waiting_fd;
    waiting_fd = -1;
    if ((running_fd >= 0 || unmapping) && started) {
        const struct sched_param normal = {0};
        boosted = pthread_setschedparam(worker_thread, SCHED_OTHER, &normal) == 0;
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += RELEASE_WAIT_NS;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        while ((running_fd >= 0 || unmapping) && pthread_cond_timedwait(&quiet, &lock, &until) == 0)
            ;
        if (boosted && running_fd < 0) {  /* an unmapping waited for: the worker's call won't reset it */
            boosted = 0;
            const struct sched_param idle = {0};
            pthread_setschedparam(worker_thread, SCHED_IDLE, &idle);
        }
    }
    pthread_mutex_unlock(&lock);
    if (dropped >= 0)
        close(dropped);
    if (addr != NULL)
        munmap(addr, len);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"submit", submit, METH_VARARGS,
     "submit(fd, offset, length) -> request number: posix_fallocate a dup of fd's range on the worker thread."},
    {"copy_into", copy_into, METH_VARARGS,
     "copy_into(request, offset, buffers, end) -> True if copied through the request's mapping, else False."},
    {"release", release, METH_NOARGS,
     "release(): unmap the worker's mapping now (a file of this process is unlinked), and drop one under way."},
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
        init_conditions();
        const int err = pthread_atfork(before_fork, in_parent, in_child);
        if (err) {
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
        registered = 1;
    }
    return PyModule_Create(&module);
}
