/* The small-message exchange of the shared-memory rings, compiled: put one whole message on
 * each of some links, wait (spinning, or yielding the core) for one on each of others, and for
 * an all_reduce fold them in rank order where they lie.
 *
 * It speaks exactly the ring protocol of gpucoll/transport/shm.py (same counters, the same
 * skip-to-the-ring's-start rule, messages 16-byte aligned), so a rank using it and a rank on
 * the pure-Python path interoperate. The link positions stay the Python ShmLink's attributes
 * (`_head`, `_pos`), read and written here, so the general path sees what this code did.
 * Unlike the Python path it orders memory with explicit release/acquire atomics.
 *
 * Each link's `native` attribute is a Link object: it holds buffer exports of the two ring
 * mappings, so a mapping cannot be unmapped (mmap.close raises BufferError) while a Link that
 * points into it is alive.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define HEADER 256 /* bytes of counters before a ring's data; slots as in shm.py */
#define HEAD 0
#define TX_SLEEP 1
#define TAIL 16
#define RX_SLEEP 17
#define MAX_LINKS 256
#define WHOLE (1 << 20) /* the largest message that never wraps (shm.py's WHOLE) */

typedef struct {
    PyObject_HEAD
    Py_buffer tx, rx;
    int64_t *tx_ctl, *rx_ctl;
    char *tx_data, *rx_data;
    int64_t tx_cap, rx_cap;
} Link;

static void Link_dealloc(Link *self) {
    if (self->tx.obj) PyBuffer_Release(&self->tx);
    if (self->rx.obj) PyBuffer_Release(&self->rx);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int map_ring(PyObject *obj, Py_buffer *view, int64_t **ctl, char **data, int64_t *cap) {
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) return -1;
    if (view->len <= HEADER || ((uintptr_t)view->buf & 7)) {
        PyBuffer_Release(view);
        view->obj = NULL;
        PyErr_SetString(PyExc_ValueError, "a ring mapping is a 256-byte header and data");
        return -1;
    }
    *ctl = (int64_t *)view->buf;
    *data = (char *)view->buf + HEADER;
    *cap = view->len - HEADER;
    return 0;
}

static int Link_init(Link *self, PyObject *args, PyObject *kwds) {
    PyObject *tx, *rx;
    if (self->tx.obj || self->rx.obj) {
        PyErr_SetString(PyExc_TypeError, "Link is initialised once");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "OO:Link", &tx, &rx)) return -1;
    if (map_ring(tx, &self->tx, &self->tx_ctl, &self->tx_data, &self->tx_cap) < 0) return -1;
    if (map_ring(rx, &self->rx, &self->rx_ctl, &self->rx_data, &self->rx_cap) < 0) {
        PyBuffer_Release(&self->tx);
        self->tx.obj = NULL;
        return -1;
    }
    return 0;
}

static PyTypeObject LinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpucoll.transport._shmfast.Link",
    .tp_doc = PyDoc_STR("Link(tx_mmap, rx_mmap): raw views of one link's two rings."),
    .tp_basicsize = sizeof(Link),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Link_init,
    .tp_dealloc = (destructor)Link_dealloc,
};

static PyObject *s_native, *s_head, *s_pos, *s_bell, *s_peer;

/* fold codes: op * 16 + type (gpucoll/backends/ring.py's NATIVE_FOLD builds the same) */
enum { F_SUM, F_PROD, F_MIN, F_MAX, F_BAND, F_BOR, F_BXOR, F_OPS };
enum { T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64, T_F32, T_F64, T_TYPES };

/* out[i] = v0[i] op v1[i] op ... op v(n-1)[i], left to right: the order every rank uses, so
   all ranks get the same bits. U is the unsigned twin used for wrapping integer arithmetic.
   A block at a time: every value's block is read before out's is written (out may be any of
   them), and each pass is a plain loop over elements, which the compiler turns into vector
   instructions (one loop over the values for each element would not vectorise). */
#define FOLD_BLOCK 1024
#define FOLD(T, U, EXPR)                                                                     \
    do {                                                                                     \
        T acc[FOLD_BLOCK];                                                                   \
        for (Py_ssize_t s = 0; s < count; s += FOLD_BLOCK) {                                 \
            Py_ssize_t m = count - s < FOLD_BLOCK ? count - s : FOLD_BLOCK;                  \
            memcpy(acc, (const T *)vals[0] + s, m * sizeof(T));                              \
            for (int k = 1; k < nvals; k++) {                                                \
                const T *v = (const T *)vals[k] + s;                                         \
                for (Py_ssize_t i = 0; i < m; i++) {                                         \
                    T a = acc[i], b = v[i];                                                  \
                    acc[i] = (EXPR);                                                         \
                }                                                                            \
            }                                                                                \
            memcpy((T *)out + s, acc, m * sizeof(T));                                        \
        }                                                                                    \
    } while (0)

#define INT_OPS(T, U)                                                                        \
    switch (op) {                                                                            \
    case F_SUM: FOLD(T, U, (T)((U)a + (U)b)); return 0;                                      \
    case F_PROD: FOLD(T, U, (T)((U)a * (U)b)); return 0;                                     \
    case F_MIN: FOLD(T, U, b < a ? b : a); return 0;                                         \
    case F_MAX: FOLD(T, U, b > a ? b : a); return 0;                                         \
    case F_BAND: FOLD(T, U, a & b); return 0;                                                \
    case F_BOR: FOLD(T, U, a | b); return 0;                                                 \
    case F_BXOR: FOLD(T, U, a ^ b); return 0;                                                \
    }                                                                                        \
    return -1

#define FLOAT_OPS(T)                                                                         \
    switch (op) {                                                                            \
    case F_SUM: FOLD(T, T, a + b); return 0;                                                 \
    case F_PROD: FOLD(T, T, a * b); return 0;                                                \
    }                                                                                        \
    return -1

/* Fold the ``nvals`` arrays of ``count`` elements into ``out`` (which may be one of them);
   -1 for a code it does not know (min and max of floats stay with NumPy's NaN rules). */
static int fold(int code, char *out, const char *const *vals, int nvals, Py_ssize_t count) {
    int op = code / 16;
    switch (code % 16) {
    case T_I8: INT_OPS(int8_t, uint8_t);
    case T_U8: INT_OPS(uint8_t, uint8_t);
    case T_I16: INT_OPS(int16_t, uint16_t);
    case T_U16: INT_OPS(uint16_t, uint16_t);
    case T_I32: INT_OPS(int32_t, uint32_t);
    case T_U32: INT_OPS(uint32_t, uint32_t);
    case T_I64: INT_OPS(int64_t, uint64_t);
    case T_U64: INT_OPS(uint64_t, uint64_t);
    case T_F32: FLOAT_OPS(float);
    case T_F64: FLOAT_OPS(double);
    }
    return -1;
}

static const Py_ssize_t ITEM_SIZE[T_TYPES] = {1, 1, 2, 2, 4, 4, 8, 8, 4, 8};

/* One side of one link during a call: where it is, and its raw ring pointers. */
typedef struct {
    Link *native;
    PyObject *link;
    int64_t pos; /* _head when sending, _pos when receiving */
    int done;
} Side;

static int64_t skip_wrap(int64_t pos, int64_t n, int64_t cap) {
    return pos % cap + n <= cap ? pos : pos + cap - pos % cap;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t align16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static int load_sides(PyObject *seq, Side *sides, Py_ssize_t *count, int sending) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_LINKS) {
        PyErr_SetString(PyExc_ValueError, "too many links");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *link = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *native = PyObject_GetAttr(link, s_native);
        if (!native) return -1;
        if (!PyObject_TypeCheck(native, &LinkType)) {
            Py_DECREF(native);
            PyErr_SetString(PyExc_TypeError, "link.native is not a Link");
            return -1;
        }
        PyObject *pos = PyObject_GetAttr(link, sending ? s_head : s_pos);
        long long v = pos ? PyLong_AsLongLong(pos) : -1;
        Py_XDECREF(pos);
        sides[i].native = (Link *)native; /* owned until release_sides */
        sides[i].link = link;
        sides[i].pos = v;
        sides[i].done = 0;
        *count = i + 1;
        if (v == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

static void release_sides(Side *sides, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(sides[i].native);
}

static int set_pos(Side *s, int sending) {
    PyObject *v = PyLong_FromLongLong(s->pos);
    if (!v) return -1;
    int rc = PyObject_SetAttr(s->link, sending ? s_head : s_pos, v);
    Py_DECREF(v);
    return rc;
}

static void ring_bell(PyObject *link) {
    PyObject *bell = PyObject_GetAttr(link, s_bell);
    long fd = bell ? PyLong_AsLong(bell) : -1;
    Py_XDECREF(bell);
    PyErr_Clear();
    if (fd >= 0) {
        uint64_t one = 1;
        ssize_t rc = write((int)fd, &one, sizeof one); /* a gone peer: its monitor reports it */
        (void)rc;
    }
}

/* Hand each received message's space back to its sender: one counter store per link. */
static int release_all(Side *rx, Py_ssize_t nrx, int64_t n) {
    for (Py_ssize_t i = 0; i < nrx; i++) {
        Link *l = rx[i].native;
        rx[i].pos = align16(rx[i].pos + n);
        __atomic_store_n(&l->rx_ctl[TAIL], rx[i].pos, __ATOMIC_RELEASE);
        if (set_pos(&rx[i], 0) < 0) return -1;
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(&l->rx_ctl[TX_SLEEP], __ATOMIC_RELAXED)) ring_bell(rx[i].link);
    }
    return 0;
}

/* Whether fold() has a loop for ``code``. */
static int fold_known(long code) {
    long op = code / 16, type = code % 16;
    if (code < 0 || op >= F_OPS || type >= T_TYPES) return 0;
    return type < T_F32 || op == F_SUM || op == F_PROD;
}

/* Fold x with the received values in rank order, in place in x (``code`` is known good). */
static int fold_in_rank_order(long rank, long code, Side *rx, Py_ssize_t nrx, Py_buffer *x,
                              int64_t hdr_len) {
    const char *vals[MAX_LINKS + 1];
    long ranks[MAX_LINKS + 1];
    int nvals = 0;
    for (Py_ssize_t i = 0; i <= nrx; i++) {
        long r = rank;
        const char *v = x->buf;
        if (i < nrx) {
            PyObject *peer = PyObject_GetAttr(rx[i].link, s_peer);
            r = peer ? PyLong_AsLong(peer) : -1;
            Py_XDECREF(peer);
            if (r == -1 && PyErr_Occurred()) return -1;
            v = rx[i].native->rx_data + rx[i].pos % rx[i].native->rx_cap + hdr_len;
        }
        int k = nvals++; /* insertion sort by rank */
        for (; k > 0 && ranks[k - 1] > r; k--) {
            ranks[k] = ranks[k - 1];
            vals[k] = vals[k - 1];
        }
        ranks[k] = r;
        vals[k] = v;
    }
    Py_ssize_t count = x->len / ITEM_SIZE[code % 16];
    if (x->len > (64 << 10)) {
        Py_BEGIN_ALLOW_THREADS
        fold((int)code, x->buf, vals, nvals, count);
        Py_END_ALLOW_THREADS
    } else {
        fold((int)code, x->buf, vals, nvals, count);
    }
    return 0;
}

/* Wait for the message on every link of rx (GIL released): spin for spin_ns, then yield the
   core between looks for yield_ns (sleeping is left to the caller's loop: on shared cores a
   wake-up through the doorbell costs more than yielding). Returns how many links still
   lack their message. */
static Py_ssize_t await_all(Side *rx, Py_ssize_t nrx, int64_t n, int64_t spin_ns,
                            int64_t yield_ns) {
    Py_ssize_t left = nrx;
    int64_t start = now_ns();
    int yielding = spin_ns <= 0;
    for (long k = 0;; k++) {
        for (Py_ssize_t i = 0; i < nrx; i++) {
            Link *l = rx[i].native;
            if (!rx[i].done &&
                __atomic_load_n(&l->rx_ctl[HEAD], __ATOMIC_ACQUIRE) - rx[i].pos >= n) {
                rx[i].done = 1;
                left--;
            }
        }
        if (!left) return 0;
        if (yielding || k % 64 == 63) { /* the clock, read every 64 pauses while spinning */
            int64_t idle = now_ns() - start;
            if (idle >= spin_ns + yield_ns) break;
            yielding = idle >= spin_ns;
        }
        if (yielding)
            sched_yield();
        else
            CPU_RELAX();
    }
    return left;
}

/* Whether a message of n bytes is a small one, which never wraps in a ring of cap bytes
   (shm.py's rule); if not, a ValueError is set. */
static int small_enough(int64_t n, int64_t cap) {
    if (n <= WHOLE && 2 * n <= cap) return 1;
    PyErr_SetString(PyExc_ValueError, "a message larger than a small one (shm.WHOLE, half a ring)");
    return 0;
}

/* The payload: one buffer for every link (into which a fold writes), or a list of one per
   link of send_to, all the same size (``payload`` then holds the first, for its size). */
static int load_parts(PyObject *arg, int folding, Py_ssize_t ntx, Py_buffer *payload,
                      Py_buffer *parts, Py_ssize_t *nparts) {
    if (!PyList_Check(arg) && !PyTuple_Check(arg))
        return PyObject_GetBuffer(arg, payload, folding ? PyBUF_WRITABLE : PyBUF_SIMPLE);
    if (folding || PySequence_Fast_GET_SIZE(arg) != ntx || ntx == 0) {
        PyErr_SetString(PyExc_ValueError, "a list of payloads has one per link to send to "
                                          "(and no fold)");
        return -1;
    }
    for (Py_ssize_t i = 0; i < ntx; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(arg, i), &parts[i], PyBUF_SIMPLE) < 0)
            return -1;
        *nparts = i + 1;
        if (parts[i].len != parts[0].len) {
            PyErr_SetString(PyExc_ValueError, "the payloads differ in size");
            return -1;
        }
    }
    payload->len = parts[0].len;
    return 0;
}

/* swap(send_to, recv_from, payload, hdr, fold, spin_ns, yield_ns) */
static PyObject *swap(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    Side tx[MAX_LINKS], rx[MAX_LINKS];
    Py_ssize_t ntx = 0, nrx = 0;
    Py_buffer payload = {0}, hdr = {0}, parts[MAX_LINKS];
    Py_ssize_t nparts = 0;
    PyObject *send_seq = NULL, *recv_seq = NULL, *result = NULL;
    long long spin_ns, yield_ns;

    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "swap(send_to, recv_from, payload, hdr, fold, "
                                         "spin_ns, yield_ns)");
        return NULL;
    }
    long rank = -1, code = -1;
    int folding = args[4] != Py_None;
    if (folding && !PyArg_ParseTuple(args[4], "ll:fold", &rank, &code)) return NULL;
    if (folding && !fold_known(code)) {
        PyErr_Format(PyExc_ValueError, "no compiled fold for code %ld", code);
        return NULL;
    }
    spin_ns = PyLong_AsLongLong(args[5]);
    yield_ns = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    send_seq = PySequence_Fast(args[0], "send_to must be a sequence");
    recv_seq = send_seq ? PySequence_Fast(args[1], "recv_from must be a sequence") : NULL;
    if (!recv_seq) goto out;
    if (PyObject_GetBuffer(args[3], &hdr, PyBUF_SIMPLE) < 0) goto out;
    if (load_sides(send_seq, tx, &ntx, 1) < 0 || load_sides(recv_seq, rx, &nrx, 0) < 0) goto out;
    if (load_parts(args[2], folding, ntx, &payload, parts, &nparts) < 0) goto out;
    const int64_t n = (int64_t)(hdr.len + payload.len);

    /* begin: a message that would wrap starts at the ring's start instead (as shm.py) */
    for (Py_ssize_t i = 0; i < ntx; i++) {
        Link *l = tx[i].native;
        if (!small_enough(n, l->tx_cap)) goto out;
        tx[i].pos = skip_wrap(tx[i].pos, n, l->tx_cap);
        if (l->tx_cap - (tx[i].pos - __atomic_load_n(&l->tx_ctl[TAIL], __ATOMIC_ACQUIRE)) < n) {
            result = Py_False; /* no room on every link: nothing is sent */
            Py_INCREF(result);
            goto out;
        }
    }
    for (Py_ssize_t i = 0; i < nrx; i++) {
        Link *l = rx[i].native;
        if (!small_enough(n, l->rx_cap)) goto out;
        int64_t p = skip_wrap(rx[i].pos, n, l->rx_cap);
        if (p != rx[i].pos) {
            rx[i].pos = p;
            __atomic_store_n(&l->rx_ctl[TAIL], p, __ATOMIC_RELEASE);
        }
        if (set_pos(&rx[i], 0) < 0) goto out;
    }
    for (Py_ssize_t i = 0; i < ntx; i++) {
        Link *l = tx[i].native;
        char *at = l->tx_data + tx[i].pos % l->tx_cap;
        memcpy(at, hdr.buf, hdr.len);
        memcpy(at + hdr.len, nparts ? parts[i].buf : payload.buf, payload.len);
        __atomic_store_n(&l->tx_ctl[HEAD], tx[i].pos + n, __ATOMIC_RELEASE);
        tx[i].pos = align16(tx[i].pos + n);
        if (set_pos(&tx[i], 1) < 0) goto out;
        /* the head store must be seen before the sleep flag is read (a receiver sets its flag,
           then reads head): a full fence, which x86's store order alone does not give */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        if (__atomic_load_n(&l->tx_ctl[RX_SLEEP], __ATOMIC_RELAXED)) ring_bell(tx[i].link);
    }

    Py_ssize_t left;
    Py_BEGIN_ALLOW_THREADS
    left = await_all(rx, nrx, n, spin_ns, yield_ns);
    Py_END_ALLOW_THREADS
    for (Py_ssize_t i = 0; !left && i < nrx; i++) {
        Link *l = rx[i].native;
        if (memcmp(l->rx_data + rx[i].pos % l->rx_cap, hdr.buf, hdr.len) != 0) left = 1;
    }
    if (left) {
        result = Py_None; /* sent; the caller waits for the rest, or reports another call's
                             header */
        Py_INCREF(result);
        goto out;
    }
    if (folding) {
        if (fold_in_rank_order(rank, code, rx, nrx, &payload, hdr.len) < 0 ||
            release_all(rx, nrx, n) < 0)
            goto out;
        result = Py_True;
        Py_INCREF(result);
        goto out;
    }
    result = PyList_New(nrx);
    for (Py_ssize_t i = 0; result && i < nrx; i++) {
        PyObject *v = PyLong_FromLongLong(rx[i].pos % rx[i].native->rx_cap + hdr.len);
        if (!v) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, v);
    }
out:
    release_sides(tx, ntx);
    release_sides(rx, nrx);
    if (payload.obj) PyBuffer_Release(&payload);
    for (Py_ssize_t i = 0; i < nparts; i++) PyBuffer_Release(&parts[i]);
    if (hdr.obj) PyBuffer_Release(&hdr);
    Py_XDECREF(send_seq);
    Py_XDECREF(recv_seq);
    return result;
}

static PyMethodDef methods[] = {
    {"swap", (PyCFunction)(void (*)(void))swap, METH_FASTCALL,
     PyDoc_STR("swap(send_to, recv_from, payload, hdr, fold, spin_ns, yield_ns)\n\n"
               "Put hdr + payload whole on every link of send_to (payload: one buffer, or a "
               "list of one per link, all the same size), then wait (spinning for "
               "spin_ns, then yielding the core for yield_ns) for a message of the same size "
               "on every link of recv_from. Returns the payload offsets in "
               "the receive rings when all arrived with this header; None when sent but not "
               "all arrived (or a header differs); False when a ring had no room (nothing "
               "sent). With fold=(rank, code), the payload (writable) becomes the fold of "
               "every rank's values in rank order and the messages are released: True.")},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shmfast",
    "The shared-memory rings' small-message exchange, compiled (see shm.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__shmfast(void) {
    if (PyType_Ready(&LinkType) < 0) return NULL;
    s_native = PyUnicode_InternFromString("native");
    s_head = PyUnicode_InternFromString("_head");
    s_pos = PyUnicode_InternFromString("_pos");
    s_bell = PyUnicode_InternFromString("bell");
    s_peer = PyUnicode_InternFromString("peer");
    if (!s_native || !s_head || !s_pos || !s_bell || !s_peer) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&LinkType);
    if (PyModule_AddObject(m, "Link", (PyObject *)&LinkType) < 0) {
        Py_DECREF(&LinkType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
