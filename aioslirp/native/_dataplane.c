/* The CPython binding of aioslirp's native data plane (limited API 3.11, abi3): a thin layer
 * over the C core in dataplane.c. Python objects are made here only, once per call or per
 * frame handed to Python; the core touches none.
 *
 *   classify(buf, vnet=False) -> record tuple            (no counting)
 *   reason_names() -> tuple[str, ...], reason_names6()   (index = the record's reason code)
 *   Plane(read_size, batch, vnet)                        one transport's state:
 *     .read_tap(fd) -> (frames, csum_ok | None, end, errno)
 *     .classify(buf) -> record tuple                     (counted in .counters())
 *     .counters() -> {"frames": n, reason: n, ...}
 *
 * The record tuple: (kind, reason, flags, proto, tcp_flags, ethertype, l2_off, l3_off, l4_off,
 * payload_off, payload_len, end, sport, dport, src, dst), src/dst bytes of 4 or 16 (b"" before
 * the IP header). MIT licensed, written for aioslirp. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "dataplane.h"
#include "_tcpnat.h"
#include "_tracejson.h"

/* Frames of one read buffer before they go to Python; the buffer holds this many largest
 * frames (a batch larger than that is read in several fills within one call). */
#define FILL_FRAMES 8u
/* The most bytes one gathered sendmsg of a guest's payloads takes while the yield point is armed:
 * about one largest frame (its system call about 40 us here, against 100 us for three). */
#define YIELD_GATHER 65536u

static PyObject *record_tuple(const struct dp_frame *f)
{
    size_t alen = (f->flags & DP_F_IPV6) ? 16 : (f->l4_off ? 4 : 0);
    return Py_BuildValue("(iiiiiiIIIIIIiiy#y#)", f->kind, f->reason, f->flags, f->proto, f->tcp_flags, f->ethertype,
                         f->l2_off, f->l3_off, f->l4_off, f->payload_off, f->payload_len, f->end, f->sport, f->dport,
                         (const char *)f->src, (Py_ssize_t)alen, (const char *)f->dst, (Py_ssize_t)alen);
}

static PyObject *classify_buffer(PyObject *obj, int vnet, struct dp_counters *counters)
{
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    struct dp_frame f;
    dp_classify((const uint8_t *)view.buf, (size_t)view.len, vnet, &f, counters);
    PyBuffer_Release(&view);
    return record_tuple(&f);
}

static PyObject *mod_classify(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"buf", "vnet", NULL};
    PyObject *obj;
    int vnet = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O|p", kwlist, &obj, &vnet))
        return NULL;
    return classify_buffer(obj, vnet, NULL);
}

static PyObject *names_tuple(const char *(*name)(unsigned))
{
    PyObject *t = PyTuple_New(DP_R_COUNT);
    if (!t)
        return NULL;
    for (unsigned i = 0; i < DP_R_COUNT; i++) {
        PyObject *s = PyUnicode_FromString(name(i));
        if (!s || PyTuple_SetItem(t, i, s) < 0) {
            Py_DECREF(t);
            return NULL;
        }
    }
    return t;
}

static PyObject *mod_reason_names(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    return names_tuple(dp_reason_name);
}

static PyObject *mod_reason_names6(PyObject *self, PyObject *unused)
{
    (void)self, (void)unused;
    return names_tuple(dp_reason_name6);
}

/* udp_frames(eth, src, dst, sport, dport, payload, hlim, mtu, ident4, ident6) -> list[bytes]:
 * dp_udp_frames(), the frames of one host datagram for the guest (IPv6 when src is 16 bytes). */
static PyObject *mod_udp_frames(PyObject *self, PyObject *args)
{
    Py_buffer eth, src, dst, payload;
    int sport, dport, hlim;
    unsigned int mtu, ident4;
    unsigned long ident6;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*iiy*iIIk", &eth, &src, &dst, &sport, &dport, &payload, &hlim, &mtu, &ident4,
                          &ident6))
        return NULL;
    PyObject *result = NULL;
    uint8_t *out = NULL;
    struct dp_slot *slots = NULL;
    int v6 = src.len == 16;
    unsigned n = 0;
    size_t need;
    if (eth.len != 14 || (src.len != 4 && src.len != 16) || dst.len != src.len || sport < 0 || sport > 0xFFFF ||
        dport < 0 || dport > 0xFFFF || hlim < 0 || hlim > 255 || ident4 > 0xFFFF || ident6 > 0xFFFFFFFFul) {
        PyErr_SetString(PyExc_ValueError, "udp_frames: eth is 14 bytes, src/dst 4 or 16 (both), ports 16 bits, "
                                          "hlim 8 bits, ident4 16 bits, ident6 32 bits");
        goto done;
    }
    need = dp_udp_frames_size(v6, (size_t)payload.len, mtu, &n);
    if (!need) {
        PyErr_SetString(PyExc_ValueError, "udp_frames: payload too long or mtu out of range");
        goto done;
    }
    out = PyMem_Malloc(need);
    slots = PyMem_Malloc(sizeof *slots * n);
    if (!out || !slots) {
        PyErr_NoMemory();
        goto done;
    }
    int got = dp_udp_frames(out, need, slots, n, eth.buf, v6, src.buf, dst.buf, (uint16_t)sport, (uint16_t)dport,
                            payload.buf, (size_t)payload.len, (uint8_t)hlim, mtu, (uint16_t)ident4, (uint32_t)ident6);
    if (got != (int)n) {
        PyErr_SetString(PyExc_RuntimeError, "udp_frames: the frames do not fit the size computed for them");
        goto done;
    }
    result = PyList_New(n);
    if (!result)
        goto done;
    for (unsigned i = 0; i < n; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)out + slots[i].off, (Py_ssize_t)slots[i].len);
        if (!b || PyList_SetItem(result, i, b) < 0) {
            Py_CLEAR(result);
            goto done;
        }
    }
done:
    PyMem_Free(out);
    PyMem_Free(slots);
    PyBuffer_Release(&eth);
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&payload);
    return result;
}

/* udp_checksum_ok(src, dst, udp, trusted=False) -> bool: dp_udp_checksum_ok() for the datagram udp
 * (header and payload, as long as its length field says; IPv6 when src is 16 bytes). */
static PyObject *mod_udp_checksum_ok(PyObject *self, PyObject *args)
{
    Py_buffer src, dst, udp;
    int trusted = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*|p", &src, &dst, &udp, &trusted))
        return NULL;
    PyObject *result = NULL;
    if ((src.len != 4 && src.len != 16) || dst.len != src.len || udp.len < 8) {
        PyErr_SetString(PyExc_ValueError, "udp_checksum_ok: src/dst 4 or 16 bytes (both), udp at least 8 bytes");
    } else {
        result = PyBool_FromLong(dp_udp_checksum_ok(src.len == 16, src.buf, dst.buf, udp.buf, (size_t)udp.len,
                                                    trusted));
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    PyBuffer_Release(&udp);
    return result;
}

/* ------------------------------------------------------------------ the yield point */

/* One per process (the GIL orders it): the express lane that set_yield() armed, on the thread
 * that armed it. Its epoll holds only the sparse guests' input fds (fair.py dims the others), so
 * a readable epoll means a light guest's input waits behind a busy guest's turn. */
static struct {
    int fd;                /* the lane's epoll, -1: off */
    PyObject *serve;       /* serve(): runs the ready sparse guests' callbacks */
    unsigned long thread;  /* the thread that armed it */
    uint64_t every_ns;     /* the least time between two polls of fd */
    uint64_t last_ns;      /* the last poll */
    int depth;             /* serve() runs */
    const void *plane, *engine; /* the turn it interrupted */
    unsigned long long polls, served;
} Y = {.fd = -1};

static uint64_t mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void dp_yield(const void *plane, const void *engine)
{
    if (Y.fd < 0 || Y.depth)
        return;
    uint64_t now = mono_ns();
    if (now - Y.last_ns < Y.every_ns)
        return;
    Y.last_ns = now;
    if (PyThread_get_thread_ident() != Y.thread)
        return;
    struct pollfd p = {.fd = Y.fd, .events = POLLIN};
    Y.polls++;
    if (poll(&p, 1, 0) <= 0 || !(p.revents & POLLIN))
        return;
    PyObject *serve = Py_NewRef(Y.serve); /* (serve may disarm, dropping Y's reference) */
    PyObject *et, *ev, *tb; /* (none expected: kept as it was) */
    PyErr_Fetch(&et, &ev, &tb);
    Y.depth = 1;
    Y.plane = plane;
    Y.engine = engine;
    PyObject *r = PyObject_CallNoArgs(serve);
    Y.depth = 0;
    Y.plane = Y.engine = NULL;
    Y.served++;
    if (r)
        Py_DECREF(r);
    else /* serve() logs its callbacks' failures itself: this is its own, not the turn's */
        PyErr_WriteUnraisable(serve);
    Py_DECREF(serve);
    PyErr_Restore(et, ev, tb);
}

int dp_yield_armed(void)
{
    return Y.fd >= 0;
}

int dp_yield_blocks(const void *plane, const void *engine)
{
    return Y.depth && ((plane && plane == Y.plane) || (engine && engine == Y.engine));
}

/* set_yield(fd, serve, every_us) arms the yield point for this thread; set_yield(-1, serve) disarms
 * it when serve is the armed one. -> True when it changed (a lane of another thread or another
 * serve armed already: False, nothing changed). */
static PyObject *mod_set_yield(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *serve;
    double every_us = 0.0;
    (void)self;
    if (!PyArg_ParseTuple(args, "iO|d", &fd, &serve, &every_us))
        return NULL;
    if (fd < 0) {
        if (Y.serve != serve)
            Py_RETURN_FALSE;
        Y.fd = -1;
        Py_CLEAR(Y.serve);
        Py_RETURN_TRUE;
    }
    if (!PyCallable_Check(serve) || !(every_us >= 0.0 && every_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "set_yield: serve must be callable and every_us in 0..1e6");
        return NULL;
    }
    if (Y.serve && Y.serve != serve)
        Py_RETURN_FALSE;
    PyObject *old = Y.serve;
    Y.serve = Py_NewRef(serve);
    Py_XDECREF(old);
    Y.fd = fd;
    Y.thread = PyThread_get_thread_ident();
    Y.every_ns = (uint64_t)(every_us * 1000.0);
    Py_RETURN_TRUE;
}

/* yield_counters() -> (polls, served): the yield point's polls of the lane, and its serve() calls. */
static PyObject *mod_yield_counters(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    return Py_BuildValue("(KK)", Y.polls, Y.served);
}

/* ------------------------------------------------------------------ Plane */

typedef struct {
    PyObject_HEAD
    uint8_t *buf;
    size_t cap;
    size_t read_size; /* bytes offered to each read(), the vnet header included */
    unsigned batch;
    int vnet;
    struct dp_slot *slots;
    struct dp_counters counters;
    /* native UDP flows (udp_enable): the table and its arrays, a scratch for one datagram */
    struct dp_udp_table udp;
    int udp_on;
    struct dp_udp_flow *udp_flows;
    int32_t *udp_heads;
    uint32_t *udp_touched;
    uint8_t *udp_scratch;
    PyObject *tcp; /* a TcpEngine (attach_tcp): its flows' frames never reach Python */
    PyObject *syn; /* syn_lane(): where a plain guest SYN of no native flow goes (dp_syn_lane), or NULL */
    PyObject *after; /* after(): called at the end of each ready() batch (a fair scheduler's safe point), or NULL */
    int reading; /* read_batch() runs (the lane calls Python inside it): no reentry over buf and slots */
    /* udp_sink(): host datagrams read by udp_readable(slot), the loop's reader of each host socket */
    int sink_fd, sink_vnet;
    PyObject *sink_counters; /* the stack's counters (a dict-like of int), bumped per call */
    PyObject *sink_on_error; /* on_error(slot, errno): a host socket error, to Python at once */
    PyObject *sink_keys[7];  /* the counter names bumped (SK_*), made once by udp_sink() */
} Plane;

/* The stack's counters the plane bumps itself (udp_sink), by index into Plane.sink_keys. */
enum { SK_FRAMES_IN, SK_BYTES_IN, SK_HANDLED_UDP, SK_DGRAMS_DOWN, SK_FRAMES_OUT, SK_BYTES_OUT, SK_TAP_WERR, SK_COUNT };
static const char *const sink_key_names[SK_COUNT] = {
    "frames_in", "bytes_in", "handled.udp", "udp_datagrams_down", "frames_out", "bytes_out", "native.tap_write_errors",
};

static int plane_init(PyObject *op, PyObject *args, PyObject *kwargs)
{
    Plane *self = (Plane *)op;
    static char *kwlist[] = {"read_size", "batch", "vnet", NULL};
    if (self->reading) { /* from the SYN lane: the reader's buffer and slots are in use */
        PyErr_SetString(PyExc_RuntimeError, "Plane re-initialised while it reads");
        return -1;
    }
    Py_ssize_t read_size, batch;
    int vnet = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nn|p", kwlist, &read_size, &batch, &vnet))
        return -1;
    if (read_size < 1 || read_size > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "read_size must be 1..1048576 bytes");
        return -1;
    }
    if (batch < 1 || batch > 65536) {
        PyErr_SetString(PyExc_ValueError, "batch must be 1..65536");
        return -1;
    }
    unsigned fill = (size_t)batch < FILL_FRAMES ? (unsigned)batch : FILL_FRAMES;
    uint8_t *buf = PyMem_Malloc((size_t)read_size * fill);
    struct dp_slot *slots = PyMem_Malloc(sizeof(struct dp_slot) * fill);
    if (!buf || !slots) {
        PyMem_Free(buf);
        PyMem_Free(slots);
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(self->buf);
    PyMem_Free(self->slots);
    self->buf = buf;
    self->slots = slots;
    self->cap = (size_t)read_size * fill;
    self->read_size = (size_t)read_size;
    self->batch = (unsigned)batch;
    self->vnet = vnet;
    memset(&self->counters, 0, sizeof self->counters);
    return 0;
}

/* The references a Plane holds (the TCP engine, the stack's counters, the on_error hook, which
 * holds the NativeUdp that holds this plane): the cycle collector sees them. */
static int plane_traverse(PyObject *op, visitproc visit, void *arg)
{
    Plane *self = (Plane *)op;
    Py_VISIT(Py_TYPE(op));
    Py_VISIT(self->tcp);
    Py_VISIT(self->syn);
    Py_VISIT(self->after);
    Py_VISIT(self->sink_counters);
    Py_VISIT(self->sink_on_error);
    return 0;
}

static int plane_clear(PyObject *op)
{
    Plane *self = (Plane *)op;
    Py_CLEAR(self->tcp);
    Py_CLEAR(self->syn);
    Py_CLEAR(self->after);
    Py_CLEAR(self->sink_counters);
    Py_CLEAR(self->sink_on_error);
    return 0;
}

static void plane_dealloc(PyObject *op)
{
    Plane *self = (Plane *)op;
    PyTypeObject *tp = Py_TYPE(op);
    PyObject_GC_UnTrack(op);
    PyMem_Free(self->buf);
    PyMem_Free(self->slots);
    PyMem_Free(self->udp_flows);
    PyMem_Free(self->udp_heads);
    PyMem_Free(self->udp_touched);
    PyMem_Free(self->udp_scratch);
    Py_CLEAR(self->tcp);
    Py_CLEAR(self->syn);
    Py_CLEAR(self->after);
    Py_CLEAR(self->sink_counters);
    Py_CLEAR(self->sink_on_error);
    for (int k = 0; k < SK_COUNT; k++)
        Py_CLEAR(self->sink_keys[k]);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(op);
    Py_DECREF(tp);
}

/* The SYN lane (syn_lane()): the frame at p[0..len), which no native flow took, to self->syn when
 * dp_syn_lane() finds it a plain SYN: syn(frame, v6, l4_off, end, sport, dport, seq, wnd, mss,
 * wscale, sack, now) with the frame as bytes (no virtio-net header), its offsets, its header fields
 * and options (-1: absent) and the batch's loop time. Before that, while the engine (*tcp) holds
 * records, ended() takes them (the full path takes them before its frames: a flow that ended
 * earlier in the batch counts no more in the guard and the table); without ended (read_tap), such
 * a SYN is the batch's. *tcp is looked up again after Python ran (NULL: the engine was detached or
 * closed; the rest of the batch is Python's). 1: Python took it (admitted, refused or dropped, and
 * counted); 0: not a plain SYN, or Python left it to the full path (it goes with the batch's
 * frames for Python); -1: an exception. */
static int syn_lane(Plane *self, const uint8_t *p, size_t len, int csum_ok, double now, PyObject *ended, void **tcp)
{
    struct dp_frame rec;
    struct dp_syn syn;
    if (dp_classify(p, len, 0, &rec, NULL) != DP_KIND_TCP || !dp_syn_lane(p, len, &rec, csum_ok, &syn))
        return 0;
    if (tcpnat_records_pending(*tcp)) {
        if (!ended)
            return 0;
        PyObject *r = PyObject_CallObject(ended, NULL);
        *tcp = self->tcp ? tcpnat_engine_of(self->tcp) : NULL;
        if (!r)
            return -1;
        Py_DECREF(r);
        if (!*tcp || tcpnat_records_pending(*tcp))
            return 0;
    }
    PyObject *r = PyObject_CallFunction(self->syn, "y#NIIIIkIiiNd", (const char *)p, (Py_ssize_t)len,
                                        PyBool_FromLong((rec.flags & DP_F_IPV6) != 0), rec.l4_off, rec.end,
                                        (unsigned)rec.sport, (unsigned)rec.dport, (unsigned long)syn.seq,
                                        (unsigned)syn.wnd, (int)syn.mss, (int)syn.wscale, PyBool_FromLong(syn.sack),
                                        now);
    *tcp = self->tcp ? tcpnat_engine_of(self->tcp) : NULL;
    if (!r)
        return -1;
    int took = PyObject_IsTrue(r);
    Py_DECREF(r);
    return took;
}

/* One batch of the TAP fd (read_tap and ready): the frames left for Python and their checksum
 * flags (new references, or NULL with an exception set), how the reads ended, their errno and the
 * frames adopted UDP flows took. ended: ready()'s hook that takes the engine's records (or NULL),
 * called before a SYN goes to the lane while records wait, as the full path takes them before its
 * frames. */
static int read_batch(Plane *self, int fd, double now, PyObject **frames_out, PyObject **csum_out,
                      enum dp_read_end *end_out, int *err_out, uint64_t *taken_out, PyObject *ended)
{
    void *tcp = self->tcp ? tcpnat_engine_of(self->tcp) : NULL;
    PyObject *frames = PyList_New(0);
    PyObject *csum = self->vnet ? PyList_New(0) : (Py_INCREF(Py_None), Py_None);
    if (!frames || !csum)
        goto fail;
    self->reading = 1;
    unsigned left = self->batch, fill = (unsigned)(self->cap / self->read_size);
    enum dp_read_end end;
    int err = 0, divert = 0; /* divert: the rest of the batch goes to Python (dp_reorders_later) */
    uint64_t taken_before = self->udp.taken_frames;
    double tcp_now = tcp ? tcpnat_now() : 0.0;
    if (tcp) /* while guests wait for their turns, one sendmsg is one yield point's worth of work */
        tcpnat_gather_max(tcp, dp_yield_armed() ? YIELD_GATHER : 0);
    do {
        unsigned nslots = 0, reads = 0;
        end = dp_tap_read(fd, self->buf, self->cap, self->read_size, self->vnet, left, self->slots, fill, &nslots,
                          &reads, &err, self->udp_on ? &self->udp : NULL, now);
        left -= reads;
        for (unsigned i = 0; i < nslots; i++) {
            const struct dp_slot *s = &self->slots[i];
            dp_yield(self, tcp); /* (a light guest's input first, when it waits behind this batch) */
            if (tcp && !divert) {
                if (tcpnat_tap_frame_kept(tcp, self->buf + s->off, s->len, s->csum_ok, tcp_now))
                    continue; /* a native TCP flow's frame (its payload may wait for the gather flush) */
                divert = dp_reorders_later(self->buf + s->off, s->len);
                if (self->syn && !divert && PyList_Size(frames) == 0) {
                    /* (only ahead of any frame for Python: the lane reorders nothing) */
                    int took = syn_lane(self, self->buf + s->off, s->len, s->csum_ok, now, ended, &tcp);
                    if (took < 0)
                        goto fail;
                    if (took)
                        continue;
                }
            }
            PyObject *b = PyBytes_FromStringAndSize((const char *)self->buf + s->off, (Py_ssize_t)s->len);
            if (!b)
                goto fail;
            int bad = PyList_Append(frames, b);
            Py_DECREF(b);
            if (bad)
                goto fail;
            if (self->vnet && PyList_Append(csum, s->csum_ok ? Py_True : Py_False) < 0)
                goto fail;
        }
        if (tcp) /* the next read reuses self->buf: what the gather holds goes now */
            tcpnat_gather_flush(tcp);
    } while (end == DP_READ_FULL && left > 0);
    if (end == DP_READ_FULL)
        end = DP_READ_DONE;
    self->reading = 0;
    if (tcp)
        tcpnat_batch_end(tcp);
    *frames_out = frames;
    *csum_out = csum;
    *end_out = end;
    *err_out = err;
    *taken_out = self->udp.taken_frames - taken_before;
    return 0;
fail:
    self->reading = 0;
    if (tcp)
        tcpnat_batch_end(tcp);
    Py_XDECREF(frames);
    Py_XDECREF(csum);
    return -1;
}

static int check_fd(Plane *self, long fdl)
{
    if (self->reading) { /* from the SYN lane: the reader's buffer and slots are in use */
        PyErr_SetString(PyExc_RuntimeError, "Plane read again while it reads");
        return -1;
    }
    if (!self->buf) {
        PyErr_SetString(PyExc_ValueError, "Plane not initialised");
        return -1;
    }
    if (fdl < 0 || fdl > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "fd must be a non-negative int");
        return -1;
    }
    return 0;
}

/* read_tap(fd, now=0.0) -> (frames: list[bytes], csum_ok: list[bool] | None, end: int, errno: int,
 * taken: int). Reads up to batch frames (dp_tap_read, several fills when the buffer is full) and
 * makes one bytes object per frame; frames of adopted UDP flows are moved in C at loop time now
 * (taken: how many; udp_touched() says which flows). end: a dp_read_end (DONE, AGAIN, EOF, ERROR). */
static PyObject *plane_read_tap(PyObject *op, PyObject *args)
{
    Plane *self = (Plane *)op;
    long fdl;
    double now = 0.0;
    if (!PyArg_ParseTuple(args, "l|d", &fdl, &now) || check_fd(self, fdl) < 0)
        return NULL;
    PyObject *frames, *csum;
    enum dp_read_end end;
    int err;
    uint64_t taken;
    if (read_batch(self, (int)fdl, now, &frames, &csum, &end, &err, &taken, NULL) < 0)
        return NULL;
    return Py_BuildValue("(NNiiK)", frames, csum, (int)end, err, (unsigned long long)taken);
}

/* ready(fd, clock, deliver, taken, ended): the TAP fd's reader, registered with the loop as it is
 * (loop.add_reader(fd, plane.ready, fd, loop.time, ...)), so that a wake-up whose frames all
 * belong to native flows runs no Python frame. One batch as read_tap at clock(); then taken(n)
 * when adopted UDP flows took n frames, ended() when the attached TcpEngine has records waiting
 * (tcpnat_pending), and deliver(frames, csum_ok, end, errno) when frames are left for Python or
 * the reads ended in EOF or an error. taken and ended may be None. */
static int bump(Plane *self, int key, uint64_t n);

static PyObject *plane_ready(PyObject *op, PyObject *args)
{
    Plane *self = (Plane *)op;
    long fdl;
    PyObject *clock, *deliver, *taken_hook, *ended_hook;
    if (!PyArg_ParseTuple(args, "lOOOO", &fdl, &clock, &deliver, &taken_hook, &ended_hook))
        return NULL;
    if (dp_yield_blocks(self, self->tcp ? tcpnat_engine_of(self->tcp) : NULL))
        Py_RETURN_NONE; /* its own reader, from a yield point of its turn: the loop calls it again */
    if (check_fd(self, fdl) < 0)
        return NULL;
    PyObject *t = PyObject_CallObject(clock, NULL);
    if (!t)
        return NULL;
    double now = PyFloat_AsDouble(t);
    Py_DECREF(t);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    PyObject *frames, *csum;
    enum dp_read_end end;
    int err;
    uint64_t taken;
    if (read_batch(self, (int)fdl, now, &frames, &csum, &end, &err, &taken, ended_hook == Py_None ? NULL : ended_hook) < 0)
        return NULL;
    PyObject *r;
    if (taken && self->sink_counters) { /* native UDP flows took frames: counted here, no Python frame */
        struct dp_udp_table *t = &self->udp;
        if (bump(self, SK_FRAMES_IN, t->taken_frames) < 0 || bump(self, SK_BYTES_IN, t->taken_bytes) < 0 ||
            bump(self, SK_HANDLED_UDP, t->taken_frames) < 0)
            goto fail;
        t->taken_frames = t->taken_bytes = 0;
        if (!t->attention) /* the flows' own figures wait for udp_touched() (flows(), the sweep) */
            taken = 0;
    }
    if (taken && taken_hook != Py_None) { /* a send failed or was refused: Python answers now */
        r = PyObject_CallFunction(taken_hook, "K", (unsigned long long)taken);
        if (!r)
            goto fail;
        Py_DECREF(r);
    }
    if (ended_hook != Py_None && self->tcp && tcpnat_pending(self->tcp)) {
        r = PyObject_CallObject(ended_hook, NULL);
        if (!r)
            goto fail;
        Py_DECREF(r);
    }
    if (PyList_Size(frames) > 0 || end == DP_READ_EOF || end == DP_READ_ERROR) {
        r = PyObject_CallFunction(deliver, "OOii", frames, csum, (int)end, err);
        if (!r)
            goto fail;
        Py_DECREF(r);
    }
    if (self->after) { /* (a reference of its own: the hook may replace itself) */
        PyObject *after = Py_NewRef(self->after);
        r = PyObject_CallNoArgs(after);
        Py_DECREF(after);
        if (!r)
            goto fail;
        Py_DECREF(r);
    }
    Py_DECREF(frames);
    Py_DECREF(csum);
    Py_RETURN_NONE;
fail:
    Py_DECREF(frames);
    Py_DECREF(csum);
    return NULL;
}

static PyObject *plane_classify(PyObject *op, PyObject *arg)
{
    Plane *self = (Plane *)op;
    return classify_buffer(arg, self->vnet, &self->counters);
}

static PyObject *plane_counters(PyObject *op, PyObject *unused)
{
    Plane *self = (Plane *)op;
    (void)unused;
    PyObject *d = PyDict_New();
    if (!d)
        return NULL;
    PyObject *v = PyLong_FromUnsignedLongLong(self->counters.frames);
    if (!v || PyDict_SetItemString(d, "frames", v) < 0)
        goto fail;
    Py_DECREF(v);
    for (unsigned i = 1; i < DP_R_COUNT; i++) {
        if (!self->counters.by_reason[i])
            continue;
        v = PyLong_FromUnsignedLongLong(self->counters.by_reason[i]);
        if (!v || PyDict_SetItemString(d, dp_reason_name(i), v) < 0)
            goto fail;
        Py_DECREF(v);
    }
    return d;
fail:
    Py_XDECREF(v);
    Py_DECREF(d);
    return NULL;
}

/* udp_enable(capacity): the table of native UDP flows (once). */
static PyObject *plane_udp_enable(PyObject *op, PyObject *arg)
{
    Plane *self = (Plane *)op;
    long cap = PyLong_AsLong(arg);
    if (cap == -1 && PyErr_Occurred())
        return NULL;
    if (cap < 1 || cap > 65536 || self->udp_on) {
        PyErr_SetString(PyExc_ValueError, "udp_enable: capacity 1..65536, once");
        return NULL;
    }
    uint32_t nb = 1;
    while (nb < 2 * (uint32_t)cap)
        nb <<= 1;
    self->udp_flows = PyMem_Malloc(sizeof(struct dp_udp_flow) * (size_t)cap);
    self->udp_heads = PyMem_Malloc(sizeof(int32_t) * nb);
    self->udp_touched = PyMem_Malloc(sizeof(uint32_t) * (size_t)cap);
    self->udp_scratch = PyMem_Malloc(DP_UDP_SCRATCH);
    if (!self->udp_flows || !self->udp_heads || !self->udp_touched || !self->udp_scratch) {
        PyMem_Free(self->udp_flows), PyMem_Free(self->udp_heads), PyMem_Free(self->udp_touched);
        PyMem_Free(self->udp_scratch);
        self->udp_flows = NULL, self->udp_heads = NULL, self->udp_touched = NULL, self->udp_scratch = NULL;
        return PyErr_NoMemory();
    }
    dp_udp_init(&self->udp, self->udp_flows, self->udp_heads, nb, self->udp_touched, (uint32_t)cap, 1);
    self->udp_on = 1;
    Py_RETURN_NONE;
}

static int udp_ready(Plane *self)
{
    if (!self->udp_on)
        PyErr_SetString(PyExc_ValueError, "native UDP flows are not enabled (udp_enable)");
    return self->udp_on;
}

/* udp_adopt(fd, guest_ip, guest_port, remote_ip, remote_port, eth, hlim, mtu, now) -> slot or -1. */
static PyObject *plane_udp_adopt(PyObject *op, PyObject *args)
{
    Plane *self = (Plane *)op;
    int fd, gport, rport, hlim;
    unsigned int mtu;
    double now;
    Py_buffer gip, rip, eth;
    if (!udp_ready(self) || !PyArg_ParseTuple(args, "iy*iy*iy*iId", &fd, &gip, &gport, &rip, &rport, &eth, &hlim,
                                               &mtu, &now))
        return NULL;
    PyObject *result = NULL;
    if (gip.len != 4 || rip.len != 4 || eth.len != 14 || gport < 0 || gport > 0xFFFF || rport < 0 ||
        rport > 0xFFFF || hlim < 0 || hlim > 255 || mtu < 576 || mtu > 65535 || fd < 0) {
        PyErr_SetString(PyExc_ValueError, "udp_adopt: IPv4 addresses (4 bytes), eth 14 bytes, ports 16 bits, "
                                          "hlim 8 bits, mtu 576..65535, fd >= 0");
    } else {
        result = PyLong_FromLong(dp_udp_adopt(&self->udp, fd, gip.buf, (uint16_t)gport, rip.buf, (uint16_t)rport,
                                              eth.buf, (uint8_t)hlim, mtu, now));
    }
    PyBuffer_Release(&gip);
    PyBuffer_Release(&rip);
    PyBuffer_Release(&eth);
    return result;
}

static struct dp_udp_flow *flow_at(Plane *self, PyObject *arg, int *slot)
{
    long v = PyLong_AsLong(arg);
    if (v == -1 && PyErr_Occurred())
        return NULL;
    if (v < 0 || (uint32_t)v >= self->udp.cap || self->udp_flows[v].fd < 0) {
        PyErr_SetString(PyExc_ValueError, "no native UDP flow in that slot");
        return NULL;
    }
    *slot = (int)v;
    return &self->udp_flows[v];
}

/* udp_release(slot): forget the flow (its socket stays the caller's). */
static PyObject *plane_udp_release(PyObject *op, PyObject *arg)
{
    Plane *self = (Plane *)op;
    int slot;
    if (!udp_ready(self) || !flow_at(self, arg, &slot))
        return NULL;
    dp_udp_release(&self->udp, slot);
    Py_RETURN_NONE;
}

/* udp_last_header(slot) -> bytes: the guest's last IP header + 8 bytes of that flow (b"" if none). */
static PyObject *plane_udp_last_header(PyObject *op, PyObject *arg)
{
    Plane *self = (Plane *)op;
    int slot;
    struct dp_udp_flow *f;
    if (!udp_ready(self) || !(f = flow_at(self, arg, &slot)))
        return NULL;
    return PyBytes_FromStringAndSize((const char *)f->last_hdr, f->last_hdr_len);
}

/* udp_touched() -> (frames, bytes, [(slot, datagrams, bytes, blocked, errno, last_active), ...]): the
 * guest frames moved and, per flow they touched, what happened since the last call (then zeroed). */
static PyObject *plane_udp_touched(PyObject *op, PyObject *unused)
{
    Plane *self = (Plane *)op;
    (void)unused;
    if (!udp_ready(self))
        return NULL;
    struct dp_udp_table *t = &self->udp;
    PyObject *list = PyList_New(t->ntouched);
    if (!list)
        return NULL;
    for (uint32_t k = 0; k < t->ntouched; k++) {
        struct dp_udp_flow *f = &t->flows[t->touched[k]];
        PyObject *item = Py_BuildValue("(IKKKidK)", t->touched[k], (unsigned long long)f->up_datagrams,
                                       (unsigned long long)f->up_bytes, (unsigned long long)f->blocked, f->err,
                                       f->last_active, (unsigned long long)(f->down_bytes - f->down_taken));
        if (!item || PyList_SetItem(list, k, item) < 0) {
            Py_DECREF(list);
            return NULL;
        }
    }
    PyObject *result = Py_BuildValue("(KKN)", (unsigned long long)t->taken_frames, (unsigned long long)t->taken_bytes,
                                     list);
    if (!result)
        return NULL;
    for (uint32_t k = 0; k < t->ntouched; k++) {
        struct dp_udp_flow *f = &t->flows[t->touched[k]];
        f->up_datagrams = f->up_bytes = f->blocked = 0;
        f->down_taken = f->down_bytes;
        f->err = 0;
        f->touched = 0;
    }
    t->ntouched = 0;
    t->taken_frames = t->taken_bytes = 0;
    t->attention = 0;
    return result;
}

/* udp_sink(tap_fd, vnet, counters, on_error): where udp_readable() writes and counts. */
static PyObject *plane_udp_sink(PyObject *op, PyObject *args)
{
    Plane *self = (Plane *)op;
    int fd, vnet;
    PyObject *counters, *on_error;
    if (!udp_ready(self) || !PyArg_ParseTuple(args, "ipOO", &fd, &vnet, &counters, &on_error))
        return NULL;
    if (!PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError, "udp_sink: on_error must be callable");
        return NULL;
    }
    for (int k = 0; k < SK_COUNT; k++)
        if (!self->sink_keys[k] && !(self->sink_keys[k] = PyUnicode_InternFromString(sink_key_names[k])))
            return NULL;
    self->sink_fd = fd;
    self->sink_vnet = vnet;
    PyObject *old_counters = self->sink_counters, *old_on_error = self->sink_on_error;
    self->sink_counters = Py_NewRef(counters);
    self->sink_on_error = Py_NewRef(on_error);
    Py_XDECREF(old_counters);
    Py_XDECREF(old_on_error);
    Py_RETURN_NONE;
}

/* the stack's counters[key] += n (a missing name counts from 0, as collections.Counter) */
static int bump(Plane *self, int key, uint64_t n)
{
    if (!n)
        return 0;
    PyObject *counters = self->sink_counters, *name = self->sink_keys[key];
    PyObject *old = PyObject_GetItem(counters, name);
    if (!old) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            return -1;
        PyErr_Clear();
    }
    PyObject *add = PyLong_FromUnsignedLongLong((unsigned long long)n);
    PyObject *sum = add && old ? PyNumber_Add(old, add) : Py_XNewRef(add);
    int r = sum ? PyObject_SetItem(counters, name, sum) : -1;
    Py_XDECREF(sum);
    Py_XDECREF(add);
    Py_XDECREF(old);
    return r;
}

/* udp_readable(slot): the loop's reader of an adopted flow's host socket (no Python frame runs):
 * its datagrams to the guest (dp_udp_host) at the plane's clock, the stack's counters
 * bumped, the flow's figures left for udp_touched(), a socket error to on_error(slot, errno). */
static PyObject *plane_udp_readable(PyObject *op, PyObject *arg)
{
    Plane *self = (Plane *)op;
    int slot;
    struct dp_udp_flow *f;
    if (!udp_ready(self) || !(f = flow_at(self, arg, &slot)))
        return NULL;
    if (!self->sink_counters) {
        PyErr_SetString(PyExc_ValueError, "udp_readable: no udp_sink()");
        return NULL;
    }
    uint64_t frames = 0, bytes = 0, werr = 0;
    int guest_err = f->err; /* a send error of the guest direction stays for udp_touched() */
    f->err = 0;
    int moved = dp_udp_host(&self->udp, slot, self->sink_fd, self->sink_vnet, tcpnat_now(), self->udp_scratch,
                            DP_UDP_SCRATCH, &frames, &bytes, &werr);
    int err = f->err;
    f->err = guest_err;
    if (moved > 0 && (bump(self, SK_DGRAMS_DOWN, (uint64_t)moved) < 0 || bump(self, SK_FRAMES_OUT, frames) < 0 ||
                      bump(self, SK_BYTES_OUT, bytes) < 0))
        return NULL;
    if (werr && bump(self, SK_TAP_WERR, werr) < 0)
        return NULL;
    if (err)
        return PyObject_CallFunction(self->sink_on_error, "ii", slot, err);
    Py_RETURN_NONE;
}

/* attach_tcp(engine | None): frames of the TcpEngine's flows are handed to it, not to Python. */
static PyObject *plane_attach_tcp(PyObject *op, PyObject *arg)
{
    Plane *self = (Plane *)op;
    if (arg != Py_None && !tcpnat_engine_of(arg)) {
        PyErr_SetString(PyExc_TypeError, "attach_tcp() takes an open TcpEngine or None");
        return NULL;
    }
    PyObject *old = self->tcp;
    self->tcp = arg == Py_None ? NULL : Py_NewRef(arg);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* *slot = arg (a callable; None: NULL), the old reference dropped; what names the method in the
 * TypeError of anything else. */
static PyObject *set_hook(PyObject **slot, PyObject *arg, const char *what)
{
    if (arg != Py_None && !PyCallable_Check(arg)) {
        PyErr_Format(PyExc_TypeError, "%s() takes a callable or None", what);
        return NULL;
    }
    PyObject *old = *slot;
    *slot = arg == Py_None ? NULL : Py_NewRef(arg);
    Py_XDECREF(old);
    Py_RETURN_NONE;
}

/* syn_lane(callable | None): where plain guest SYNs of no native flow go (syn_lane() above); only
 * with an attached TcpEngine (no engine: every frame is Python's, as before). */
static PyObject *plane_syn_lane(PyObject *op, PyObject *arg)
{
    return set_hook(&((Plane *)op)->syn, arg, "syn_lane");
}

/* after(callable | None): called with no argument at the end of each ready() batch, whatever it
 * read (a fair scheduler's safe point between one guest's batches); None: nothing. */
static PyObject *plane_after(PyObject *op, PyObject *arg)
{
    return set_hook(&((Plane *)op)->after, arg, "after");
}

static PyMethodDef plane_methods[] = {
    {"after", plane_after, METH_O,
     "after(hook | None): hook() at the end of each ready() batch (a fair scheduler's safe point)"},
    {"syn_lane", plane_syn_lane, METH_O,
     "syn_lane(syn | None): a plain guest SYN of no native flow, read while an engine is attached and before any "
     "frame for Python in its batch, goes to syn(frame, v6, l4_off, end, sport, dport, seq, wnd, mss, wscale, sack, "
     "now) -> bool "
     "(False: with the batch's frames to deliver)"},
    {"attach_tcp", plane_attach_tcp, METH_O, "attach_tcp(engine | None): native TCP flows take their frames"},
    {"read_tap", plane_read_tap, METH_VARARGS,
     "read_tap(fd, now=0.0) -> (frames, csum_ok | None, end, errno, taken): up to batch frames of a TAP fd, "
     "read until EAGAIN; adopted UDP flows' frames moved in C (taken)"},
    {"ready", plane_ready, METH_VARARGS,
     "ready(fd, clock, deliver, taken, ended): the TAP fd's loop reader: one batch as read_tap at clock(), then "
     "taken(n), ended() and deliver(frames, csum_ok, end, errno) only when there is something for Python"},
    {"udp_enable", plane_udp_enable, METH_O, "udp_enable(capacity): native UDP flows, at most capacity at once"},
    {"udp_adopt", plane_udp_adopt, METH_VARARGS,
     "udp_adopt(fd, guest_ip, guest_port, remote_ip, remote_port, eth, hlim, mtu, now) -> slot, or -1"},
    {"udp_release", plane_udp_release, METH_O, "udp_release(slot)"},
    {"udp_last_header", plane_udp_last_header, METH_O, "udp_last_header(slot) -> the guest's last IP header + 8"},
    {"udp_touched", plane_udp_touched, METH_NOARGS,
     "udp_touched() -> (frames, bytes, [(slot, datagrams, bytes, blocked, errno, last_active, bytes_down), ...])"},
    {"udp_sink", plane_udp_sink, METH_VARARGS,
     "udp_sink(tap_fd, vnet, counters, on_error): where udp_readable() writes frames and counts"},
    {"udp_readable", plane_udp_readable, METH_O,
     "udp_readable(slot): a host socket's loop reader: its datagrams to the guest, counters bumped, the flow's "
     "figures for udp_touched(), an error to on_error(slot, errno)"},
    {"classify", plane_classify, METH_O, "classify(buf) -> record tuple, counted in counters()"},
    {"counters", plane_counters, METH_NOARGS, "counters() -> {'frames': n, reason: n}"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot plane_slots[] = {
    {Py_tp_doc, "Plane(read_size, batch, vnet=False): the native data plane of one transport"},
    {Py_tp_init, plane_init},
    {Py_tp_dealloc, plane_dealloc},
    {Py_tp_traverse, plane_traverse},
    {Py_tp_clear, plane_clear},
    {Py_tp_methods, plane_methods},
    {0, NULL},
};

static PyType_Spec plane_spec = {
    "aioslirp.native._dataplane.Plane", sizeof(Plane), 0, Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC, plane_slots,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"classify", (PyCFunction)(void (*)(void))mod_classify, METH_VARARGS | METH_KEYWORDS,
     "classify(buf, vnet=False) -> record tuple (not counted)"},
    {"reason_names", mod_reason_names, METH_NOARGS, "reason_names() -> tuple of reason names by code"},
    {"reason_names6", mod_reason_names6, METH_NOARGS, "reason_names6() -> the IPv6 names of the same reasons"},
    {"udp_frames", mod_udp_frames, METH_VARARGS,
     "udp_frames(eth, src, dst, sport, dport, payload, hlim, mtu, ident4, ident6) -> list[bytes]"},
    {"udp_checksum_ok", mod_udp_checksum_ok, METH_VARARGS, "udp_checksum_ok(src, dst, udp, trusted=False) -> bool"},
    {"set_yield", mod_set_yield, METH_VARARGS,
     "set_yield(fd, serve, every_us=0) -> bool: arm the fair scheduler's yield point (fd -1: disarm)"},
    {"yield_counters", mod_yield_counters, METH_NOARGS, "yield_counters() -> (polls, served)"},
    {"span_lines", tj_span_lines, METH_VARARGS,
     "span_lines(entries, resource, fallback) -> (bytes, lines): a batch of JsonLinesSink's writer (_tracejson.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "aioslirp.native._dataplane", "aioslirp's native data plane (C core, limited API)", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__dataplane(void)
{
    PyObject *m = PyModule_Create(&module_def);
    if (!m)
        return NULL;
    PyObject *plane = PyType_FromSpec(&plane_spec);
    if (!plane || PyModule_AddObjectRef(m, "Plane", plane) < 0)
        goto fail;
    Py_DECREF(plane);
    plane = NULL;
    if (tcpnat_add_type(m) < 0)
        goto fail;
    if (PyModule_AddIntConstant(m, "RECORD_SIZE", (long)sizeof(struct dp_frame)) < 0 ||
        PyModule_AddIntConstant(m, "KIND_DROP", DP_KIND_DROP) < 0 ||
        PyModule_AddIntConstant(m, "KIND_TCP", DP_KIND_TCP) < 0 ||
        PyModule_AddIntConstant(m, "KIND_UDP", DP_KIND_UDP) < 0 ||
        PyModule_AddIntConstant(m, "KIND_NOT_NATIVE", DP_KIND_NOT_NATIVE) < 0 ||
        PyModule_AddIntConstant(m, "READ_DONE", DP_READ_DONE) < 0 ||
        PyModule_AddIntConstant(m, "READ_AGAIN", DP_READ_AGAIN) < 0 ||
        PyModule_AddIntConstant(m, "READ_EOF", DP_READ_EOF) < 0 ||
        PyModule_AddIntConstant(m, "READ_ERROR", DP_READ_ERROR) < 0 ||
        PyModule_AddIntConstant(m, "VNET_HDR_LEN", DP_VNET_HDR_LEN) < 0)
        goto fail;
    return m;
fail:
    Py_XDECREF(plane);
    Py_DECREF(m);
    return NULL;
}
