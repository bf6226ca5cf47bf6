/* The pack's reader threads in C (`k3stream.store._pack_reads`; `pack_io.PackFile` uses it when built).
 *
 * A `Pool` is a fixed set of pthreads taking ranges (offset, length, destination address) from one
 * bounded queue, lowest priority number first, then in the order queued; `hurry` raises the queued
 * ranges of an object (its tag) to a better priority. `Pool.submit` queues a batch of ranges in one call
 * and returns a `Batch`, whose waits (`next_landed`, `wait`, `wait_all`) release the GIL: no reader ever
 * takes the GIL, so the disk goes on with the next queued range while Python threads compute.
 *
 * Each range is one pread loop into one contiguous destination. With O_DIRECT a range is read in
 * whole 4 KiB blocks straight into its destination when that is aligned and has room for the
 * rounding, else into the thread's aligned bounce buffer and copied out; a short read goes on from
 * the block it stopped at (buffered reads: from the byte) until the end of the file, and a read the
 * file does not fill fails as "short read: DONE of SIZE bytes at OFFSET" (`Batch.error`). A direct
 * read refused with EINVAL switches the pool to its buffered descriptor for good (`direct_refused`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define ALIGNMENT 4096
#define QUEUE_CAPACITY 4096 /* ranges; a submit finding the queue full waits for room, GIL released */

typedef struct Batch Batch;

typedef struct {
    Batch *batch;
    uint8_t *dest;
    int64_t offset, length, room; /* room: writable bytes at dest (a direct read may fill past length) */
    int64_t tag, priority, seq, started_ns, ended_ns;
    int request;
} Range;

struct Batch {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t landed_cond;
    Range *ranges;
    int nranges, nrequests, pending; /* pending: ranges not yet done */
    int *left;                       /* ranges left a request */
    int *landed, landed_count, handed;
    int *error;                      /* a request's first errno (0: none) */
    int64_t *short_done, *short_size, *short_offset; /* its short read, when error is EIO from one */
    Py_buffer *views;                /* each request's destination, held until every range is done */
    int nviews;
};

typedef struct {
    PyObject_HEAD
    pthread_mutex_t lock;
    pthread_cond_t work, room;
    Range *queue[QUEUE_CAPACITY];
    int queued, paused, stopping, closed, nthreads;
    pthread_t *threads;
    int fd, buffered_fd; /* buffered_fd >= 0: fd is O_DIRECT, this the fallback */
    int direct, refused; /* whether reads go through fd with O_DIRECT; the errno that ended that */
    int64_t latency_ns, seq, bounced;
} Pool;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t round_up(int64_t n) { return (n + ALIGNMENT - 1) / ALIGNMENT * ALIGNMENT; }

/* ---- one range ------------------------------------------------------------------------------- */

typedef struct {
    uint8_t *data;
    int64_t size;
} Bounce;

static uint8_t *bounce_of(Bounce *bounce, int64_t size) {
    if (bounce->size < size) {
        free(bounce->data);
        bounce->size = 0;
        if (posix_memalign((void **)&bounce->data, ALIGNMENT, (size_t)size) != 0) return bounce->data = NULL;
        bounce->size = size;
    }
    return bounce->data;
}

/* O_DIRECT reads into buf from offset (both aligned) until needed bytes are in, each short read's rest
 * read again from the block it stopped at: the bytes read (fewer at the end of the file), or -errno */
static int64_t read_blocks(int fd, int64_t offset, uint8_t *buf, int64_t span, int64_t needed) {
    int64_t done = 0;
    while (done < needed) {
        ssize_t got = pread(fd, buf + done, (size_t)(span - done), (off_t)(offset + done));
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        done += got;
        if (got == 0 || done % ALIGNMENT) break;
    }
    return done;
}

typedef struct {
    int error;
    int64_t done; /* with EIO from a short read: the bytes read, else -1 */
} Outcome;

static Outcome short_read(int64_t done) { return (Outcome){EIO, done}; }
static Outcome failed(int error) { return (Outcome){error, -1}; }
static const Outcome READ_OK = {0, -1};

static Outcome read_direct(Pool *pool, Range *r, Bounce *bounce) {
    int64_t head = r->offset % ALIGNMENT, span = round_up(head + r->length);
    int straight = head == 0 && (uintptr_t)r->dest % ALIGNMENT == 0 && r->room >= span;
    uint8_t *buf = straight ? r->dest : bounce_of(bounce, span);
    if (buf == NULL) return failed(ENOMEM);
    if (!straight) __atomic_add_fetch(&pool->bounced, 1, __ATOMIC_RELAXED);
    int64_t got = read_blocks(pool->fd, r->offset - head, buf, span, head + r->length);
    if (got < 0) return failed((int)-got);
    if (got < head + r->length) return short_read(got > head ? got - head : 0);
    if (!straight) memcpy(r->dest, buf + head, (size_t)r->length);
    return READ_OK;
}

static Outcome read_exact(int fd, Range *r) {
    int64_t done = 0;
    while (done < r->length) {
        ssize_t got = pread(fd, r->dest + done, (size_t)(r->length - done), (off_t)(r->offset + done));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) return failed(errno);
        if (got == 0) return short_read(done);
        done += got;
    }
    return READ_OK;
}

static Outcome read_range(Pool *pool, Range *r, Bounce *bounce) {
    if (pool->latency_ns > 0) {
        struct timespec pause = {pool->latency_ns / 1000000000, pool->latency_ns % 1000000000};
        while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
        }
    }
    if (__atomic_load_n(&pool->direct, __ATOMIC_ACQUIRE)) {
        Outcome outcome = read_direct(pool, r, bounce);
        if (outcome.error != EINVAL) return outcome;
        int expected = 0; /* the filesystem refuses O_DIRECT reads: buffered from here on */
        __atomic_compare_exchange_n(&pool->refused, &expected, EINVAL, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
        __atomic_store_n(&pool->direct, 0, __ATOMIC_RELEASE);
    }
    return read_exact(pool->buffered_fd >= 0 ? pool->buffered_fd : pool->fd, r);
}

/* the range's outcome into its batch; the batch is not touched after its lock is released */
static void complete(Range *r, Outcome outcome) {
    Batch *b = r->batch;
    pthread_mutex_lock(&b->lock);
    int q = r->request;
    if (outcome.error && !b->error[q]) {
        b->error[q] = outcome.error;
        b->short_done[q] = outcome.done;
        b->short_size[q] = r->length;
        b->short_offset[q] = r->offset;
    }
    if (--b->left[q] == 0) b->landed[b->landed_count++] = q;
    b->pending--;
    pthread_cond_broadcast(&b->landed_cond);
    pthread_mutex_unlock(&b->lock);
}

static void run_range(Pool *pool, Range *r, Bounce *bounce) {
    r->started_ns = now_ns();
    Outcome outcome = read_range(pool, r, bounce);
    r->ended_ns = now_ns();
    complete(r, outcome);
}

/* ---- the pool -------------------------------------------------------------------------------- */

static int before(const Range *a, const Range *b) {
    return a->priority < b->priority || (a->priority == b->priority && a->seq < b->seq);
}

static Range *take_first(Pool *pool) { /* under the lock, the queue not empty */
    int best = 0;
    for (int i = 1; i < pool->queued; i++)
        if (before(pool->queue[i], pool->queue[best])) best = i;
    Range *r = pool->queue[best];
    pool->queue[best] = pool->queue[--pool->queued];
    pthread_cond_signal(&pool->room);
    return r;
}

static void *reader(void *arg) {
    Pool *pool = arg;
    Bounce bounce = {NULL, 0};
    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stopping && (pool->queued == 0 || pool->paused)) pthread_cond_wait(&pool->work, &pool->lock);
        if (pool->queued == 0) break; /* stopping, nothing left */
        Range *r = take_first(pool);
        pthread_mutex_unlock(&pool->lock);
        run_range(pool, r, &bounce);
        pthread_mutex_lock(&pool->lock);
    }
    pthread_mutex_unlock(&pool->lock);
    free(bounce.data);
    return NULL;
}

static void stop_readers(Pool *pool) { /* GIL released: the queued ranges are read first */
    pthread_mutex_lock(&pool->lock);
    pool->stopping = 1;
    pthread_cond_broadcast(&pool->work);
    pthread_mutex_unlock(&pool->lock);
    for (int i = 0; i < pool->nthreads; i++) pthread_join(pool->threads[i], NULL);
    pool->nthreads = 0;
}

static int Pool_init(Pool *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"fd", "buffered_fd", "threads", "latency_ns", NULL};
    int threads;
    long long latency;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iiiL", names, &self->fd, &self->buffered_fd, &threads, &latency))
        return -1;
    if (self->threads != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is already running");
        return -1;
    }
    if (threads <= 0) {
        PyErr_Format(PyExc_ValueError, "threads must be positive, got %d", threads);
        return -1;
    }
    self->direct = self->buffered_fd >= 0;
    self->latency_ns = latency;
    pthread_mutex_init(&self->lock, NULL);
    pthread_cond_init(&self->work, NULL);
    pthread_cond_init(&self->room, NULL);
    self->threads = PyMem_Calloc((size_t)threads, sizeof(pthread_t));
    if (self->threads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < threads; i++) {
        int status = pthread_create(&self->threads[i], NULL, reader, self);
        if (status != 0) {
            Py_BEGIN_ALLOW_THREADS
            stop_readers(self);
            Py_END_ALLOW_THREADS
            self->closed = 1;
            errno = status;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->nthreads = i + 1;
    }
    return 0;
}

static PyObject *Pool_close(Pool *self, PyObject *unused) {
    (void)unused;
    if (self->threads != NULL && !self->closed) {
        self->closed = 1;
        Py_BEGIN_ALLOW_THREADS
        stop_readers(self);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static void Pool_dealloc(Pool *self) {
    Py_XDECREF(Pool_close(self, NULL));
    if (self->threads != NULL) {
        PyMem_Free(self->threads);
        pthread_cond_destroy(&self->room);
        pthread_cond_destroy(&self->work);
        pthread_mutex_destroy(&self->lock);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject BatchType;

static void Batch_free_arrays(Batch *b) {
    PyMem_Free(b->ranges);
    PyMem_Free(b->left);
    PyMem_Free(b->landed);
    PyMem_Free(b->error);
    PyMem_Free(b->short_done);
    PyMem_Free(b->short_size);
    PyMem_Free(b->short_offset);
    PyMem_Free(b->views);
}

static Batch *new_batch(int nranges, int nrequests) {
    Batch *b = PyObject_New(Batch, &BatchType);
    if (b == NULL) return NULL;
    size_t n = (size_t)(nrequests > 0 ? nrequests : 1);
    b->ranges = PyMem_Calloc((size_t)(nranges > 0 ? nranges : 1), sizeof(Range));
    b->left = PyMem_Calloc(n, sizeof(int));
    b->landed = PyMem_Calloc(n, sizeof(int));
    b->error = PyMem_Calloc(n, sizeof(int));
    b->short_done = PyMem_Calloc(n, sizeof(int64_t));
    b->short_size = PyMem_Calloc(n, sizeof(int64_t));
    b->short_offset = PyMem_Calloc(n, sizeof(int64_t));
    b->views = PyMem_Calloc(n, sizeof(Py_buffer));
    b->nviews = 0;
    pthread_mutex_init(&b->lock, NULL);
    pthread_cond_init(&b->landed_cond, NULL);
    b->nranges = b->pending = 0;
    b->nrequests = nrequests;
    b->landed_count = b->handed = 0;
    if (!b->ranges || !b->left || !b->landed || !b->error || !b->short_done || !b->short_size || !b->short_offset ||
        !b->views) {
        Py_DECREF(b);
        PyErr_NoMemory();
        return NULL;
    }
    return b;
}

static int64_t item_int(PyObject *tuple, Py_ssize_t i) { return PyLong_AsLongLong(PyTuple_GET_ITEM(tuple, i)); }

/* each request's destination: a writable contiguous buffer, held by the batch */
static int hold_destinations(Batch *b, PyObject *dests) {
    for (int q = 0; q < b->nrequests; q++) {
        if (PyObject_GetBuffer(PyList_GET_ITEM(dests, q), &b->views[q], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0)
            return -1;
        b->nviews = q + 1;
    }
    return 0;
}

/* the batch's ranges from [(request, start, length)] within each request's object at `offsets` */
static int fill_ranges(Batch *b, PyObject *ranges, PyObject *offsets, int64_t priority) {
    Py_ssize_t n = PyList_GET_SIZE(ranges);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(ranges, i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3) {
            PyErr_SetString(PyExc_TypeError, "a range is (request, start, length)");
            return -1;
        }
        Range *r = &b->ranges[i];
        int64_t request = item_int(item, 0), start = item_int(item, 1);
        r->length = item_int(item, 2);
        if (PyErr_Occurred()) return -1;
        if (request < 0 || request >= b->nrequests || start < 0 || r->length < 0 ||
            start + r->length > b->views[request].len) {
            PyErr_SetString(PyExc_ValueError, "a range's request, start or length is out of bounds");
            return -1;
        }
        r->tag = PyLong_AsLongLong(PyList_GET_ITEM(offsets, request));
        if (r->tag == -1 && PyErr_Occurred()) return -1;
        r->offset = r->tag + start;
        r->dest = (uint8_t *)b->views[request].buf + start;
        r->room = b->views[request].len - start;
        r->request = (int)request;
        r->priority = priority;
        r->batch = b;
        b->left[request]++;
    }
    b->nranges = b->pending = (int)n;
    for (int q = 0; q < b->nrequests; q++)
        if (b->left[q] == 0) b->landed[b->landed_count++] = q; /* nothing to read */
    return 0;
}

/* queue the batch's ranges; the GIL is released only while the queue is full (the readers never take
 * the GIL, and they hold the pool's lock only to take a range: releasing it for a short hold would let
 * another Python thread take it, and getting it back can cost a switch interval, 5 ms) */
static void enqueue(Pool *pool, Batch *b) {
    pthread_mutex_lock(&pool->lock);
    for (int i = 0; i < b->nranges; i++) {
        if (pool->queued == QUEUE_CAPACITY && !pool->stopping) { /* the lock is not held taking the GIL */
            pthread_mutex_unlock(&pool->lock);
            Py_BEGIN_ALLOW_THREADS
            pthread_mutex_lock(&pool->lock);
            while (pool->queued == QUEUE_CAPACITY && !pool->stopping) pthread_cond_wait(&pool->room, &pool->lock);
            pthread_mutex_unlock(&pool->lock);
            Py_END_ALLOW_THREADS
            pthread_mutex_lock(&pool->lock);
            if (pool->queued == QUEUE_CAPACITY && !pool->stopping) { /* filled again meanwhile */
                i--;
                continue;
            }
        }
        if (pool->stopping) { /* closed meanwhile: no reader will take it */
            pthread_mutex_unlock(&pool->lock);
            complete(&b->ranges[i], failed(ECANCELED));
            pthread_mutex_lock(&pool->lock);
            continue;
        }
        b->ranges[i].seq = pool->seq++;
        pool->queue[pool->queued++] = &b->ranges[i];
        pthread_cond_signal(&pool->work);
    }
    pthread_mutex_unlock(&pool->lock);
}

/* submit(ranges, offsets, destinations, priority, read_here) -> Batch: queue every range (request,
 * start, length) of the objects at pack `offsets` read into `destinations` (writable contiguous buffers,
 * held until every range is done), or with read_here and a single range, read it in this thread
 * (GIL released) */
static PyObject *Pool_submit(Pool *self, PyObject *args) {
    PyObject *ranges, *offsets, *dests;
    int read_here;
    long long priority;
    if (!PyArg_ParseTuple(args, "O!O!O!Lp", &PyList_Type, &ranges, &PyList_Type, &offsets, &PyList_Type, &dests,
                          &priority, &read_here))
        return NULL;
    if (self->threads == NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "the pack's reader pool is closed");
        return NULL;
    }
    if (PyList_GET_SIZE(offsets) != PyList_GET_SIZE(dests) || PyList_GET_SIZE(dests) > INT32_MAX ||
        PyList_GET_SIZE(ranges) > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "submit: offsets and destinations differ in length");
        return NULL;
    }
    Batch *b = new_batch((int)PyList_GET_SIZE(ranges), (int)PyList_GET_SIZE(dests));
    if (b == NULL) return NULL;
    if (hold_destinations(b, dests) != 0 || fill_ranges(b, ranges, offsets, priority) != 0) {
        b->pending = 0;
        Py_DECREF(b);
        return NULL;
    }
    if (read_here && b->nranges == 1) {
        Py_BEGIN_ALLOW_THREADS
        Bounce bounce = {NULL, 0};
        run_range(self, &b->ranges[0], &bounce);
        free(bounce.data);
        Py_END_ALLOW_THREADS
    } else {
        enqueue(self, b);
    }
    return (PyObject *)b;
}

static PyObject *Pool_hurry(Pool *self, PyObject *args) {
    long long tag, priority;
    if (!PyArg_ParseTuple(args, "LL", &tag, &priority)) return NULL;
    int raised = 0;
    pthread_mutex_lock(&self->lock); /* held for a scan of at most QUEUE_CAPACITY entries */
    for (int i = 0; i < self->queued; i++) {
        Range *r = self->queue[i];
        if (r->tag == tag && r->priority > priority) {
            r->priority = priority;
            r->seq = self->seq++;
            raised++;
        }
    }
    pthread_mutex_unlock(&self->lock);
    return PyLong_FromLong(raised);
}

static PyObject *Pool_queued(Pool *self, PyObject *args) {
    long long tag;
    if (!PyArg_ParseTuple(args, "L", &tag)) return NULL;
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    pthread_mutex_lock(&self->lock);
    int status = 0;
    for (int i = 0; i < self->queued && status == 0; i++)
        if (self->queue[i]->tag == tag) {
            PyObject *priority = PyLong_FromLongLong(self->queue[i]->priority);
            status = priority == NULL ? -1 : PyList_Append(found, priority);
            Py_XDECREF(priority);
        }
    pthread_mutex_unlock(&self->lock);
    if (status != 0) Py_CLEAR(found);
    return found;
}

static PyObject *Pool_pause(Pool *self, PyObject *arg) {
    int paused = PyObject_IsTrue(arg);
    if (paused < 0) return NULL;
    pthread_mutex_lock(&self->lock);
    self->paused = paused;
    pthread_cond_broadcast(&self->work);
    pthread_mutex_unlock(&self->lock);
    Py_RETURN_NONE;
}

static PyObject *Pool_direct_refused(Pool *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLong(__atomic_load_n(&self->refused, __ATOMIC_RELAXED));
}

static PyObject *Pool_bounced(Pool *self, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(__atomic_load_n(&self->bounced, __ATOMIC_RELAXED));
}

static PyMethodDef Pool_methods[] = {
    {"submit", (PyCFunction)Pool_submit, METH_VARARGS,
     "submit(ranges, offsets, destinations, priority, read_here) -> Batch; a range is (request, start, length) "
     "of the object at offsets[request], read into destinations[request] at start"},
    {"hurry", (PyCFunction)Pool_hurry, METH_VARARGS,
     "hurry(tag, priority) -> how many queued ranges of `tag` were raised to `priority`"},
    {"queued", (PyCFunction)Pool_queued, METH_VARARGS, "queued(tag) -> the priorities of its queued ranges"},
    {"pause", (PyCFunction)Pool_pause, METH_O, "pause(flag): while set, no reader takes a queued range"},
    {"direct_refused", (PyCFunction)Pool_direct_refused, METH_NOARGS,
     "the errno that turned O_DIRECT reads off (0: none)"},
    {"bounced", (PyCFunction)Pool_bounced, METH_NOARGS, "direct reads made through a bounce buffer"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "read what is queued, then stop the readers"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "k3stream.store._pack_reads.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(fd, buffered_fd, threads, latency_ns): reader pthreads over one bounded priority queue",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
};

/* ---- a batch's waits ------------------------------------------------------------------------- */

static void wait_for(Batch *b, int (*done)(Batch *, int), int q) { /* GIL released */
    pthread_mutex_lock(&b->lock);
    while (!done(b, q)) pthread_cond_wait(&b->landed_cond, &b->lock);
    pthread_mutex_unlock(&b->lock);
}

static int request_done(Batch *b, int q) { return b->left[q] == 0; }
static int all_done(Batch *b, int q) { return (void)q, b->pending == 0; }
static int one_landed(Batch *b, int q) { return (void)q, b->landed_count > b->handed; }

static PyObject *Batch_next_landed(Batch *self, PyObject *unused) {
    (void)unused;
    if (self->handed == self->nrequests) return PyLong_FromLong(-1);
    Py_BEGIN_ALLOW_THREADS
    wait_for(self, one_landed, 0);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(self->landed[self->handed++]);
}

static PyObject *Batch_wait(Batch *self, PyObject *arg) {
    long q = PyLong_AsLong(arg);
    if (q == -1 && PyErr_Occurred()) return NULL;
    if (q < 0 || q >= self->nrequests) {
        PyErr_Format(PyExc_IndexError, "request %ld of %d", q, self->nrequests);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    wait_for(self, request_done, (int)q);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Batch_wait_all(Batch *self, PyObject *unused) {
    (void)unused;
    Py_BEGIN_ALLOW_THREADS
    wait_for(self, all_done, 0);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Batch_error(Batch *self, PyObject *arg) {
    long q = PyLong_AsLong(arg);
    if (q == -1 && PyErr_Occurred()) return NULL;
    if (q < 0 || q >= self->nrequests) {
        PyErr_Format(PyExc_IndexError, "request %ld of %d", q, self->nrequests);
        return NULL;
    }
    pthread_mutex_lock(&self->lock);
    int error = self->left[q] == 0 ? self->error[q] : 0;
    pthread_mutex_unlock(&self->lock);
    if (!error) Py_RETURN_NONE;
    return Py_BuildValue("(iLLL)", error, (long long)self->short_done[q], (long long)self->short_size[q],
                         (long long)self->short_offset[q]);
}

static PyObject *Batch_times(Batch *self, PyObject *unused) {
    (void)unused;
    PyObject *times = PyList_New(self->nranges);
    if (times == NULL) return NULL;
    for (int i = 0; i < self->nranges; i++) {
        Range *r = &self->ranges[i];
        PyObject *item = Py_BuildValue("(iLL)", r->request, (long long)r->started_ns, (long long)r->ended_ns);
        if (item == NULL) {
            Py_DECREF(times);
            return NULL;
        }
        PyList_SET_ITEM(times, i, item);
    }
    return times;
}

static void Batch_dealloc(Batch *self) {
    if (self->pending > 0) { /* a range still queued or running writes into a held destination */
        Py_BEGIN_ALLOW_THREADS
        wait_for(self, all_done, 0);
        Py_END_ALLOW_THREADS
    }
    for (int q = 0; q < self->nviews; q++) PyBuffer_Release(&self->views[q]);
    Batch_free_arrays(self);
    pthread_cond_destroy(&self->landed_cond);
    pthread_mutex_destroy(&self->lock);
    PyObject_Free(self);
}

static PyMethodDef Batch_methods[] = {
    {"next_landed", (PyCFunction)Batch_next_landed, METH_NOARGS,
     "the next request whose ranges are all done, in the order they finish (-1 once all were handed)"},
    {"wait", (PyCFunction)Batch_wait, METH_O, "wait(request): until its ranges are done"},
    {"wait_all", (PyCFunction)Batch_wait_all, METH_NOARGS, "until every range is done"},
    {"error", (PyCFunction)Batch_error, METH_O,
     "error(request) -> None or (errno, bytes read, size, offset) of its failed range (bytes read: -1 "
     "unless a short read)"},
    {"times", (PyCFunction)Batch_times, METH_NOARGS,
     "[(request, started ns, ended ns)] of each range, CLOCK_MONOTONIC (time.perf_counter_ns's clock)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "k3stream.store._pack_reads.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "the ranges one Pool.submit queued",
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_methods = Batch_methods,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack_reads", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__pack_reads(void) {
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&BatchType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0) {
        Py_DECREF(&PoolType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
