/* The CPython binding of the native TCP NAT engine (tcpnat.c): the type TcpEngine of the
 * module aioslirp.native._dataplane (limited API 3.11), with the real I/O seam (syscalls:
 * sockets on one epoll, one timerfd in it, frames written to the TAP fd) or a fake one (fake
 * sockets in memory, frames collected: tests drive the core with a fake clock).
 *
 *   TcpEngine(tap_fd, vnet, offload, gw_mac, mtu, max_flows, rcv_buf, idle_timeout,
 *             connect_timeout, linger, fake=False, time_wait=1.0, peek_off=True, sink=None,
 *             ack_delay=0.0)                        (ack_delay: seconds, 0..0.5, tcp_ack_delay)
 *     (sink: a vhost-user device's frame sink, Device.tcp_sink() of aioslirp.native._vhost: the
 *     frames for the guest go into its RX ring, not to tap_fd; tcpsink.h)
 *     (peek_off=False: peek past the unacknowledged bytes into a discard buffer, as without SO_PEEK_OFF)
 *     .fileno() -> the epoll fd to watch for reading (-1 fake)
 *     .adopt(v6, guest_mac, guest_ip, guest_port, dst_ip, dst_port, host_ip, host_port,
 *            irs, iss, mss, wscale, wnd, now) -> (status, slot, gen)
 *     .poll(now=None) -> [(slot, gen, kind, outcome, why, errno, bytes_up, bytes_down), ...]
 *     .input(frame, csum_ok, now) -> bool             (one guest frame, no vnet header)
 *     .close_flow(slot, gen, now) -> bool
 *     .info(slot, gen) -> (state, last_active, bytes_up, bytes_down, snd_wnd, rcv_wnd) | None
 *     .records() -> the records of poll() alone (no socket events, no timers)
 *     .counters() -> dict; .live() -> int; .forget_tap(); .pending() -> bool; .hook_records(on); .close()
 *     .allow(up=..., down=...) -> int                  (allowances: bytes, None no bound; tn_allow)
 *     .moved() -> (charged_up, bytes_down); .meter(on, min_bytes=0) (pending() also when bytes moved since moved())
 *     .trace(capacity)                                 (trace points on, a ring of capacity records; 0 off)
 *     .trace_take() -> ([(type, slot, gen, t_ns, dur_ns, a, b, c, tcp_flags), ...], overflow)  (slot -1: no flow)
 *     .trace_pending() -> int                           (trace records waiting to be taken)
 *     .trace_json(spans, frames, off_ns, seed, guest, resource) -> (text, lines)  (the records as
 *       the trace file's JSON lines, formatted in C, text as bytes: _tracejson.c)
 *   fake only: .fake_connect_mode(err), .fake_frames() -> [bytes], .fake_connect_done(fd, err, now),
 *     .fake_host_send(fd, data, now), .fake_host_eof(fd, now), .fake_host_reset(fd, now),
 *     .fake_send_space(fd, n, now), .fake_received(fd) -> bytes, .fake_socket(fd) -> dict
 *
 * MIT licensed, written for aioslirp. */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdlib.h>
#include <string.h>
#include <linux/sockios.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#include "_tcpnat.h"
#include "_tracejson.h"
#include "tcpnat.h"
#include "tcpsink.h"

#ifndef SO_PEEK_OFF
#define SO_PEEK_OFF 42
#endif

#define TIMER_TAG UINT64_MAX
#define FAKE_FDS 4096
#define FAKE_FD0 100000
#define FAKE_BUF_MAX (64u << 20)

struct fake_sock {
    int used, closed, aborted, shut_wr, eof, reset, connect_err, pending_err, watch_out;
    uint64_t tag;
    uint8_t *rx;        /* host -> guest bytes not consumed yet */
    size_t rx_len, rx_cap;
    uint8_t *tx;        /* guest -> host bytes the host received */
    size_t tx_len, tx_cap;
    long space;         /* bytes send() takes now, -1 unlimited */
    long sends;         /* send() and sendmsg() calls that took bytes */
};

typedef struct {
    PyObject_HEAD
    struct tn_engine *e;
    int tap_fd, epfd, tfd, fake, peek_off;
    int hooked; /* the TAP reader's caller takes the records after each batch (pending()): no wake-up */
    int metered; /* pending() also says bytes moved since the last moved() (meter()) */
    uint64_t meter_min; /* ... at least this many (0: any) */
    uint64_t seen_up, seen_down; /* the totals the last moved() returned */
    double armed; /* the timerfd's deadline, 0 none */
    /* fake */
    struct fake_sock *fs;
    int fake_connect;
    PyObject *frames; /* list of bytes written to the TAP */
    /* a vhost-user device's frame sink (tcpsink.h) instead of the TAP fd, and its capsule (held) */
    const struct tcpsink *sink;
    PyObject *sink_owner;
} Engine;

/* The end of one of the engine's turns: a sink publishes what was written and calls the guest. */
static void sink_flush(Engine *g)
{
    if (g->sink)
        g->sink->flush(g->sink->ctx);
}

static double mono_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ the real seam */

static int r_open(void *ctx, int v6)
{
    Engine *g = ctx;
    int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    int one = 1, zero = 0;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (g->peek_off)
        setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &zero, sizeof zero);
    return fd;
}

static socklen_t fill_addr(struct sockaddr_storage *ss, int v6, const uint8_t *addr, uint16_t port)
{
    memset(ss, 0, sizeof *ss);
    if (v6) {
        struct sockaddr_in6 *a = (struct sockaddr_in6 *)ss;
        a->sin6_family = AF_INET6;
        a->sin6_port = htons(port);
        memcpy(&a->sin6_addr, addr, 16);
        return sizeof *a;
    }
    struct sockaddr_in *a = (struct sockaddr_in *)ss;
    a->sin_family = AF_INET;
    a->sin_port = htons(port);
    memcpy(&a->sin_addr, addr, 4);
    return sizeof *a;
}

static int r_connect(void *ctx, int fd, int v6, const uint8_t *addr, uint16_t port)
{
    (void)ctx;
    struct sockaddr_storage ss;
    socklen_t len = fill_addr(&ss, v6, addr, port);
    if (connect(fd, (struct sockaddr *)&ss, len) == 0)
        return 0;
    if (errno != EINPROGRESS)
        return -errno;
    /* towards loopback the handshake is usually done inside connect(): asking again says so */
    if (connect(fd, (struct sockaddr *)&ss, len) == 0 || errno == EISCONN)
        return 0;
    if (errno == EALREADY || errno == EINPROGRESS)
        return -EINPROGRESS;
    return -errno;
}

static int r_error(void *ctx, int fd)
{
    (void)ctx;
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0)
        return -errno;
    return -err;
}

static int r_watch(void *ctx, int fd, uint64_t tag, int out)
{
    Engine *g = ctx;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET | (out ? EPOLLOUT : 0), .data.u64 = tag};
    return epoll_ctl(g->epfd, EPOLL_CTL_ADD, fd, &ev) < 0 ? -errno : 0;
}

static int r_want_out(void *ctx, int fd, uint64_t tag)
{
    Engine *g = ctx;
    struct epoll_event ev = {.events = EPOLLIN | EPOLLOUT | EPOLLRDHUP | EPOLLET, .data.u64 = tag};
    return epoll_ctl(g->epfd, EPOLL_CTL_MOD, fd, &ev) < 0 ? -errno : 0;
}

static ssize_t r_send(void *ctx, int fd, const uint8_t *buf, size_t len)
{
    (void)ctx;
    ssize_t n = send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
    return n < 0 ? -errno : n;
}

static ssize_t r_sendv(void *ctx, int fd, const struct iovec *iov, int iovcnt)
{
    (void)ctx;
    struct msghdr mh = {.msg_iov = (struct iovec *)iov, .msg_iovlen = (size_t)iovcnt};
    ssize_t n = sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL);
    return n < 0 ? -errno : n;
}

static uint8_t discard_buf[TN_DISCARD];

static ssize_t r_peek(void *ctx, int fd, uint8_t *buf, size_t len, size_t skip)
{
    Engine *g = ctx;
    ssize_t n;
    if (g->peek_off) {
        n = recv(fd, buf, len, MSG_PEEK | MSG_DONTWAIT);
        return n < 0 ? -errno : n;
    }
    if (skip > sizeof discard_buf) /* the core keeps in-flight bytes below TN_DISCARD */
        return -EINVAL;
    struct iovec iov[2] = {{discard_buf, skip}, {buf, len}};
    struct msghdr mh = {.msg_iov = iov + (skip ? 0 : 1), .msg_iovlen = skip ? 2 : 1};
    n = recvmsg(fd, &mh, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0)
        return -errno;
    if (n == 0)
        return 0;
    if ((size_t)n <= skip) /* nothing new (the end of stream shows once all is acknowledged) */
        return -EAGAIN;
    return n - (ssize_t)skip;
}

/* r_peek into pieces (guest memory: the frames a vhost-user sink reserved, tcpsink.h). */
static ssize_t r_peekv(void *ctx, int fd, const struct iovec *iov, int iovcnt, size_t skip)
{
    Engine *g = ctx;
    struct iovec v[TN_DIRECT_IOV + 1];
    if (iovcnt < 1 || iovcnt > (int)TN_DIRECT_IOV)
        return -EINVAL;
    if (g->peek_off)
        skip = 0;
    else if (skip > sizeof discard_buf)
        return -EINVAL;
    int k = 0;
    if (skip) {
        v[0].iov_base = discard_buf;
        v[0].iov_len = skip;
        k = 1;
    }
    memcpy(v + k, iov, sizeof *iov * (size_t)iovcnt);
    struct msghdr mh = {.msg_iov = v, .msg_iovlen = (size_t)(k + iovcnt)};
    ssize_t n = recvmsg(fd, &mh, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0)
        return -errno;
    if (n == 0)
        return 0;
    if ((size_t)n <= skip)
        return -EAGAIN;
    return n - (ssize_t)skip;
}

static int r_reserve(void *ctx, size_t head, size_t payload, struct iovec *iov, int max_iov)
{
    Engine *g = ctx;
    return g->sink ? g->sink->reserve(g->sink->ctx, head, payload, iov, max_iov) : 0;
}

static int r_commit(void *ctx, const uint8_t *hdr, size_t hdr_len, size_t payload)
{
    Engine *g = ctx;
    return g->sink ? g->sink->commit(g->sink->ctx, hdr, hdr_len, payload) : -EBADF;
}

static void r_release(void *ctx)
{
    Engine *g = ctx;
    if (g->sink)
        g->sink->release(g->sink->ctx);
}

static ssize_t r_consume(void *ctx, int fd, size_t n)
{
    (void)ctx;
    size_t done = 0;
    while (done < n) {
        ssize_t r = recv(fd, NULL, n - done, MSG_TRUNC | MSG_DONTWAIT);
        if (r < 0)
            return done ? (ssize_t)done : -errno;
        if (r == 0)
            break;
        done += (size_t)r;
    }
    return (ssize_t)done;
}

static int r_rewind(void *ctx, int fd, size_t off)
{
    Engine *g = ctx;
    int v = (int)off;
    if (!g->peek_off)
        return 0;
    return setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &v, sizeof v) < 0 ? -errno : 0;
}

static int r_shutdown(void *ctx, int fd)
{
    (void)ctx;
    return shutdown(fd, SHUT_WR) < 0 ? -errno : 0;
}

static ssize_t r_space(void *ctx, int fd, uint32_t *queued)
{
    (void)ctx;
    int sndbuf = 0, outq = 0;
    socklen_t len = sizeof sndbuf;
    if (getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, &len) < 0 || ioctl(fd, SIOCOUTQ, &outq) < 0)
        return -errno;
    *queued = outq > 0 ? (uint32_t)outq : 0;
    long room = (long)sndbuf / 2 - outq; /* SO_SNDBUF counts the kernel's overhead: half is payload */
    return room > 0 ? room : 0;
}

static void r_close(void *ctx, int fd, int abort)
{
    (void)ctx;
    if (abort) {
        struct linger l = {1, 0};
        setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    }
    close(fd);
}

static int r_tap_write(void *ctx, const struct iovec *iov, int n)
{
    Engine *g = ctx;
    if (g->sink)
        return g->sink->write(g->sink->ctx, iov, n);
    if (g->tap_fd < 0) /* the transport closed its fd (which another open may reuse) */
        return -EBADF;
    ssize_t r = writev(g->tap_fd, iov, n);
    return r < 0 ? -errno : 0;
}

static const struct tn_io real_io = {
    NULL, r_open, r_connect, r_error, r_watch, r_want_out, r_send, r_sendv, r_peek, r_consume, r_rewind, r_shutdown, r_space, r_close,
    r_tap_write, NULL, NULL, NULL, NULL, /* in place: set with a sink that offers it */
};

/* Does the kernel let a TCP socket peek at an offset (SO_PEEK_OFF, Linux 6.9)? */
static int probe_peek_off(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0), zero = 0;
    if (fd < 0)
        return 0;
    int ok = setsockopt(fd, SOL_SOCKET, SO_PEEK_OFF, &zero, sizeof zero) == 0;
    close(fd);
    return ok;
}

/* ------------------------------------------------------------------ the fake seam */

static struct fake_sock *fake_get(Engine *g, int fd)
{
    if (!g->fs || fd < FAKE_FD0 || fd >= FAKE_FD0 + FAKE_FDS)
        return NULL;
    struct fake_sock *s = &g->fs[fd - FAKE_FD0];
    return s->used ? s : NULL;
}

static int grow(uint8_t **buf, size_t *cap, size_t need)
{
    if (need <= *cap)
        return 0;
    if (need > FAKE_BUF_MAX)
        return -1;
    size_t c = *cap ? *cap : 4096;
    while (c < need)
        c *= 2;
    uint8_t *b = realloc(*buf, c);
    if (!b)
        return -1;
    *buf = b;
    *cap = c;
    return 0;
}

static int f_open(void *ctx, int v6)
{
    Engine *g = ctx;
    (void)v6;
    for (int i = 0; i < FAKE_FDS; i++) {
        struct fake_sock *s = &g->fs[i];
        if (!s->used) {
            free(s->rx);
            free(s->tx);
            memset(s, 0, sizeof *s);
            s->used = 1;
            s->space = -1;
            return FAKE_FD0 + i;
        }
    }
    return -EMFILE;
}

static int f_connect(void *ctx, int fd, int v6, const uint8_t *addr, uint16_t port)
{
    Engine *g = ctx;
    (void)v6, (void)addr, (void)port;
    struct fake_sock *s = fake_get(g, fd);
    if (!s)
        return -EBADF;
    s->connect_err = g->fake_connect;
    return g->fake_connect ? -g->fake_connect : 0;
}

static int f_error(void *ctx, int fd)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s)
        return -EBADF;
    int e = s->pending_err;
    s->pending_err = 0;
    return -e;
}

static int f_watch(void *ctx, int fd, uint64_t tag, int out)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s)
        return -EBADF;
    s->tag = tag;
    s->watch_out = out;
    return 0;
}

static int f_want_out(void *ctx, int fd, uint64_t tag)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s)
        return -EBADF;
    s->tag = tag;
    s->watch_out = 1;
    return 0;
}

static ssize_t f_send(void *ctx, int fd, const uint8_t *buf, size_t len)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s || s->closed)
        return -EBADF;
    if (s->reset)
        return -ECONNRESET;
    if (s->shut_wr)
        return -EPIPE;
    if (s->space >= 0 && (size_t)s->space < len)
        len = (size_t)s->space;
    if (len == 0)
        return -EAGAIN;
    if (grow(&s->tx, &s->tx_cap, s->tx_len + len) < 0)
        return -ENOBUFS;
    memcpy(s->tx + s->tx_len, buf, len);
    s->tx_len += len;
    s->sends++;
    if (s->space >= 0)
        s->space -= (long)len;
    return (ssize_t)len;
}

/* as sendmsg: the buffers in order, a prefix taken; an error only when nothing was */
static ssize_t f_sendv(void *ctx, int fd, const struct iovec *iov, int iovcnt)
{
    ssize_t total = 0;
    struct fake_sock *s = fake_get(ctx, fd);
    long sends = s ? s->sends : 0;
    for (int i = 0; i < iovcnt; i++) {
        ssize_t r = f_send(ctx, fd, iov[i].iov_base, iov[i].iov_len);
        if (r < 0)
            return total ? total : r;
        total += r;
        if ((size_t)r < iov[i].iov_len)
            break;
    }
    if (s && total)
        s->sends = sends + 1; /* one sendmsg */
    return total;
}

static ssize_t f_peek(void *ctx, int fd, uint8_t *buf, size_t len, size_t skip)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s || s->closed)
        return -EBADF;
    if (s->reset)
        return -ECONNRESET;
    if (skip >= s->rx_len)
        return s->eof ? 0 : -EAGAIN;
    size_t n = s->rx_len - skip;
    if (n > len)
        n = len;
    memcpy(buf, s->rx + skip, n);
    return (ssize_t)n;
}

static ssize_t f_consume(void *ctx, int fd, size_t n)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s || s->closed)
        return -EBADF;
    if (n > s->rx_len)
        n = s->rx_len;
    memmove(s->rx, s->rx + n, s->rx_len - n);
    s->rx_len -= n;
    return (ssize_t)n;
}

static int f_rewind(void *ctx, int fd, size_t off)
{
    (void)ctx, (void)fd, (void)off;
    return 0;
}

static int f_shutdown(void *ctx, int fd)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s)
        return -EBADF;
    s->shut_wr = 1;
    return 0;
}

static ssize_t f_space(void *ctx, int fd, uint32_t *queued)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s)
        return -EBADF;
    *queued = s->space >= 0 ? 1 : 0; /* a limited fake socket is one whose peer reads slowly */
    return s->space < 0 ? (ssize_t)1 << 30 : (ssize_t)s->space;
}

static void f_close(void *ctx, int fd, int abort)
{
    struct fake_sock *s = fake_get(ctx, fd);
    if (!s)
        return;
    s->closed = 1;
    s->aborted = abort;
}

static int f_tap_write(void *ctx, const struct iovec *iov, int n)
{
    Engine *g = ctx;
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += iov[i].iov_len;
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (!b)
        return -ENOMEM;
    char *p = PyBytes_AsString(b);
    for (int i = 0; i < n; i++) {
        memcpy(p, iov[i].iov_base, iov[i].iov_len);
        p += iov[i].iov_len;
    }
    int r = PyList_Append(g->frames, b);
    Py_DECREF(b);
    return r < 0 ? -ENOMEM : 0;
}

static const struct tn_io fake_io = {
    NULL, f_open, f_connect, f_error, f_watch, f_want_out, f_send, f_sendv, f_peek, f_consume, f_rewind, f_shutdown, f_space, f_close,
    f_tap_write, NULL, NULL, NULL, NULL,
};

/* ------------------------------------------------------------------ the type */

/* A new engine owns no fd yet: -1, so that the dealloc of one whose __init__ failed (a bad
 * argument) closes nothing (zeroed memory would be fd 0: the process's stdin). */
static PyObject *engine_new(PyTypeObject *tp, PyObject *args, PyObject *kwargs)
{
    (void)args;
    (void)kwargs;
    allocfunc alloc = (allocfunc)PyType_GetSlot(tp, Py_tp_alloc);
    Engine *g = (Engine *)alloc(tp, 0);
    if (g) {
        g->epfd = g->tfd = -1;
        g->tap_fd = -1;
    }
    return (PyObject *)g;
}

static int engine_init(PyObject *op, PyObject *args, PyObject *kwargs)
{
    Engine *g = (Engine *)op;
    static char *kwlist[] = {"tap_fd", "vnet", "offload", "gw_mac", "mtu", "max_flows", "rcv_buf", "idle_timeout",
                             "connect_timeout", "linger", "fake", "time_wait", "peek_off", "rate_up", "rate_down",
                             "sink", "ack_delay", NULL};
    int tap_fd, vnet, offload, fake = 0, peek_off = 1;
    PyObject *sink = Py_None;
    double time_wait = 1.0, ack_delay = 0.0;
    unsigned long long rate_up = 0, rate_down = 0;
    Py_buffer mac;
    unsigned int mtu, max_flows, rcv_buf;
    double idle, connect_to, linger;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "ippy*IIIddd|pdpKKOd", kwlist, &tap_fd, &vnet, &offload, &mac, &mtu,
                                     &max_flows, &rcv_buf, &idle, &connect_to, &linger, &fake, &time_wait,
                                     &peek_off, &rate_up, &rate_down, &sink, &ack_delay))
        return -1;
    const struct tcpsink *sk = NULL;
    if (sink != Py_None) {
        sk = PyCapsule_GetPointer(sink, TCPSINK_CAPSULE);
        if (!sk || fake || !vnet) {
            PyBuffer_Release(&mac);
            if (sk)
                PyErr_SetString(PyExc_ValueError, "sink: needs vnet and a real engine (not fake)");
            return -1;
        }
    }
    if (g->e) {
        PyBuffer_Release(&mac);
        PyErr_SetString(PyExc_RuntimeError, "TcpEngine already initialised");
        return -1;
    }
    struct tn_config cfg = {0};
    if (mac.len != 6) {
        PyBuffer_Release(&mac);
        PyErr_SetString(PyExc_ValueError, "gw_mac must be 6 bytes");
        return -1;
    }
    memcpy(cfg.gw_mac, mac.buf, 6);
    PyBuffer_Release(&mac);
    if (offload && !vnet) {
        PyErr_SetString(PyExc_ValueError, "offload needs vnet");
        return -1;
    }
    cfg.max_flows = max_flows;
    cfg.mtu = mtu;
    cfg.rcv_buf = rcv_buf;
    cfg.vnet = vnet;
    cfg.offload = offload;
    cfg.idle_timeout = idle;
    cfg.connect_timeout = connect_to;
    cfg.linger = linger;
    cfg.time_wait = time_wait;
    if (!(ack_delay >= 0 && ack_delay <= 0.5)) {
        PyErr_SetString(PyExc_ValueError, "TcpEngine: ack_delay must be 0..0.5 seconds");
        return -1;
    }
    cfg.ack_delay = ack_delay;
    if (rate_up > TN_RATE_MAX || rate_down > TN_RATE_MAX) {
        PyErr_Format(PyExc_ValueError, "TcpEngine: rate_up and rate_down must be 0..%llu bytes/s",
                     (unsigned long long)TN_RATE_MAX);
        return -1;
    }
    cfg.rate_up = rate_up;
    cfg.rate_down = rate_down;
    if (getentropy(cfg.hash_key, sizeof cfg.hash_key) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    g->tap_fd = tap_fd;
    g->epfd = g->tfd = -1;
    if (sk) {
        g->sink = sk;
        Py_INCREF(sink);
        g->sink_owner = sink;
    }
    g->fake = fake;
    struct tn_io io;
    if (fake) {
        g->fs = calloc(FAKE_FDS, sizeof *g->fs);
        g->frames = PyList_New(0);
        if (!g->fs || !g->frames) {
            PyErr_NoMemory();
            return -1;
        }
        io = fake_io;
        g->peek_off = 1;
    } else {
        g->peek_off = peek_off && probe_peek_off(); /* peek_off=False: the discard-buffer fallback (tests) */
        g->epfd = epoll_create1(EPOLL_CLOEXEC);
        g->tfd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
        if (g->epfd < 0 || g->tfd < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        struct epoll_event ev = {.events = EPOLLIN, .data.u64 = TIMER_TAG};
        if (epoll_ctl(g->epfd, EPOLL_CTL_ADD, g->tfd, &ev) < 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        io = real_io;
        if (sk && sk->reserve && sk->commit && sk->release) { /* frames written in place (tcpsink.h) */
            io.sock_peekv = r_peekv;
            io.rx_reserve = r_reserve;
            io.rx_commit = r_commit;
            io.rx_release = r_release;
        }
    }
    io.ctx = g;
    g->e = tn_new(&cfg, &io);
    if (!g->e) {
        PyErr_SetString(PyExc_ValueError, "TcpEngine: max_flows must be 1..4194304 and mtu 576..65521 (or no memory)");
        return -1;
    }
    return 0;
}

static void engine_release(Engine *g)
{
    if (g->e) {
        tn_free(g->e);
        g->e = NULL;
    }
    g->sink = NULL;
    Py_CLEAR(g->sink_owner);
    if (g->epfd >= 0)
        close(g->epfd);
    if (g->tfd >= 0)
        close(g->tfd);
    g->epfd = g->tfd = -1;
    if (g->fs) {
        for (int i = 0; i < FAKE_FDS; i++) {
            free(g->fs[i].rx);
            free(g->fs[i].tx);
        }
        free(g->fs);
        g->fs = NULL;
    }
}

static void engine_dealloc(PyObject *op)
{
    Engine *g = (Engine *)op;
    PyTypeObject *tp = Py_TYPE(op);
    engine_release(g);
    Py_CLEAR(g->frames);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(op);
    Py_DECREF(tp);
}

static int ready(Engine *g)
{
    if (!g->e) {
        PyErr_SetString(PyExc_ValueError, "TcpEngine is closed");
        return 0;
    }
    if (dp_yield_blocks(NULL, g->e)) { /* (the lane runs only sparse guests: not expected) */
        PyErr_SetString(PyExc_RuntimeError, "TcpEngine entered again while its turn yields");
        return 0;
    }
    return 1;
}

static int get_addr(PyObject *o, int v6, uint8_t *out, const char *name)
{
    Py_buffer b;
    if (PyObject_GetBuffer(o, &b, PyBUF_SIMPLE) < 0)
        return -1;
    Py_ssize_t want = v6 ? 16 : 4;
    if (b.len != want) {
        PyBuffer_Release(&b);
        PyErr_Format(PyExc_ValueError, "%s must be %zd bytes", name, want);
        return -1;
    }
    memcpy(out, b.buf, (size_t)want);
    PyBuffer_Release(&b);
    return 0;
}

/* The timerfd follows the engine's next deadline (re-armed only when it moves earlier or fired).
 * from_reader: the caller's records are taken without a wake-up when the engine is hooked (the TAP
 * reader's batch, whose caller takes them at once; an adoption, whose own end record Python takes
 * itself): pending records alone arm nothing. */
static void arm_timer(Engine *g, double now, int from_reader)
{
    if (g->fake || g->tfd < 0)
        return;
    double next = tn_next_deadline(g->e, now, from_reader && g->hooked);
    if (next < 0 || (g->armed > 0 && g->armed <= next && g->armed > now))
        return;
    if (next <= now)
        next = now + 1e-6;
    struct itimerspec its = {{0, 0}, {(time_t)next, (long)((next - (double)(time_t)next) * 1e9)}};
    if (its.it_value.tv_nsec >= 1000000000L)
        its.it_value.tv_nsec = 999999999L;
    timerfd_settime(g->tfd, TFD_TIMER_ABSTIME, &its, NULL);
    g->armed = next;
}

static PyObject *take_records(Engine *g)
{
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    struct tn_record recs[64];
    size_t n;
    while ((n = tn_take_records(g->e, recs, 64)) > 0) {
        for (size_t i = 0; i < n; i++) {
            const struct tn_record *r = &recs[i];
            PyObject *t = Py_BuildValue("(IIiiiiKK)", r->slot, r->gen, r->kind, r->outcome, r->why, (int)r->err,
                                        (unsigned long long)r->bytes_up, (unsigned long long)r->bytes_down);
            if (!t || PyList_Append(list, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(list);
                return NULL;
            }
            Py_DECREF(t);
        }
    }
    return list;
}

static PyObject *engine_adopt(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int v6;
    PyObject *gmac, *gip, *dip, *hip;
    unsigned int gport, dport, hport, irs, iss, wnd;
    int mss, wscale;
    double now;
    if (!PyArg_ParseTuple(args, "pOOIOIOIIIiiId", &v6, &gmac, &gip, &gport, &dip, &dport, &hip, &hport, &irs, &iss,
                          &mss, &wscale, &wnd, &now))
        return NULL;
    if (!ready(g))
        return NULL;
    struct tn_adopt a = {0};
    a.v6 = v6;
    Py_buffer b;
    if (PyObject_GetBuffer(gmac, &b, PyBUF_SIMPLE) < 0)
        return NULL;
    if (b.len != 6) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError, "guest_mac must be 6 bytes");
        return NULL;
    }
    memcpy(a.guest_mac, b.buf, 6);
    PyBuffer_Release(&b);
    if (get_addr(gip, v6, a.guest_ip, "guest_ip") < 0 || get_addr(dip, v6, a.dst_ip, "dst_ip") < 0 ||
        get_addr(hip, v6, a.host_ip, "host_ip") < 0)
        return NULL;
    if (gport > 65535 || dport > 65535 || hport > 65535 || wnd > 65535 || mss > 65535 || wscale > 255) {
        PyErr_SetString(PyExc_ValueError, "adopt: a port, window or option out of range");
        return NULL;
    }
    a.guest_port = (uint16_t)gport;
    a.dst_port = (uint16_t)dport;
    a.host_port = (uint16_t)hport;
    a.irs = irs;
    a.iss = iss;
    a.mss = mss;
    a.wscale = wscale;
    a.wnd = wnd;
    uint32_t slot = 0, gen = 0;
    int r = tn_adopt(g->e, &a, now, &slot, &gen);
    sink_flush(g);
    /* (in the SYN lane the reader's batch is still running: the records an earlier frame of it left
     * are taken when it ends, not by a timer set to fire now, three timerfd_settime() a connection) */
    arm_timer(g, now, 1);
    return Py_BuildValue("(iII)", r, slot, gen);
}

static PyObject *engine_poll(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    PyObject *nowo = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &nowo))
        return NULL;
    if (g->e && dp_yield_blocks(NULL, g->e)) /* its own reader, from a yield point of its turn: later */
        Py_RETURN_NONE;
    if (!ready(g))
        return NULL;
    double now = nowo == Py_None ? mono_now() : PyFloat_AsDouble(nowo);
    if (now == -1.0 && PyErr_Occurred())
        return NULL;
    uint32_t nsock = 0, ntimer = 0;
    uint64_t t0 = tn_tracing(g->e) ? tn_clock_ns() : 0; /* the wake-up trace point's start */
    if (!g->fake) {
        struct epoll_event evs[64];
        int n;
        do {
            n = epoll_wait(g->epfd, evs, 64, 0);
            for (int i = 0; i < n; i++) {
                if (evs[i].data.u64 == TIMER_TAG) {
                    uint64_t x;
                    if (read(g->tfd, &x, sizeof x) < 0) {
                        /* EAGAIN: fired and read already */
                    }
                    g->armed = 0;
                    ntimer++;
                    continue;
                }
                nsock++;
                tn_sock_event(g->e, evs[i].data.u64, evs[i].events, now);
                dp_yield(NULL, g->e); /* (a light guest's input first, when it waits behind this poll) */
            }
        } while (n == 64);
    }
    tn_timers(g->e, now);
    if (t0 && (nsock || ntimer))
        tn_trace_wake(g->e, nsock, ntimer, t0);
    tn_flush(g->e, now);
    sink_flush(g);
    PyObject *recs = take_records(g);
    arm_timer(g, now, 0);
    return recs;
}

static PyObject *engine_input(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    Py_buffer b;
    int csum_ok;
    double now;
    if (!PyArg_ParseTuple(args, "y*pd", &b, &csum_ok, &now))
        return NULL;
    if (!ready(g)) {
        PyBuffer_Release(&b);
        return NULL;
    }
    int took = tcpnat_tap_frame(g, (const uint8_t *)b.buf, (size_t)b.len, csum_ok, now);
    tn_flush(g->e, now);
    sink_flush(g);
    PyBuffer_Release(&b);
    arm_timer(g, now, 0);
    return PyBool_FromLong(took);
}

/* input_pieces(frame, piece, now) -> 1, 0 or -1: the frame as the vhost-user walker hands it in
 * place (frame_zc: a copy of its head, the whole frame in pieces of piece bytes; the checksum
 * vouched for); -1: not taken that way (the caller sends it through input()). */
static PyObject *engine_input_pieces(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    Py_buffer b;
    Py_ssize_t piece;
    double now;
    if (!PyArg_ParseTuple(args, "y*nd", &b, &piece, &now))
        return NULL;
    if (!ready(g) || piece < 1) {
        if (piece < 1 && !PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "piece must be >= 1");
        PyBuffer_Release(&b);
        return NULL;
    }
    struct iovec v[TN_GATHER_MAX];
    uint8_t head[TN_ZC_HEAD];
    size_t len = (size_t)b.len, hl = len < TN_ZC_HEAD ? len : TN_ZC_HEAD;
    int n = 0, took = -1;
    for (size_t at = 0; at < len && n <= (int)TN_GATHER_MAX; at += (size_t)piece) {
        if (n < (int)TN_GATHER_MAX) {
            v[n].iov_base = (uint8_t *)b.buf + at;
            v[n].iov_len = len - at < (size_t)piece ? len - at : (size_t)piece;
        }
        n++;
    }
    if (n <= (int)TN_GATHER_MAX) {
        memcpy(head, b.buf, hl);
        took = tcpnat_frame_zc(g, head, hl, v, n, len, 1, now);
        tn_flush(g->e, now); /* (the gather sent before the frame's memory is released) */
        sink_flush(g);
        arm_timer(g, now, 0);
    }
    PyBuffer_Release(&b);
    return PyLong_FromLong(took);
}

static PyObject *engine_input_batch(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    PyObject *frames;
    int csum_ok;
    double now;
    if (!PyArg_ParseTuple(args, "O!pd", &PyList_Type, &frames, &csum_ok, &now))
        return NULL;
    if (!ready(g))
        return NULL;
    Py_ssize_t n = PyList_Size(frames);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_Check(PyList_GetItem(frames, i))) {
            PyErr_SetString(PyExc_TypeError, "input_batch: frames must be a list of bytes");
            return NULL;
        }
    PyObject *out = PyList_New(n);
    if (!out)
        return NULL;
    /* the list holds the frames (no Python code runs until the flush): kept, as the TAP reader's buffer */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GetItem(frames, i);
        int took = tcpnat_tap_frame_kept(g, (const uint8_t *)PyBytes_AsString(b), (size_t)PyBytes_Size(b),
                                         csum_ok, now);
        PyList_SetItem(out, i, PyBool_FromLong(took));
    }
    tn_flush(g->e, now);
    sink_flush(g);
    arm_timer(g, now, 0);
    return out;
}

static PyObject *engine_close_flow(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    unsigned int slot, gen;
    double now;
    if (!PyArg_ParseTuple(args, "IId", &slot, &gen, &now))
        return NULL;
    if (!ready(g))
        return NULL;
    int r = tn_close_flow(g->e, slot, gen, now);
    sink_flush(g);
    return PyBool_FromLong(r == 0);
}

static PyObject *engine_info(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    unsigned int slot, gen;
    if (!PyArg_ParseTuple(args, "II", &slot, &gen))
        return NULL;
    if (!ready(g))
        return NULL;
    struct tn_info in;
    if (tn_flow_info(g->e, slot, gen, &in) < 0)
        Py_RETURN_NONE;
    return Py_BuildValue("(sdKKII)", tn_state_name(in.state), in.last_active, (unsigned long long)in.bytes_up,
                         (unsigned long long)in.bytes_down, in.snd_wnd, in.rcv_wnd);
}

static PyObject *engine_counters(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    if (!ready(g))
        return NULL;
    const struct tn_counters *c = tn_counters(g->e);
    return Py_BuildValue(
        "{sKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsKsIsi}", "frames", (unsigned long long)c->frames, "frames_out",
        (unsigned long long)c->frames_out, "tap_write_errors", (unsigned long long)c->tap_write_errors,
        "bad_checksum", (unsigned long long)c->bad_checksum, "out_of_window", (unsigned long long)c->out_of_window,
        "bad_ack", (unsigned long long)c->bad_ack, "syn_on_open", (unsigned long long)c->syn_on_open, "rst_bad_seq",
        (unsigned long long)c->rst_bad_seq, "dup_acks", (unsigned long long)c->dup_acks, "fast_retransmits",
        (unsigned long long)c->fast_retransmits, "rto", (unsigned long long)c->rto, "zero_window_probes",
        (unsigned long long)c->zero_window_probes, "host_write_paused", (unsigned long long)c->host_write_paused,
        "gathered", (unsigned long long)c->gathered, "window_updates", (unsigned long long)c->window_updates,
        "acks_carried", (unsigned long long)c->acks_carried, "acks_delayed", (unsigned long long)c->acks_delayed,
        "rate_held_up",
        (unsigned long long)c->rate_held_up, "rate_paused_down", (unsigned long long)c->rate_paused_down,
        "adopted", (unsigned long long)c->adopted, "ended", (unsigned long long)c->ended, "trace_overflow",
        (unsigned long long)tn_trace_overflow(g->e), "held_up", (unsigned long long)c->held_up, "held_down",
        (unsigned long long)c->held_down, "bytes_up", (unsigned long long)c->bytes_up, "charged_up",
        (unsigned long long)c->charged_up, "bytes_down",
        (unsigned long long)c->bytes_down, "live", tn_live_flows(g->e), "peek_off", g->peek_off);
}

static PyObject *engine_live(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    return PyLong_FromUnsignedLong(g->e ? tn_live_flows(g->e) : 0);
}

static PyObject *engine_fileno(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    return PyLong_FromLong(g->epfd);
}

static int moved_since(const Engine *g)
{
    const struct tn_counters *c = tn_counters(g->e);
    uint64_t moved = (c->charged_up - g->seen_up) + (c->bytes_down - g->seen_down);
    return moved > 0 && moved >= g->meter_min;
}

int tcpnat_pending(PyObject *obj)
{
    Engine *g = tcpnat_engine_of(obj);
    return g && g->e && (tn_records_pending(g->e) || (g->metered && moved_since(g)));
}

int tcpnat_records_pending(void *engine)
{
    Engine *g = engine;
    return g && g->e && tn_records_pending(g->e);
}

static PyObject *engine_pending(PyObject *op, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(tcpnat_pending(op));
}

/* moved() -> (charged_up, bytes_down): the engine's totals of bytes charged each way (guest ->
 * host: taken, or while an up allowance is set the window given; host -> guest: sent, not
 * counting retransmissions); pending() forgets them. */
static PyObject *engine_moved(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    if (!ready(g))
        return NULL;
    const struct tn_counters *c = tn_counters(g->e);
    g->seen_up = c->charged_up;
    g->seen_down = c->bytes_down;
    return Py_BuildValue("(KK)", (unsigned long long)c->charged_up, (unsigned long long)c->bytes_down);
}

/* meter(on, min_bytes=0): pending() also says True once bytes moved since moved(), at least
 * min_bytes of them both ways together (0: any); min_bytes spares the upcalls of a guest's small
 * exchanges while no allowance bounds it. */
static PyObject *engine_meter(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int on;
    unsigned long long min_bytes = 0;
    if (!PyArg_ParseTuple(args, "p|K", &on, &min_bytes))
        return NULL;
    g->metered = on;
    g->meter_min = min_bytes;
    Py_RETURN_NONE;
}

/* One allowance argument: absent (TN_ALLOW_KEEP), None (TN_ALLOW_ALL) or bytes >= 0. */
static int allowance(PyObject *o, const char *name, int64_t *out)
{
    if (!o) {
        *out = TN_ALLOW_KEEP;
        return 0;
    }
    if (o == Py_None) {
        *out = TN_ALLOW_ALL;
        return 0;
    }
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "allow: %s must be None or bytes >= 0", name);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* allow(up=..., down=...) -> 1 when held flows are due to resume (the next poll()), else 0. */
static PyObject *engine_allow(PyObject *op, PyObject *args, PyObject *kwargs)
{
    Engine *g = (Engine *)op;
    static char *kwlist[] = {"up", "down", NULL};
    PyObject *upo = NULL, *downo = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|$OO", kwlist, &upo, &downo))
        return NULL;
    int64_t up, down;
    if (allowance(upo, "up", &up) < 0 || allowance(downo, "down", &down) < 0)
        return NULL;
    if (!ready(g))
        return NULL;
    return PyLong_FromLong(tn_allow(g->e, up, down)); /* (the caller polls: the timer is not armed) */
}

static PyObject *engine_records(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    if (g->e && dp_yield_blocks(NULL, g->e))
        Py_RETURN_NONE;
    if (!ready(g))
        return NULL;
    return take_records(g);
}

static PyObject *engine_hook_records(PyObject *op, PyObject *arg)
{
    Engine *g = (Engine *)op;
    int on = PyObject_IsTrue(arg);
    if (on < 0)
        return NULL;
    g->hooked = on;
    Py_RETURN_NONE;
}

/* trace(capacity): the trace points on with a ring of capacity records, or off (0). */
static PyObject *engine_trace(PyObject *op, PyObject *arg)
{
    Engine *g = (Engine *)op;
    unsigned long cap = PyLong_AsUnsignedLong(arg);
    if (cap == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (!ready(g))
        return NULL;
    if (cap > TN_TRACE_MAX) {
        PyErr_Format(PyExc_ValueError, "trace capacity must be 0..%u records", TN_TRACE_MAX);
        return NULL;
    }
    if (tn_trace_enable(g->e, (uint32_t)cap) < 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* trace_take() -> ([(type, slot, gen, t_ns, dur_ns, a, b, c, tcp_flags), ...], overflow) */
static PyObject *engine_trace_take(PyObject *op, PyObject *unused)
{
    (void)unused;
    Engine *g = (Engine *)op;
    if (!ready(g))
        return NULL;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    struct tn_trace_rec recs[64];
    size_t n;
    while ((n = tn_trace_take(g->e, recs, 64)) > 0) {
        for (size_t i = 0; i < n; i++) {
            const struct tn_trace_rec *r = &recs[i];
            PyObject *t = Py_BuildValue("(ilIKIIIIi)", (int)r->type,
                                        r->slot == TN_TRACE_NO_FLOW ? -1L : (long)r->slot, r->gen,
                                        (unsigned long long)r->t_ns, r->dur_ns, r->a, r->b, r->c,
                                        (int)r->tcp_flags);
            if (!t || PyList_Append(list, t) < 0) {
                Py_XDECREF(t);
                Py_DECREF(list);
                return NULL;
            }
            Py_DECREF(t);
        }
    }
    return Py_BuildValue("(NK)", list, (unsigned long long)tn_trace_overflow(g->e));
}

/* trace_json(spans, frames, off_ns, seed, guest, resource) -> (text, lines): the trace records,
 * oldest first, as the trace file's JSON lines (text: bytes, ASCII; lines: how many) and, appended to the events
 * lists of the flows in spans, their flow-span events (_tracejson.h). spans: dict (slot, gen) ->
 * (trace_id, span_id, events, ports, v6); frames: trace level "frames"; off_ns: CLOCK_MONOTONIC ->
 * time.time_ns(); seed: of the ids; guest: ',"key":value...' of the guest identity or "";
 * resource: the resource's JSON object. */
static PyObject *engine_trace_json(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    struct tj_ctx c;
    memset(&c, 0, sizeof c);
    long long off;
    unsigned long long seed;
    if (!PyArg_ParseTuple(args, "O!pLKs#s#", &PyDict_Type, &c.spans, &c.frames, &off, &seed, &c.guest,
                          &c.guest_len, &c.resource, &c.resource_len))
        return NULL;
    if (!ready(g))
        return NULL;
    c.off_ns = (int64_t)off;
    c.rng = (uint64_t)seed;
    struct tn_trace_rec recs[64];
    size_t n;
    while ((n = tn_trace_take(g->e, recs, 64)) > 0) {
        if (tj_format(&c, recs, n) < 0) {
            free(c.buf);
            return NULL;
        }
    }
    PyObject *text = PyBytes_FromStringAndSize(c.buf ? c.buf : "", (Py_ssize_t)c.len);
    free(c.buf);
    if (!text)
        return NULL;
    return Py_BuildValue("(Nn)", text, (Py_ssize_t)c.lines);
}

/* trace_pending() -> int: how many trace records wait to be taken. */
static PyObject *engine_trace_pending(PyObject *op, PyObject *unused)
{
    (void)unused;
    Engine *g = (Engine *)op;
    if (!ready(g))
        return NULL;
    return PyLong_FromUnsignedLong(tn_trace_pending(g->e));
}

static PyObject *engine_forget_tap(PyObject *op, PyObject *unused)
{
    (void)unused;
    ((Engine *)op)->tap_fd = -1;
    Py_RETURN_NONE;
}

static PyObject *engine_close(PyObject *op, PyObject *unused)
{
    (void)unused;
    Engine *g = (Engine *)op;
    if (g->e && dp_yield_blocks(NULL, g->e)) {
        PyErr_SetString(PyExc_RuntimeError, "TcpEngine closed while its turn yields");
        return NULL;
    }
    engine_release(g);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ fake controls */

static struct fake_sock *fake_arg(Engine *g, int fd)
{
    if (!g->fake || !g->e) {
        PyErr_SetString(PyExc_ValueError, "not a fake TcpEngine");
        return NULL;
    }
    struct fake_sock *s = fake_get(g, fd);
    if (!s)
        PyErr_Format(PyExc_ValueError, "no fake socket %d", fd);
    return s;
}

static PyObject *fake_connect_mode(PyObject *op, PyObject *arg)
{
    Engine *g = (Engine *)op;
    long err = PyLong_AsLong(arg);
    if (err == -1 && PyErr_Occurred())
        return NULL;
    g->fake_connect = (int)err;
    Py_RETURN_NONE;
}

static PyObject *fake_frames(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    if (!g->frames)
        return PyList_New(0);
    PyObject *out = g->frames;
    g->frames = PyList_New(0);
    if (!g->frames) {
        g->frames = out;
        return NULL;
    }
    return out;
}

static void fake_event(Engine *g, struct fake_sock *s, uint32_t ev, double now)
{
    if (!s->watch_out) /* as epoll: writability only when watched */
        ev &= ~TN_EV_OUT;
    if (!ev)
        return;
    uint64_t t0 = tn_tracing(g->e) ? tn_clock_ns() : 0;
    tn_sock_event(g->e, s->tag, ev, now);
    if (t0) /* one socket event: the wake-up of a real poll() that saw it */
        tn_trace_wake(g->e, 1, 0, t0);
    tn_flush(g->e, now);
}

static PyObject *fake_connect_done(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int fd, err;
    double now;
    if (!PyArg_ParseTuple(args, "iid", &fd, &err, &now))
        return NULL;
    struct fake_sock *s = fake_arg(g, fd);
    if (!s)
        return NULL;
    s->pending_err = err;
    fake_event(g, s, TN_EV_OUT | (err ? TN_EV_ERR : 0), now);
    Py_RETURN_NONE;
}

static PyObject *fake_host_send(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int fd;
    Py_buffer b;
    double now;
    if (!PyArg_ParseTuple(args, "iy*d", &fd, &b, &now))
        return NULL;
    struct fake_sock *s = fake_arg(g, fd);
    if (!s || grow(&s->rx, &s->rx_cap, s->rx_len + (size_t)b.len) < 0) {
        PyBuffer_Release(&b);
        if (s)
            PyErr_NoMemory();
        return NULL;
    }
    memcpy(s->rx + s->rx_len, b.buf, (size_t)b.len);
    s->rx_len += (size_t)b.len;
    PyBuffer_Release(&b);
    fake_event(g, s, TN_EV_IN, now);
    Py_RETURN_NONE;
}

static PyObject *fake_host_eof(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int fd;
    double now;
    if (!PyArg_ParseTuple(args, "id", &fd, &now))
        return NULL;
    struct fake_sock *s = fake_arg(g, fd);
    if (!s)
        return NULL;
    s->eof = 1;
    fake_event(g, s, TN_EV_IN | TN_EV_RDHUP, now);
    Py_RETURN_NONE;
}

static PyObject *fake_host_reset(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int fd, event = 1;
    double now;
    if (!PyArg_ParseTuple(args, "id|p", &fd, &now, &event))
        return NULL;
    struct fake_sock *s = fake_arg(g, fd);
    if (!s)
        return NULL;
    s->reset = 1;
    s->pending_err = ECONNRESET;
    if (event) /* (event=False: the socket's calls fail before the engine polls, as a real RST's may) */
        fake_event(g, s, TN_EV_IN | TN_EV_ERR | TN_EV_HUP, now);
    Py_RETURN_NONE;
}

static PyObject *fake_send_space(PyObject *op, PyObject *args)
{
    Engine *g = (Engine *)op;
    int fd;
    long n;
    double now;
    if (!PyArg_ParseTuple(args, "ild", &fd, &n, &now))
        return NULL;
    struct fake_sock *s = fake_arg(g, fd);
    if (!s)
        return NULL;
    s->space = n;
    if (n != 0)
        fake_event(g, s, TN_EV_OUT, now);
    Py_RETURN_NONE;
}

static PyObject *fake_received(PyObject *op, PyObject *arg)
{
    Engine *g = (Engine *)op;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    struct fake_sock *s = fake_arg(g, (int)fd);
    if (!s)
        return NULL;
    PyObject *b = PyBytes_FromStringAndSize((const char *)s->tx, (Py_ssize_t)s->tx_len);
    s->tx_len = 0;
    return b;
}

static PyObject *fake_socket(PyObject *op, PyObject *arg)
{
    Engine *g = (Engine *)op;
    long fd = PyLong_AsLong(arg);
    if (fd == -1 && PyErr_Occurred())
        return NULL;
    struct fake_sock *s = fake_arg(g, (int)fd);
    if (!s)
        return NULL;
    return Py_BuildValue("{sisisisnsisl}", "closed", s->closed, "aborted", s->aborted, "shut_wr", s->shut_wr,
                         "unread", (Py_ssize_t)s->rx_len, "watch_out", s->watch_out, "sends", s->sends);
}

static PyObject *fake_fds(PyObject *op, PyObject *unused)
{
    Engine *g = (Engine *)op;
    (void)unused;
    PyObject *l = PyList_New(0);
    if (!l || !g->fs)
        return l;
    for (int i = 0; i < FAKE_FDS; i++) {
        if (g->fs[i].used) {
            PyObject *v = PyLong_FromLong(FAKE_FD0 + i);
            if (!v || PyList_Append(l, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(l);
                return NULL;
            }
            Py_DECREF(v);
        }
    }
    return l;
}

static PyMethodDef engine_methods[] = {
    {"adopt", engine_adopt, METH_VARARGS,
     "adopt(v6, guest_mac, guest_ip, guest_port, dst_ip, dst_port, host_ip, host_port, irs, iss, mss, wscale, wnd, "
     "now) -> (status, slot, gen)"},
    {"poll", engine_poll, METH_VARARGS,
     "poll(now=None) -> records: socket events and timers, then what ended (None: inside its own turn's yield)"},
    {"input", engine_input, METH_VARARGS, "input(frame, csum_ok, now) -> bool: a guest frame a native flow took"},
    {"input_pieces", engine_input_pieces, METH_VARARGS,
     "input_pieces(frame, piece, now) -> 1, 0 or -1: the frame in place, in pieces of piece bytes (as frame_zc)"},
    {"input_batch", engine_input_batch, METH_VARARGS,
     "input_batch(frames, csum_ok, now) -> list[bool]: input() for each frame of a list of bytes, one flow's "
     "consecutive in-order payloads sent to its socket in one sendmsg, the ACKs after the last"},
    {"close_flow", engine_close_flow, METH_VARARGS, "close_flow(slot, gen, now) -> bool"},
    {"info", engine_info, METH_VARARGS, "info(slot, gen) -> (state, last_active, bytes_up, bytes_down, snd_wnd, rcv_wnd)"},
    {"counters", engine_counters, METH_NOARGS, "counters() -> dict"},
    {"live", engine_live, METH_NOARGS, "live() -> flows alive"},
    {"fileno", engine_fileno, METH_NOARGS, "fileno() -> the epoll fd"},
    {"close", engine_close, METH_NOARGS, "close(): every socket aborted, the epoll closed"},
    {"trace", engine_trace, METH_O, "trace(capacity): trace points on with a ring of capacity records (0: off)"},
    {"trace_pending", engine_trace_pending, METH_NOARGS, "trace_pending() -> int: trace records waiting to be taken"},
    {"trace_json", engine_trace_json, METH_VARARGS,
     "trace_json(spans, frames, off_ns, seed, guest, resource) -> (text, lines): the trace records as JSON lines"},
    {"trace_take", engine_trace_take, METH_NOARGS,
     "trace_take() -> ([(type, slot, gen, t_ns, dur_ns, a, b, c, tcp_flags)], overflow): the trace records, oldest first"},
    {"forget_tap", engine_forget_tap, METH_NOARGS, "forget_tap(): the TAP fd is closing: write no frame to it"},
    {"pending", engine_pending, METH_NOARGS,
     "pending() -> bool: records wait to be taken (poll()), or bytes moved since moved() once metered (meter())"},
    {"moved", engine_moved, METH_NOARGS,
     "moved() -> (charged_up, bytes_down): the engine's totals of bytes charged each way (tcpnat.h, allowances)"},
    {"meter", engine_meter, METH_VARARGS,
     "meter(on, min_bytes=0): pending() also says True when bytes moved since moved() (at least min_bytes)"},
    {"allow", (PyCFunction)(void (*)(void))engine_allow, METH_VARARGS | METH_KEYWORDS,
     "allow(*, up=..., down=...) -> int: bytes each way before the engine holds itself (None: no bound, 0: hold "
     "now, absent: unchanged); 1 when held flows resume at the next poll() (the caller's to call)"},
    {"records", engine_records, METH_NOARGS,
     "records() -> the records waiting (poll() without its events and timers; None as poll())"},
    {"hook_records", engine_hook_records, METH_O,
     "hook_records(on): the TAP reader's caller asks pending() after each batch and polls: no timer wake-up for them"},
    {"fake_connect_mode", fake_connect_mode, METH_O, "fake: connects of new sockets give this errno (0: at once)"},
    {"fake_frames", fake_frames, METH_NOARGS, "fake: the frames written to the guest since the last call"},
    {"fake_connect_done", fake_connect_done, METH_VARARGS, "fake_connect_done(fd, err, now)"},
    {"fake_host_send", fake_host_send, METH_VARARGS, "fake_host_send(fd, data, now): the host peer sends"},
    {"fake_host_eof", fake_host_eof, METH_VARARGS, "fake_host_eof(fd, now): the host peer shuts down writing"},
    {"fake_host_reset", fake_host_reset, METH_VARARGS, "fake_host_reset(fd, now, event=True)"},
    {"fake_send_space", fake_send_space, METH_VARARGS, "fake_send_space(fd, n, now): send() takes n bytes (-1 all)"},
    {"fake_received", fake_received, METH_O, "fake_received(fd) -> bytes the host peer got since the last call"},
    {"fake_socket", fake_socket, METH_O, "fake_socket(fd) -> dict"},
    {"fake_fds", fake_fds, METH_NOARGS, "fake_fds() -> the fake sockets made"},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot engine_slots[] = {
    {Py_tp_doc, "TcpEngine(...): the native TCP NAT engine of one stack (see aioslirp.nat.native_tcp)"},
    {Py_tp_new, engine_new},
    {Py_tp_init, engine_init},
    {Py_tp_dealloc, engine_dealloc},
    {Py_tp_methods, engine_methods},
    {0, NULL},
};

static PyType_Spec engine_spec = {
    "aioslirp.native._dataplane.TcpEngine", sizeof(Engine), 0, Py_TPFLAGS_DEFAULT, engine_slots,
};

static PyTypeObject *engine_type;

static int add_api(PyObject *module);

int tcpnat_add_type(PyObject *module)
{
    PyObject *t = PyType_FromSpec(&engine_spec);
    if (!t)
        return -1;
    engine_type = (PyTypeObject *)t;
    if (PyModule_AddObjectRef(module, "TcpEngine", t) < 0)
        return -1;
    return add_api(module);
}

void *tcpnat_engine_of(PyObject *obj)
{
    if (!engine_type || !PyObject_TypeCheck(obj, engine_type))
        return NULL;
    Engine *g = (Engine *)obj;
    return g->e ? g : NULL;
}

static int tap_frame(void *engine, const uint8_t *frame, size_t len, int csum_ok, double now, int kept)
{
    Engine *g = engine;
    if (!g->e || tn_live_flows(g->e) == 0)
        return 0;
    struct dp_frame rec;
    if (dp_classify(frame, len, 0, &rec, NULL) != DP_KIND_TCP)
        return 0;
    if (kept)
        return tn_frame_kept(g->e, frame, len, &rec, csum_ok, now);
    return tn_frame(g->e, frame, len, &rec, csum_ok, now);
}

int tcpnat_tap_frame(void *engine, const uint8_t *frame, size_t len, int csum_ok, double now)
{
    return tap_frame(engine, frame, len, csum_ok, now, 0);
}

int tcpnat_tap_frame_kept(void *engine, const uint8_t *frame, size_t len, int csum_ok, double now)
{
    return tap_frame(engine, frame, len, csum_ok, now, 1);
}

_Static_assert(TCPSINK_ZC_HEAD == TN_ZC_HEAD, "one head size for both sides of frame_zc");

int tcpnat_frame_zc(void *engine, const uint8_t *head, size_t head_len, const struct iovec *iov, int n, size_t len,
                    int csum_ok, double now)
{
    Engine *g = engine;
    if (!g->e || tn_live_flows(g->e) == 0)
        return 0;
    if (head_len < len && head_len < TN_ZC_HEAD) /* dp_classify() would read past head */
        return -1;
    struct dp_frame rec;
    if (dp_classify(head, len, 0, &rec, NULL) != DP_KIND_TCP)
        return 0;
    return tn_frame_zc(g->e, head, head_len, iov, n, len, &rec, csum_ok, now);
}

void tcpnat_gather_flush(void *engine)
{
    Engine *g = engine;
    if (g->e)
        tn_gather_flush(g->e);
}

void tcpnat_gather_max(void *engine, size_t n)
{
    Engine *g = engine;
    if (g->e)
        tn_gather_max(g->e, n);
}

void tcpnat_batch_end(void *engine)
{
    Engine *g = engine;
    if (!g->e)
        return;
    double now = mono_now();
    tn_flush(g->e, now);
    sink_flush(g);
    arm_timer(g, now, 1);
}

double tcpnat_now(void)
{
    return mono_now();
}

/* The engine's input for the vhost-user device (tcpsink.h): the module attribute tcp_api. */
static const struct tcpnat_api api = {tcpnat_engine_of, tcpnat_tap_frame, tcpnat_batch_end, tcpnat_now, tcpnat_frame_zc};

static int add_api(PyObject *module)
{
    PyObject *cap = PyCapsule_New((void *)&api, TCPNAT_API_CAPSULE, NULL);
    if (!cap)
        return -1;
    int r = PyModule_AddObjectRef(module, "tcp_api", cap);
    Py_DECREF(cap);
    return r;
}
