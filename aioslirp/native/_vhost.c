/* The CPython binding of aioslirp's vhost-user-net rings (limited API 3.11, abi3): a thin layer
 * over vring.c. The vhost-user messages are Python (aioslirp/transport/vhost_user.py); this
 * module holds guest memory (mmapped here) and the two queues, and moves the frames.
 *
 *   Device(max_frame, batch)                       one front end's device (queue 0 RX, 1 TX)
 *     .set_mem_table([(gpa, size, uva, mmap_offset, fd), ...])   mmap (the fds stay the caller's)
 *     .set_num(q, num) / .set_addr(q, desc, used, avail) / .set_base(q, base) / .get_base(q)
 *     .set_call(q, fd) / .set_features(hdr_len, mrg, event_idx) / .reset()
 *     .tx(kick_fd) -> (frames, csum_ok, more)      up to batch guest frames, one call signalled; more:
 *                                                  0 none left (a kick asked for), 1 more now, 2 a
 *                                                  bulk walk that asked for no kick (set_tx_coalesce),
 *                                                  3 a call waits (set_tx_defer): walk again after it
 *     .rx(frames, start) -> (next, state, delivered)  frames[start:] into guest buffers
 *     .rx_kick_me(kick_fd) -> bool                 ask for a kick on new RX buffers; any now?
 *     .broken(q) -> str | None, .counters() -> dict
 *     .queue_state(q) -> dict                      indexes and notification words now (a stall's dump)
 *     .tcp_sink() -> capsule                      the frame sink for TcpEngine(sink=...) (tcpsink.h):
 *                                                  frames copied in (write), or written in place
 *                                                  (reserve/commit/release: the engine peeks a host
 *                                                  socket into the RX buffers, one copy)
 *     .set_rx_direct(on)                           in place when the ring allows (default), or never
 *     .attach_tcp(engine, max_buffer) / .attach_tcp(None)   guest frames of native TCP flows go to
 *                                                  the engine in tx(), before any Python object
 *
 * MIT licensed, written for aioslirp. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dataplane.h" /* (dp_reorders_later) */
#include "vring.h"
#include "tcpsink.h"

#define RX 0
#define TX 1

/* A TX walk that took fewer bytes than this may defer its call (set_tx_defer): ACKs, handshakes,
 * requests. More (a write of the guest's TCP) is completed at once: its socket may be held by TCP
 * Small Queues until the buffers come back. */
#define TX_DEFER_BYTES 4096

/* The most pieces of a guest frame handed to the engine in place (frame_zc; TN_GATHER_MAX) */
#define ZC_PIECES 64

/* rx() states */
#define RX_DONE 0
#define RX_WAITING 1 /* the guest has no buffers for frames[next]: wait for its kick */
#define RX_BROKEN 2

typedef struct {
    PyObject_HEAD
    struct vr_mem mem;
    struct vr_queue q[2];
    int callfd[2];
    size_t max_frame;
    unsigned batch;
    size_t hdr_len;
    int mrg;
    struct vr_counters c;
    uint64_t tx_frames, rx_frames, calls, kicks, rx_dropped;
    int guest_csum, guest_tso4, guest_tso6; /* what the driver accepted (GUEST_CSUM, GUEST_TSO4/6) */
    /* the native TCP engine (tcpsink.h): its frames come through sink, guest frames go to eng */
    struct tcpsink sink;
    PyObject *tcp;                  /* the TcpEngine (held while attached) */
    const struct tcpnat_api *api;
    void *eng;
    uint8_t *scratch;               /* max_frame bytes: a guest frame copied out for the engine */
    struct rxq *rxq_head, *rxq_tail; /* the engine's frames waiting for RX buffers, in order */
    size_t rxq_bytes, rxq_max;
    int rx_due;                     /* used entries pushed for the engine since the last call */
    uint64_t tcp_in, tcp_out, tcp_waited, tcp_rx_full, tcp_rx_dropped, tcp_gso_refused;
    /* the engine's frames written in place (tcpsink.h reserve/commit/release): the reservation open */
    struct vr_rsv rsv;
    int rx_direct;                  /* offered (set_rx_direct(); on by default) */
    uint64_t tcp_direct, tcp_direct_short;
    uint64_t tx_in_place; /* guest frames whose payload the engine sent from guest memory (frame_zc) */
    /* TX coalescing (set_tx_coalesce): a walk that took at least this many bytes and ended at an
     * empty ring asks for no kick; the caller walks again after a short interval (0: off) */
    size_t coalesce;
    uint64_t tx_coalesced;
    /* TX completions deferred (set_tx_defer): the call after a small walk waits up to tx_defer
     * seconds, as long as the driver still wants it (EVENT_IDX), for the guest to take the
     * buffers back by itself (Linux: the RX poll cleans the TX queue; the next transmit too) */
    double tx_defer, tx_due_since;
    int tx_call_due;
    uint64_t tx_calls_deferred, tx_calls_saved, tx_calls_late;
} Device;

/* A frame of the engine waiting for RX buffers (a copy: the engine's buffers are reused). */
struct rxq {
    struct rxq *next;
    size_t len;
    uint8_t hdr[12];
    uint8_t data[];
};

static void rxq_clear(Device *self)
{
    struct rxq *e = self->rxq_head;
    while (e) {
        struct rxq *next = e->next;
        free(e);
        e = next;
    }
    self->rxq_head = self->rxq_tail = NULL;
    self->rxq_bytes = 0;
}

static int sink_write(void *ctx, const struct iovec *iov, int n);
static void sink_flush(void *ctx);
static int sink_reserve(void *ctx, size_t head, size_t payload, struct iovec *iov, int max_iov);
static int sink_commit(void *ctx, const uint8_t *hdr, size_t hdr_len, size_t payload);
static void sink_release(void *ctx);

static void unmap_all(struct vr_mem *m)
{
    for (unsigned i = 0; i < m->n; i++)
        if (m->r[i].map)
            munmap(m->r[i].map, m->r[i].map_len);
    memset(m, 0, sizeof *m);
}

static int device_init(PyObject *op, PyObject *args, PyObject *kwargs)
{
    Device *self = (Device *)op;
    static char *kwlist[] = {"max_frame", "batch", NULL};
    Py_ssize_t max_frame, batch;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn", kwlist, &max_frame, &batch))
        return -1;
    if (max_frame < 64 || max_frame > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "max_frame must be 64..1048576 bytes");
        return -1;
    }
    if (batch < 1 || batch > 65536) {
        PyErr_SetString(PyExc_ValueError, "batch must be 1..65536");
        return -1;
    }
    unmap_all(&self->mem);
    for (int i = 0; i < 2; i++) {
        vr_queue_free(&self->q[i]);
        memset(&self->q[i], 0, sizeof self->q[i]);
        self->callfd[i] = -1;
    }
    self->max_frame = (size_t)max_frame;
    self->batch = (unsigned)batch;
    self->hdr_len = 12;
    self->mrg = 1;
    memset(&self->c, 0, sizeof self->c);
    self->tx_frames = self->rx_frames = self->calls = self->kicks = self->rx_dropped = 0;
    self->guest_csum = self->guest_tso4 = self->guest_tso6 = 1;
    self->sink.write = sink_write;
    self->sink.flush = sink_flush;
    self->sink.ctx = self;
    self->sink.reserve = sink_reserve;
    self->sink.commit = sink_commit;
    self->sink.release = sink_release;
    memset(&self->rsv, 0, sizeof self->rsv);
    self->rx_direct = 1;
    self->tcp_direct = self->tcp_direct_short = self->tx_in_place = self->tx_coalesced = 0;
    self->tx_defer = self->tx_due_since = 0.0;
    self->tx_call_due = 0;
    self->tx_calls_deferred = self->tx_calls_saved = self->tx_calls_late = 0;
    rxq_clear(self);
    free(self->scratch);
    self->scratch = NULL;
    Py_CLEAR(self->tcp);
    self->eng = NULL;
    self->rx_due = 0;
    self->rxq_max = 8u << 20;
    self->tcp_in = self->tcp_out = self->tcp_waited = self->tcp_rx_full = self->tcp_rx_dropped = 0;
    self->tcp_gso_refused = 0;
    return 0;
}

static void device_dealloc(PyObject *op)
{
    Device *self = (Device *)op;
    PyTypeObject *tp = Py_TYPE(op);
    unmap_all(&self->mem);
    vr_queue_free(&self->q[0]);
    vr_queue_free(&self->q[1]);
    rxq_clear(self);
    free(self->scratch);
    Py_CLEAR(self->tcp);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(op);
    Py_DECREF(tp);
}

static int queue_index(int q)
{
    if (q != RX && q != TX) {
        PyErr_Format(PyExc_ValueError, "vring index %d: this device has queues 0 (RX) and 1 (TX)", q);
        return -1;
    }
    return q;
}

/* set_mem_table(regions): each (gpa, size, uva, mmap_offset, fd); all mapped or none. */
static PyObject *device_set_mem_table(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    Py_ssize_t n = PySequence_Size(arg);
    if (n < 0)
        return NULL;
    if (n > (Py_ssize_t)VR_MAX_REGIONS) {
        PyErr_Format(PyExc_ValueError, "nregions: %zd regions (at most %u)", n, VR_MAX_REGIONS);
        return NULL;
    }
    struct vr_mem m;
    memset(&m, 0, sizeof m);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_GetItem(arg, i);
        if (!t)
            goto fail;
        unsigned long long gpa, size, uva, off;
        int fd;
        int ok = PyArg_ParseTuple(t, "KKKKi", &gpa, &size, &uva, &off, &fd);
        Py_DECREF(t);
        if (!ok)
            goto fail;
        if (size == 0 || off > SIZE_MAX - size || gpa + size < gpa || uva + size < uva) {
            PyErr_Format(PyExc_ValueError, "region %zd: memory_size %llu at mmap_offset %llu is not mappable", i,
                         size, off);
            goto fail;
        }
        struct stat st;
        if (fstat(fd, &st) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        if (S_ISREG(st.st_mode) && (st.st_size < 0 || (unsigned long long)st.st_size < off + size)) {
            /* past the end of the file a read is SIGBUS: refused */
            PyErr_Format(PyExc_ValueError, "region %zd: mmap_offset %llu + memory_size %llu is past the end of its "
                         "file (%lld bytes)", i, off, size, (long long)st.st_size);
            goto fail;
        }
        void *p = mmap(NULL, (size_t)(size + off), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
        if (p == MAP_FAILED) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto fail;
        }
        m.r[m.n].gpa = gpa;
        m.r[m.n].size = size;
        m.r[m.n].uva = uva;
        m.r[m.n].map = p;
        m.r[m.n].map_len = (size_t)(size + off);
        m.r[m.n].host = (uint8_t *)p + off;
        m.n++;
    }
    memset(&self->rsv, 0, sizeof self->rsv); /* (none is open between the engine's turns) */
    unmap_all(&self->mem);
    self->mem = m;
    for (int i = 0; i < 2; i++)
        vr_queue_remap(&self->q[i], &self->mem); /* a ring no longer mapped: not ready */
    Py_RETURN_NONE;
fail:
    unmap_all(&m);
    return NULL;
}

static PyObject *device_set_num(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    int q;
    unsigned int num;
    if (!PyArg_ParseTuple(args, "iI", &q, &num) || queue_index(q) < 0)
        return NULL;
    if (q == RX)
        memset(&self->rsv, 0, sizeof self->rsv);
    if (vr_queue_set_num(&self->q[q], num) < 0) {
        PyErr_Format(PyExc_ValueError, "num: %u (the queue size must be a power of 2, 1..%u)", num, VR_MAX_QUEUE);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *device_set_addr(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    int q;
    unsigned long long desc, used, avail;
    if (!PyArg_ParseTuple(args, "iKKK", &q, &desc, &used, &avail) || queue_index(q) < 0)
        return NULL;
    if (!self->q[q].num) {
        PyErr_Format(PyExc_ValueError, "vring %d: addresses before its size (SET_VRING_NUM)", q);
        return NULL;
    }
    int r = vr_queue_set_addr(&self->q[q], &self->mem, desc, used, avail);
    if (r < 0) {
        PyErr_Format(PyExc_ValueError, "vring %d: the descriptor, avail or used ring is not inside the memory "
                     "table or not aligned", q);
        return NULL;
    }
    return PyBool_FromLong(r);
}

static PyObject *device_set_base(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    int q;
    unsigned int base;
    if (!PyArg_ParseTuple(args, "iI", &q, &base) || queue_index(q) < 0)
        return NULL;
    vr_queue_set_base(&self->q[q], (uint16_t)base);
    Py_RETURN_NONE;
}

static PyObject *device_get_base(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    long q = PyLong_AsLong(arg);
    if ((q == -1 && PyErr_Occurred()) || queue_index((int)q) < 0)
        return NULL;
    return PyLong_FromLong(self->q[q].last_avail);
}

static PyObject *device_set_call(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    int q, fd;
    if (!PyArg_ParseTuple(args, "ii", &q, &fd) || queue_index(q) < 0)
        return NULL;
    self->callfd[q] = fd;
    Py_RETURN_NONE;
}

static PyObject *device_set_features(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    unsigned int hdr_len;
    int mrg, event_idx, csum = 1, tso4 = 1, tso6 = 1;
    if (!PyArg_ParseTuple(args, "Ipp|ppp", &hdr_len, &mrg, &event_idx, &csum, &tso4, &tso6))
        return NULL;
    if (hdr_len != 10 && hdr_len != 12) {
        PyErr_SetString(PyExc_ValueError, "hdr_len must be 10 or 12");
        return NULL;
    }
    self->hdr_len = hdr_len;
    self->mrg = mrg;
    self->guest_csum = csum;
    self->guest_tso4 = tso4;
    self->guest_tso6 = tso6;
    self->q[0].event_idx = self->q[1].event_idx = (uint8_t)event_idx;
    Py_RETURN_NONE;
}

static PyObject *device_reset(PyObject *op, PyObject *unused)
{
    Device *self = (Device *)op;
    (void)unused;
    unmap_all(&self->mem);
    for (int i = 0; i < 2; i++) {
        vr_queue_free(&self->q[i]);
        memset(&self->q[i], 0, sizeof self->q[i]);
        self->callfd[i] = -1;
    }
    rxq_clear(self);
    memset(&self->rsv, 0, sizeof self->rsv);
    self->rx_due = 0;
    self->tx_call_due = 0;
    Py_RETURN_NONE;
}

static void drain_eventfd(int fd)
{
    uint64_t v;
    if (fd >= 0 && read(fd, &v, sizeof v) < 0 && errno != EAGAIN && errno != EINTR) {
        /* a bad kick fd: nothing to clear; the rings are still walked */
    }
}

static void signal_call(Device *self, int qi)
{
    struct vr_queue *q = &self->q[qi];
    vr_flush(q);
    if (qi == TX)
        self->tx_call_due = 0;
    if (vr_should_call(q) && self->callfd[qi] >= 0) {
        uint64_t one = 1;
        if (write(self->callfd[qi], &one, sizeof one) == sizeof one)
            self->calls++;
    }
}

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A TX call deferred earlier, at the start of a walk: settled when the driver no longer wants it
 * (it took the buffers back by itself), signalled when it does and the deadline has passed, else
 * left waiting (the walk then ends with more == 3). */
static void tx_call_check(Device *self)
{
    struct vr_queue *q = &self->q[TX];
    if (!self->tx_call_due)
        return;
    if (!vr_queue_ready(q)) {
        self->tx_call_due = 0;
        return;
    }
    if (!vr_call_owed(q)) {
        vr_call_settle(q);
        self->tx_call_due = 0;
        self->tx_calls_saved++;
    } else if (mono_now() - self->tx_due_since >= self->tx_defer) {
        self->tx_calls_late++;
        signal_call(self, TX);
    }
}

/* After a walk that pushed used entries: their call goes now, or waits (a small walk, EVENT_IDX,
 * fewer than a quarter of the ring's entries unsignalled, the deadline not passed). */
static void tx_call_after_walk(Device *self, size_t bytes, int more)
{
    struct vr_queue *q = &self->q[TX];
    if (self->tx_defer > 0 && more == 0 && bytes < TX_DEFER_BYTES && q->event_idx && q->signalled_valid &&
        vr_queue_ready(q) && (uint16_t)(q->used_idx - q->signalled_used) < q->num / 4) {
        double now = mono_now();
        if (!self->tx_call_due || now - self->tx_due_since < self->tx_defer) {
            vr_flush(q); /* the driver may take them back without a call */
            if (!self->tx_call_due) {
                self->tx_call_due = 1;
                self->tx_due_since = now;
            }
            self->tx_calls_deferred++;
            return;
        }
        self->tx_calls_late++;
    }
    signal_call(self, TX);
}

/* ------------------------------------------------------------------ the native TCP engine's frames */

/* The engine's frames that waited, into the RX buffers the guest has made since: 1 while some
 * still wait (a kick is asked for), 0 when none does. */
static int rx_drain(Device *self)
{
    struct vr_queue *q = &self->q[RX];
    vr_rx_release(q, &self->rsv);
    while (self->rxq_head) {
        struct rxq *e = self->rxq_head;
        enum vr_pop r = vr_rx_put(q, &self->mem, self->mrg, self->hdr_len, e->hdr, e->data, e->len, &self->c);
        if (r == VR_EMPTY) {
            if (vr_kick_me(q, 1))
                continue; /* buffers came meanwhile */
            return 1;
        }
        if (r == VR_BROKEN) {
            self->tcp_rx_dropped += 1;
            rxq_clear(self);
            return 0;
        }
        self->rx_due = 1;
        if (r == VR_OK) {
            self->tcp_out++;
            self->rx_frames++;
        } else {
            self->tcp_rx_dropped++;
        }
        self->rxq_head = e->next;
        if (!self->rxq_head)
            self->rxq_tail = NULL;
        self->rxq_bytes -= e->len;
        free(e);
    }
    return 0;
}

static int rxq_add(Device *self, const uint8_t *hdr, const struct iovec *iov, unsigned n, size_t len)
{
    if (self->rxq_bytes + len > self->rxq_max) {
        self->tcp_rx_full++;
        return -ENOBUFS;
    }
    struct rxq *e = malloc(sizeof *e + len);
    if (!e) {
        self->tcp_rx_full++;
        return -ENOMEM;
    }
    e->next = NULL;
    e->len = len;
    memcpy(e->hdr, hdr, sizeof e->hdr);
    uint8_t *p = e->data;
    for (unsigned k = 0; k < n; k++) {
        memcpy(p, iov[k].iov_base, iov[k].iov_len);
        p += iov[k].iov_len;
    }
    if (self->rxq_tail)
        self->rxq_tail->next = e;
    else
        self->rxq_head = e;
    self->rxq_tail = e;
    self->rxq_bytes += len;
    self->tcp_waited++;
    return 0;
}

static uint32_t sum16(const uint8_t *p, size_t len, uint32_t s)
{
    for (; len > 1; p += 2, len -= 2)
        s += (uint32_t)(p[0] << 8 | p[1]);
    if (len)
        s += (uint32_t)(p[0] << 8);
    while (s >> 16)
        s = (s & 0xFFFF) + (s >> 16);
    return s;
}

/* A frame of the engine (iov[0] starts with its 12-byte virtio_net_hdr_v1) into the guest's RX
 * buffers, or queued (at most rxq_max bytes) until the guest makes some; the call to the guest
 * waits for sink_flush(), at the end of the engine's turn. */
static int sink_write(void *ctx, const struct iovec *iov, int n)
{
    Device *self = ctx;
    struct vr_queue *q = &self->q[RX];
    vr_rx_release(q, &self->rsv); /* (the engine released its reservation already) */
    if (n < 1 || n > 4 || iov[0].iov_len < 12)
        return -EINVAL;
    if (!vr_queue_ready(q) || q->broken) { /* no front end, or its guest broke the queue */
        self->tcp_rx_dropped++;
        return -ENOTCONN;
    }
    uint8_t hdr[12];
    memcpy(hdr, iov[0].iov_base, 12);
    hdr[10] = hdr[11] = 0;
    struct iovec v[4];
    unsigned nv = 0;
    size_t len = 0;
    for (int k = 0; k < n; k++) {
        const uint8_t *base = iov[k].iov_base;
        size_t l = iov[k].iov_len;
        if (k == 0) {
            base += 12;
            l -= 12;
        }
        if (!l)
            continue;
        v[nv].iov_base = (void *)base;
        v[nv].iov_len = l;
        nv++;
        len += l;
    }
    if (len > self->max_frame) {
        self->tcp_rx_dropped++;
        return -EMSGSIZE;
    }
    unsigned gso = hdr[1] & 0x7Fu;
    if ((gso == 1 && !self->guest_tso4) || (gso == 4 && !self->guest_tso6) || (gso && gso != 1 && gso != 4)) {
        self->tcp_gso_refused++; /* the driver takes no 64 KB segment (see the transport's notes) */
        return -EOPNOTSUPP;
    }
    if ((hdr[0] & 1) && !self->guest_csum) { /* a partial checksum the driver does not complete: here */
        if (!self->scratch && !(self->scratch = malloc(self->max_frame)))
            return -ENOMEM;
        uint8_t *f = self->scratch, *p = f;
        for (unsigned k = 0; k < nv; k++) {
            memcpy(p, v[k].iov_base, v[k].iov_len);
            p += v[k].iov_len;
        }
        uint16_t start = (uint16_t)(hdr[6] | hdr[7] << 8), off = (uint16_t)(hdr[8] | hdr[9] << 8);
        if ((size_t)start + off + 2 > len) {
            self->tcp_rx_dropped++;
            return -EINVAL;
        }
        uint16_t c = (uint16_t)~sum16(f + start, len - start, 0);
        f[start + off] = (uint8_t)(c >> 8);
        f[start + off + 1] = (uint8_t)c;
        hdr[0] &= (uint8_t)~1u;
        v[0].iov_base = f;
        v[0].iov_len = len;
        nv = 1;
    }
    if (self->rxq_head) { /* frames wait already: after them */
        int r = rxq_add(self, hdr, v, nv, len);
        if (rx_drain(self) == 0 || r < 0)
            return r;
        return 0;
    }
    enum vr_pop r = vr_rx_putv(q, &self->mem, self->mrg, self->hdr_len, hdr, v, nv, len, &self->c);
    if (r == VR_OK) {
        self->rx_due = 1;
        self->tcp_out++;
        self->rx_frames++;
        return 0;
    }
    if (r == VR_EMPTY) { /* no buffers now: keep it, ask for a kick */
        int a = rxq_add(self, hdr, v, nv, len);
        if (a < 0)
            return a;
        if (vr_kick_me(q, 1))
            rx_drain(self);
        return 0;
    }
    if (r == VR_DROPPED)
        self->rx_due = 1; /* a bad chain may have gone back */
    self->tcp_rx_dropped++;
    return -EIO;
}

/* RX buffers for one more frame of the engine, its payload written in place (tcpsink.h). Only
 * when the frame would go as it is: no frame of write() waits (they go first, in order), and the
 * driver takes partial checksums and 64 KB segments (else write() completes or refuses them). */
static int sink_reserve(void *ctx, size_t head, size_t payload, struct iovec *iov, int max_iov)
{
    Device *self = ctx;
    struct vr_queue *q = &self->q[RX];
    if (!self->rx_direct || self->rxq_head || !self->guest_csum || !self->guest_tso4 || !self->guest_tso6 ||
        max_iov < 1 || payload == 0 || head + payload > self->max_frame)
        return 0;
    int k = vr_rx_reserve(q, &self->rsv, &self->mem, self->mrg, self->hdr_len, self->hdr_len + head + payload,
                          self->hdr_len + head, iov, (unsigned)max_iov);
    if (k <= 0)
        self->tcp_direct_short++;
    return k;
}

static int sink_commit(void *ctx, const uint8_t *hdr, size_t hdr_len, size_t payload)
{
    Device *self = ctx;
    struct vr_queue *q = &self->q[RX];
    if (hdr_len < 12 || !self->rsv.open)
        return -EINVAL;
    uint8_t vh[12];
    memcpy(vh, hdr, 12);
    vh[10] = vh[11] = 0;
    if (vr_rx_commit(q, &self->rsv, self->hdr_len, vh, hdr + 12, hdr_len - 12, hdr_len - 12 + payload) < 0) {
        self->tcp_rx_dropped++;
        return -EINVAL;
    }
    self->rx_due = 1;
    self->tcp_out++;
    self->tcp_direct++;
    self->rx_frames++;
    return 0;
}

static void sink_release(void *ctx)
{
    Device *self = ctx;
    vr_rx_release(&self->q[RX], &self->rsv);
}

static void sink_flush(void *ctx)
{
    Device *self = ctx;
    vr_rx_release(&self->q[RX], &self->rsv);
    if (self->rx_due) {
        self->rx_due = 0;
        if (vr_queue_ready(&self->q[RX]))
            signal_call(self, RX);
    }
}

static void sink_capsule_free(PyObject *cap)
{
    Py_XDECREF((PyObject *)PyCapsule_GetContext(cap));
}

/* tcp_sink() -> a capsule for TcpEngine(sink=...): it holds this device. */
static PyObject *device_tcp_sink(PyObject *op, PyObject *unused)
{
    Device *self = (Device *)op;
    (void)unused;
    PyObject *cap = PyCapsule_New(&self->sink, TCPSINK_CAPSULE, sink_capsule_free);
    if (!cap)
        return NULL;
    Py_INCREF(op);
    if (PyCapsule_SetContext(cap, op) < 0) {
        Py_DECREF(op);
        Py_DECREF(cap);
        return NULL;
    }
    return cap;
}

/* attach_tcp(engine, max_buffer): guest frames go to the TcpEngine first; its frames waiting for
 * RX buffers are bounded by max_buffer bytes. attach_tcp(None): detached (the engine released). */
static PyObject *device_attach_tcp(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    PyObject *engine;
    Py_ssize_t max_buffer = 8 << 20;
    if (!PyArg_ParseTuple(args, "O|n", &engine, &max_buffer))
        return NULL;
    if (engine == Py_None) {
        self->eng = NULL;
        Py_CLEAR(self->tcp);
        Py_RETURN_NONE;
    }
    if (max_buffer < 0) {
        PyErr_SetString(PyExc_ValueError, "max_buffer must be >= 0 bytes");
        return NULL;
    }
    const struct tcpnat_api *api = PyCapsule_Import(TCPNAT_API_CAPSULE, 0);
    if (!api)
        return NULL;
    void *eng = api->engine_of(engine);
    if (!eng) {
        PyErr_SetString(PyExc_ValueError, "engine: not an open TcpEngine");
        return NULL;
    }
    if (!self->scratch && !(self->scratch = malloc(self->max_frame)))
        return PyErr_NoMemory();
    Py_INCREF(engine);
    PyObject *old = self->tcp;
    self->tcp = engine;
    Py_XDECREF(old);
    self->api = api;
    self->eng = eng;
    self->rxq_max = (size_t)max_buffer;
    Py_RETURN_NONE;
}

/* tx(kick_fd) -> (frames: list[bytes], csum_ok: list[bool], more: bool). */
static PyObject *device_tx(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    long kick = PyLong_AsLong(arg);
    if (kick == -1 && PyErr_Occurred())
        return NULL;
    if (kick >= 0) {
        drain_eventfd((int)kick);
        self->kicks++;
    }
    struct vr_queue *q = &self->q[TX];
    int pushed = 0, more = 0, took_any = 0, divert = 0; /* divert: the rest of the walk goes to Python */
    size_t bytes = 0; /* taken in this walk (coalescing) */
    void *eng = self->eng;
    double now = eng ? self->api->now() : 0.0;
    PyObject *frames = PyList_New(0), *csum = PyList_New(0);
    if (!frames || !csum)
        goto fail;
    if (q->broken)
        self->c.by_reason[VR_R_BROKEN]++;
    tx_call_check(self);
    for (unsigned got = 0;;) {
        if (got == self->batch) { /* the rest on the next turn; none: a kick asked for, as below */
            more = vr_avail_count(q) > 0 || (vr_queue_ready(q) && vr_kick_me(q, 1));
            break;
        }
        unsigned niov;
        size_t len;
        uint16_t vnet, head;
        enum vr_pop r = vr_tx_pop(q, &self->mem, self->hdr_len, self->max_frame, &niov, &len, &vnet, &head, &self->c);
        if (r == VR_DROPPED) {
            pushed = 1;
            continue;
        }
        if (r == VR_EMPTY) {
            if (self->coalesce && bytes >= self->coalesce && vr_queue_ready(q)) {
                /* bulk: no kick asked for (the driver's avail_event stays behind it); the caller
                 * walks again after its interval, and that walk asks unless it is bulk too */
                if (vr_kick_me(q, 0))
                    continue; /* chains came meanwhile */
                more = 2;
                self->tx_coalesced++;
                break;
            }
            /* ask for a kick at the index just read, then look once more: a chain made meanwhile
             * is taken, and the next empty ring asks again. Asking only once per call left
             * avail_event behind the chains taken after it: the driver, past it already, never
             * kicked again (a TX stall with two vCPUs). */
            if (!vr_queue_ready(q) || !vr_kick_me(q, 1))
                break;
            continue;
        }
        if (r == VR_BROKEN)
            break;
        PyObject *b;
        if (eng) { /* a native flow's (its payload sent from guest memory, or copied out once), or Python's */
            int took = -1;
            if (!divert && self->api->frame_zc && (vnet & 3) && niov <= ZC_PIECES) {
                /* the headers copied out (the guest may change its buffers: decisions are made on
                 * the copy), the payload left in place: the kernel's sendmsg reads it there, before
                 * the used entry is published (batch_end, then signal_call) */
                size_t hl = len < TCPSINK_ZC_HEAD ? len : TCPSINK_ZC_HEAD;
                struct iovec zv[ZC_PIECES];
                size_t at = 0;
                for (unsigned k = 0; k < niov; k++) {
                    zv[k].iov_base = q->iov[k].base;
                    zv[k].iov_len = q->iov[k].len;
                    if (at < hl) {
                        size_t c = hl - at < q->iov[k].len ? hl - at : q->iov[k].len;
                        memcpy(self->scratch + at, q->iov[k].base, c);
                        at += c;
                    }
                }
                took = self->api->frame_zc(eng, self->scratch, hl, zv, (int)niov, len, 1, now);
                if (took > 0)
                    self->tx_in_place++;
            }
            if (took < 0) { /* copied out whole: the engine parses and sends from the copy */
                vr_iov_copy(self->scratch, q->iov, niov);
                took = !divert && self->api->frame(eng, self->scratch, len, (vnet & 3) != 0, now);
            } else if (took == 0) {
                vr_iov_copy(self->scratch, q->iov, niov);
            }
            if (took) {
                vr_push_used(q, head, 0);
                pushed = took_any = 1;
                got++;
                bytes += len;
                self->tx_frames++;
                self->tcp_in++;
                continue;
            }
            divert = divert || dp_reorders_later(self->scratch, len); /* (as the TAP reader) */
            b = PyBytes_FromStringAndSize((const char *)self->scratch, (Py_ssize_t)len);
            if (!b)
                goto fail;
        } else {
            b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)len);
            if (!b)
                goto fail;
            vr_iov_copy((uint8_t *)PyBytes_AsString(b), q->iov, niov);
        }
        vr_push_used(q, head, 0);
        pushed = 1;
        got++;
        bytes += len;
        self->tx_frames++;
        int bad = PyList_Append(frames, b);
        Py_DECREF(b);
        if (bad || PyList_Append(csum, (vnet & 3) ? Py_True : Py_False) < 0)
            goto fail;
    }
    /* batch_end first: it sends what the engine gathered from guest memory (frame_zc) before the
     * used entries are published and the chains are the guest's again */
    if (took_any)
        self->api->batch_end(eng); /* the ACKs due go out (sink_flush calls the guest) */
    if (pushed)
        tx_call_after_walk(self, bytes, more);
    if (self->tx_call_due && more == 0)
        more = 3; /* a call waits: walked again after tx_defer, which settles or sends it */
    return Py_BuildValue("(NNi)", frames, csum, more);
fail:
    if (took_any)
        self->api->batch_end(eng);
    if (pushed)
        signal_call(self, TX);
    Py_XDECREF(frames);
    Py_XDECREF(csum);
    return NULL;
}

static PyObject *vnet_name;

/* rx(frames, start) -> (next, state, delivered): frames[start:] (bytes-like; an object with a 12-byte .vnet
 * attribute, an OffloadFrame, gives its header; an object that is not bytes-like is dropped and
 * counted in rx_dropped) into the guest's RX buffers, one call signalled.
 * state: RX_DONE, RX_WAITING (no buffers for frames[next]), RX_BROKEN. */
static PyObject *device_rx(PyObject *op, PyObject *args)
{
    Device *self = (Device *)op;
    PyObject *seq;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "On", &seq, &start))
        return NULL;
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0)
        return NULL;
    struct vr_queue *q = &self->q[RX];
    int pushed = 0, state = RX_DONE;
    vr_rx_release(q, &self->rsv); /* (none is open between the engine's turns) */
    Py_ssize_t i = start < 0 ? 0 : start, delivered = 0;
    if (q->broken) {
        self->c.by_reason[VR_R_BROKEN]++;
        return Py_BuildValue("(nin)", n, RX_BROKEN, (Py_ssize_t)0);
    }
    for (; i < n; i++) {
        PyObject *o = PySequence_GetItem(seq, i);
        if (!o)
            goto fail;
        uint8_t hdr[12] = {0};
        if (!PyBytes_Check(o)) {
            PyObject *v = PyObject_GetAttr(o, vnet_name);
            if (!v) {
                PyErr_Clear();
            } else {
                Py_buffer hv;
                if (PyObject_GetBuffer(v, &hv, PyBUF_SIMPLE) == 0) {
                    memcpy(hdr, hv.buf, hv.len < 12 ? (size_t)hv.len : 12);
                    PyBuffer_Release(&hv);
                } else {
                    PyErr_Clear();
                }
                Py_DECREF(v);
            }
        }
        hdr[10] = hdr[11] = 0;
        Py_buffer view;
        if (PyObject_GetBuffer(o, &view, PyBUF_SIMPLE) < 0) { /* not bytes-like: dropped, counted */
            PyErr_Clear();
            Py_DECREF(o);
            self->rx_dropped++;
            continue;
        }
        enum vr_pop r;
        if ((size_t)view.len > self->max_frame) {
            r = VR_DROPPED;
        } else {
            r = vr_rx_put(q, &self->mem, self->mrg, self->hdr_len, hdr, (const uint8_t *)view.buf, (size_t)view.len,
                          &self->c);
        }
        PyBuffer_Release(&view);
        Py_DECREF(o);
        if (r == VR_OK) {
            pushed = 1;
            delivered++;
            self->rx_frames++;
        } else if (r == VR_DROPPED) {
            pushed = 1; /* a bad chain may have gone back */
            self->rx_dropped++;
        } else if (r == VR_EMPTY) {
            state = RX_WAITING;
            break;
        } else {
            state = RX_BROKEN;
            i = n;
            break;
        }
    }
    if (pushed)
        signal_call(self, RX);
    return Py_BuildValue("(nin)", i, state, delivered);
fail:
    if (pushed)
        signal_call(self, RX);
    return NULL;
}

/* rx_kick_me(kick_fd) -> bool: clear the RX kick, ask for the next one; whether buffers are there now. */
static PyObject *device_rx_kick_me(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    long kick = PyLong_AsLong(arg);
    if (kick == -1 && PyErr_Occurred())
        return NULL;
    if (kick >= 0)
        drain_eventfd((int)kick);
    struct vr_queue *q = &self->q[RX];
    if (self->rxq_head) { /* the engine's frames that waited go first */
        rx_drain(self);
        sink_flush(self);
        if (self->rxq_head)
            return PyBool_FromLong(0); /* still none: a kick is asked for */
        /* all went: the buffers left are for the Python side's frames, which may wait too. The
         * kick that brought them is spent, and the driver may post no more (Linux refills when
         * half its ring is used): yes when any is left, not only when new ones came */
        return PyBool_FromLong(vr_kick_me(q, 1) || vr_avail_count(q) > 0);
    }
    return PyBool_FromLong(vr_kick_me(q, 1));
}

/* set_rx_direct(on): the engine's frames written in place (one copy) when the ring allows, or
 * (False) all through the copying writer (tests, A/B measurements). */
static PyObject *device_set_rx_direct(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    vr_rx_release(&self->q[RX], &self->rsv);
    self->rx_direct = on;
    Py_RETURN_NONE;
}

/* set_tx_defer(seconds): a TX walk of fewer than TX_DEFER_BYTES lets its call wait up to that long
 * (0: off, the default; at most 1 s): the driver may take its buffers back without it. */
static PyObject *device_set_tx_defer(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    double v = PyFloat_AsDouble(arg);
    if (v == -1.0 && PyErr_Occurred())
        return NULL;
    if (!(v >= 0.0 && v <= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "seconds must be 0..1");
        return NULL;
    }
    self->tx_defer = v;
    if (v == 0.0 && self->tx_call_due) { /* what waits goes now (nothing, without a ring) */
        if (vr_queue_ready(&self->q[TX]))
            signal_call(self, TX);
        self->tx_call_due = 0;
    }
    Py_RETURN_NONE;
}

/* set_tx_coalesce(nbytes): a TX walk that took at least nbytes and found the ring empty asks
 * for no kick and says more == 2 (walk again after an interval); 0 turns it off (the default). */
static PyObject *device_set_tx_coalesce(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "nbytes must be >= 0");
        return NULL;
    }
    self->coalesce = (size_t)n;
    Py_RETURN_NONE;
}

static PyObject *device_broken(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    long q = PyLong_AsLong(arg);
    if ((q == -1 && PyErr_Occurred()) || queue_index((int)q) < 0)
        return NULL;
    if (!self->q[q].broken)
        Py_RETURN_NONE;
    return PyUnicode_FromString(vr_reason_name(self->q[q].broken));
}

static PyObject *device_ready(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    long q = PyLong_AsLong(arg);
    if ((q == -1 && PyErr_Occurred()) || queue_index((int)q) < 0)
        return NULL;
    return PyBool_FromLong(vr_queue_ready(&self->q[q]));
}

static int put(PyObject *d, const char *key, uint64_t value)
{
    PyObject *v = PyLong_FromUnsignedLongLong(value);
    if (!v)
        return -1;
    int r = PyDict_SetItemString(d, key, v);
    Py_DECREF(v);
    return r;
}

/* queue_state(q) -> dict: the queue's indexes and notification words, ours and the driver's, as
 * they are now (a debug aid for a stalled ring: who waits for whom). The ring words are read
 * from shared memory; None when the rings are not set. */
static PyObject *device_queue_state(PyObject *op, PyObject *arg)
{
    Device *self = (Device *)op;
    long qi = PyLong_AsLong(arg);
    if ((qi == -1 && PyErr_Occurred()) || queue_index((int)qi) < 0)
        return NULL;
    struct vr_queue *q = &self->q[qi];
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    int ready = vr_queue_ready(q);
    if (put(d, "num", q->num) < 0 || put(d, "ready", (uint64_t)ready) < 0 || put(d, "event_idx", q->event_idx) < 0 ||
        put(d, "last_avail", q->last_avail) < 0 || put(d, "seen_avail", q->seen_avail) < 0 ||
        put(d, "used_idx", q->used_idx) < 0 || put(d, "signalled_used", q->signalled_used) < 0 ||
        put(d, "signalled_valid", q->signalled_valid) < 0 || put(d, "callfd", (uint64_t)(self->callfd[qi] >= 0)) < 0)
        goto fail;
    if (q->broken) {
        PyObject *b = PyUnicode_FromString(vr_reason_name(q->broken));
        if (!b || PyDict_SetItemString(d, "broken", b) < 0) {
            Py_XDECREF(b);
            goto fail;
        }
        Py_DECREF(b);
    }
    if (ready) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        uint16_t avail_flags = *(volatile uint16_t *)(volatile void *)q->avail;
        uint16_t avail_idx = *(volatile uint16_t *)(volatile void *)(q->avail + 2);
        uint16_t used_event = *(volatile uint16_t *)(volatile void *)(q->avail + 4 + 2u * q->num);
        uint16_t used_flags = *(volatile uint16_t *)(volatile void *)q->used;
        uint16_t used_ring_idx = *(volatile uint16_t *)(volatile void *)(q->used + 2);
        uint16_t avail_event = *(volatile uint16_t *)(volatile void *)(q->used + 4 + 8u * q->num);
        if (put(d, "avail_idx", avail_idx) < 0 || put(d, "avail_flags", avail_flags) < 0 ||
            put(d, "used_event", used_event) < 0 || put(d, "used_ring_idx", used_ring_idx) < 0 ||
            put(d, "used_flags", used_flags) < 0 || put(d, "avail_event", avail_event) < 0 ||
            put(d, "not_taken", (uint16_t)(avail_idx - q->last_avail)) < 0)
            goto fail;
    }
    if (qi == RX) {
        uint64_t waiting = 0;
        for (struct rxq *e = self->rxq_head; e; e = e->next)
            waiting++;
        if (put(d, "tcp_frames_waiting", waiting) < 0 || put(d, "tcp_bytes_waiting", self->rxq_bytes) < 0)
            goto fail;
    }
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyObject *device_counters(PyObject *op, PyObject *unused)
{
    Device *self = (Device *)op;
    (void)unused;
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    if (put(d, "tx_frames", self->tx_frames) < 0 || put(d, "rx_frames", self->rx_frames) < 0 ||
        put(d, "calls", self->calls) < 0 || put(d, "kicks", self->kicks) < 0 ||
        put(d, "rx_dropped", self->rx_dropped) < 0 || put(d, "tx_coalesced", self->tx_coalesced) < 0 ||
        put(d, "tx_calls_deferred", self->tx_calls_deferred) < 0 || put(d, "tx_calls_saved", self->tx_calls_saved) < 0 ||
        put(d, "tx_calls_late", self->tx_calls_late) < 0)
        goto fail;
    if (self->tcp || self->tcp_in || self->tcp_out) { /* the native TCP engine's, once attached */
        if (put(d, "tcp_frames_in", self->tcp_in) < 0 || put(d, "tcp_frames_out", self->tcp_out) < 0 ||
            put(d, "tcp_frames_waited", self->tcp_waited) < 0 || put(d, "tcp_rx_full", self->tcp_rx_full) < 0 ||
            put(d, "tcp_rx_dropped", self->tcp_rx_dropped) < 0 ||
            put(d, "tcp_gso_refused", self->tcp_gso_refused) < 0 ||
            put(d, "tcp_frames_direct", self->tcp_direct) < 0 || put(d, "tcp_direct_short", self->tcp_direct_short) < 0 ||
            put(d, "tcp_frames_in_place", self->tx_in_place) < 0 ||
            put(d, "tcp_rx_bytes_waiting", self->rxq_bytes) < 0)
            goto fail;
    }
    for (unsigned i = 1; i < VR_R_COUNT; i++)
        if (self->c.by_reason[i] && put(d, vr_reason_name(i), self->c.by_reason[i]) < 0)
            goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

static PyMethodDef device_methods[] = {
    {"set_mem_table", device_set_mem_table, METH_O, "set_mem_table([(gpa, size, uva, mmap_offset, fd), ...])"},
    {"set_num", device_set_num, METH_VARARGS, "set_num(q, num)"},
    {"set_addr", device_set_addr, METH_VARARGS, "set_addr(q, desc_uva, used_uva, avail_uva) -> whether the queue "
     "resumes from the used ring's index (not the base)"},
    {"set_base", device_set_base, METH_VARARGS, "set_base(q, base)"},
    {"get_base", device_get_base, METH_O, "get_base(q) -> the next avail index"},
    {"set_call", device_set_call, METH_VARARGS, "set_call(q, fd): -1 for none (the fd stays the caller's)"},
    {"set_features", device_set_features, METH_VARARGS, "set_features(hdr_len, mrg, event_idx)"},
    {"reset", device_reset, METH_NOARGS, "reset(): unmap guest memory, forget the queues"},
    {"tx", device_tx, METH_O, "tx(kick_fd) -> (frames, csum_ok, more): more 0 (kick asked), 1 (more now), 2 (bulk)"},
    {"rx", device_rx, METH_VARARGS, "rx(frames, start) -> (next, state, delivered)"},
    {"rx_kick_me", device_rx_kick_me, METH_O, "rx_kick_me(kick_fd) -> whether RX buffers are available"},
    {"set_tx_defer", device_set_tx_defer, METH_O,
     "set_tx_defer(seconds): a small TX walk's call waits up to that long (0: off); more == 3 then"},
    {"set_tx_coalesce", device_set_tx_coalesce, METH_O,
     "set_tx_coalesce(nbytes): a walk that took >= nbytes ends with no kick asked, more == 2 (0: off)"},
    {"set_rx_direct", device_set_rx_direct, METH_O,
     "set_rx_direct(on): the native TCP engine's frames written in place in the RX ring (one copy), or not"},
    {"broken", device_broken, METH_O, "broken(q) -> why the queue is broken, or None"},
    {"ready", device_ready, METH_O, "ready(q) -> whether the queue's rings are set"},
    {"counters", device_counters, METH_NOARGS, "counters() -> dict"},
    {"queue_state", device_queue_state, METH_O, "queue_state(q) -> dict: indexes and notification words (debug)"},
    {"tcp_sink", device_tcp_sink, METH_NOARGS, "tcp_sink() -> the frame sink capsule for TcpEngine(sink=...)"},
    {"attach_tcp", device_attach_tcp, METH_VARARGS,
     "attach_tcp(engine, max_buffer=8 MiB): guest frames to the TcpEngine first; attach_tcp(None): detach"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot device_slots[] = {
    {Py_tp_doc, "Device(max_frame, batch): one vhost-user-net device's memory and queues"},
    {Py_tp_init, device_init},
    {Py_tp_dealloc, device_dealloc},
    {Py_tp_methods, device_methods},
    {0, NULL},
};

static PyType_Spec device_spec = {
    "aioslirp.native._vhost.Device", sizeof(Device), 0, Py_TPFLAGS_DEFAULT, device_slots,
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "aioslirp.native._vhost", "aioslirp's vhost-user-net rings (C core, limited API)", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__vhost(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    if (!vnet_name && !(vnet_name = PyUnicode_InternFromString("vnet")))
        goto fail;
    PyObject *dev = PyType_FromSpec(&device_spec);
    if (!dev || PyModule_AddObjectRef(m, "Device", dev) < 0) {
        Py_XDECREF(dev);
        goto fail;
    }
    Py_DECREF(dev);
    if (PyModule_AddIntConstant(m, "RX_DONE", RX_DONE) < 0 || PyModule_AddIntConstant(m, "RX_WAITING", RX_WAITING) < 0 ||
        PyModule_AddIntConstant(m, "RX_BROKEN", RX_BROKEN) < 0 ||
        PyModule_AddIntConstant(m, "MAX_QUEUE", VR_MAX_QUEUE) < 0 ||
        PyModule_AddIntConstant(m, "MAX_REGIONS", VR_MAX_REGIONS) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
