/* aioslirp's native TCP NAT engine (issue 26): guest-initiated TCP flows to host sockets, the
 * whole lifecycle in C after Python admitted the flow.
 *
 * Theory of operation
 * -------------------
 * Python (aioslirp.dispatch.l4 / aioslirp.nat.native_tcp) admits a guest SYN and calls
 * tn_adopt() with the SYN's parameters and the NAT'd host address. From then on every guest
 * frame of that 5-tuple is handed to tn_frame() by the TAP reader (before Python sees it), and
 * every readiness of the flow's host socket to tn_sock_event(). Nothing is buffered in user
 * space beyond one frame:
 *
 * - guest -> host: an in-order payload is send()-ed at once; only what the socket took is
 *   acknowledged. Out-of-order segments and those beyond the window are dropped with a
 *   duplicate ACK (no reassembly queue). A partial send closes our window until EPOLLOUT.
 * - host -> guest: bytes the guest has not acknowledged stay in the kernel's receive queue;
 *   they are read with MSG_PEEK at the offset snd_nxt - snd_una (SO_PEEK_OFF when the kernel
 *   has it, else into a discard buffer first) and consumed with recv(MSG_TRUNC) when the guest
 *   ACKs. Retransmission rewinds snd_nxt to snd_una (RTO with backoff, or 3 duplicate ACKs).
 * - FIN/RST/half-close both ways; a zero window is probed; idle, connect, linger and TIME-WAIT
 *   timers (the Python path's: tcp_idle_timeout, tcp_connect_timeout, tcp_linger, time_wait).
 *
 * The core does no syscall itself: sockets, the TAP write and the epoll registration go
 * through struct tn_io (function pointers), the clock comes in as `now` (seconds, the
 * CLOCK_MONOTONIC of loop.time()). The binding (_tcpnat.c) gives the real seam (syscalls) or a
 * fake one (tests drive the engine with fake sockets and a fake clock).
 *
 * Bounds: the flow table is a fixed array of max_flows flows and an open-addressing hash of
 * at least twice that many slots (a keyed hash), allocated once; one 64 KiB peek buffer and,
 * without SO_PEEK_OFF, one discard buffer of TN_DISCARD bytes per engine; the record ring
 * holds 2 records per flow slot. A hostile guest cannot grow any of these: every length comes
 * from dp_classify()'s checked record (struct dp_frame), and a frame is read only inside it.
 *
 * MIT licensed, written for aioslirp. Ideas from passt's design notes (peek and consume,
 * rewind on retransmit); no passt code is used.
 */
#ifndef AIOSLIRP_TCPNAT_H
#define AIOSLIRP_TCPNAT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "dataplane.h"

/* The guest's largest possible window with the in-flight bytes of the discard fallback. */
#define TN_DISCARD (1u << 20)
/* Largest payload peeked (and put in one frame with offload) at once. */
#define TN_PEEK_MAX 65495u
/* Frames (of up to TN_PEEK_MAX payload bytes) peeked into at once when written in place, and
 * their pieces of guest memory at most (tn_io.rx_reserve). */
#define TN_DIRECT_FRAMES 4u
#define TN_DIRECT_IOV 256u
/* Payloads of one flow's consecutive guest frames sent to its socket in one sendmsg, at most. */
#define TN_GATHER_MAX 64u

/* Largest byte-rate cap (bytes/s) of the engine, about 550 Gbit/s: the byte buckets count in
 * nanobytes (bytes x 1e9) and stay within 64 bits below it. */
#define TN_RATE_MAX (1ull << 36)
/* A flow held by a rate cap resumes once the bucket holds this many bytes (or the window's worth). */
#define TN_RATE_BATCH (16u * 1024u)

/* An allowance (tn_allow) without a bound, and "leave it as it is". */
#define TN_ALLOW_ALL INT64_MAX
#define TN_ALLOW_KEEP (-1)

/* Socket events given to tn_sock_event() (the epoll bits). */
#define TN_EV_IN 0x001u
#define TN_EV_OUT 0x004u
#define TN_EV_ERR 0x008u
#define TN_EV_HUP 0x010u
#define TN_EV_RDHUP 0x2000u

/* The syscalls of the engine, behind function pointers. Every call returns >= 0 or -errno. */
struct tn_io {
    void *ctx;
    /* A non-blocking TCP socket of family AF_INET (v6 0) or AF_INET6, TCP_NODELAY set. */
    int (*sock_open)(void *ctx, int v6);
    /* Start connecting fd to addr:port (addr 4 or 16 bytes): 0 connected, -EINPROGRESS, -errno. */
    int (*sock_connect)(void *ctx, int fd, int v6, const uint8_t *addr, uint16_t port);
    /* The outcome of a connect in progress once the socket is writable: 0 or -errno. */
    int (*sock_error)(void *ctx, int fd);
    /* Watch fd for TN_EV_* (edge-triggered), the event tagged with tag; writability only with out
     * (a connect in progress). want_out: from now on writability too (a send took part). */
    int (*sock_watch)(void *ctx, int fd, uint64_t tag, int out);
    int (*sock_want_out)(void *ctx, int fd, uint64_t tag);
    ssize_t (*sock_send)(void *ctx, int fd, const uint8_t *buf, size_t len);
    /* The same for iovcnt (2..TN_GATHER_MAX) buffers in order, as one sendmsg: bytes taken (a
     * prefix), -errno. NULL: the engine sends each guest frame's payload on its own. */
    ssize_t (*sock_sendv)(void *ctx, int fd, const struct iovec *iov, int iovcnt);
    /* Copy up to len bytes of the receive queue from offset skip without consuming them:
     * bytes copied, 0 at end of stream (past skip), -EAGAIN none now, -errno. */
    ssize_t (*sock_peek)(void *ctx, int fd, uint8_t *buf, size_t len, size_t skip);
    /* Drop n bytes from the head of the receive queue. */
    ssize_t (*sock_consume)(void *ctx, int fd, size_t n);
    /* The peek offset was rewound to off (SO_PEEK_OFF; the fake ignores it). */
    int (*sock_rewind)(void *ctx, int fd, size_t off);
    int (*sock_shutdown_wr)(void *ctx, int fd);
    /* Payload bytes the socket's send buffer takes now (about: SO_SNDBUF / 2 - SIOCOUTQ); *queued:
     * the bytes in it the host peer has not acknowledged yet (SIOCOUTQ). */
    ssize_t (*sock_space)(void *ctx, int fd, uint32_t *queued);
    /* Close fd; abort: with SO_LINGER 0 (the host peer sees a RST). */
    void (*sock_close)(void *ctx, int fd, int abort);
    /* One frame to the guest (the iovec starts with the vnet header when the TAP has one). */
    int (*tap_write)(void *ctx, const struct iovec *iov, int iovcnt);
    /* Frames to the guest written in place (a vhost-user device's RX buffers, tcpsink.h): NULL
     * (a TAP) or all four. With offload, host bytes are peeked into buffers the sink reserves
     * (rx_reserve: one frame's payload pieces, 0 when not now), the headers then committed
     * (rx_commit, one frame at a time, in order) and the rest given back (rx_release, after every
     * peek into a reservation); what cannot be reserved goes through sock_peek and tap_write.
     * sock_peekv: sock_peek into iov[0..iovcnt) (at most TN_DIRECT_IOV). */
    ssize_t (*sock_peekv)(void *ctx, int fd, const struct iovec *iov, int iovcnt, size_t skip);
    int (*rx_reserve)(void *ctx, size_t head, size_t payload, struct iovec *iov, int max_iov);
    int (*rx_commit)(void *ctx, const uint8_t *hdr, size_t hdr_len, size_t payload);
    void (*rx_release)(void *ctx);
};

struct tn_config {
    uint32_t max_flows;      /* flows at most (the stack's max_flows) */
    uint32_t mtu;            /* the guest link's MTU: our MSS is mtu - 40 (IPv4) / - 60 (IPv6) */
    uint32_t rcv_buf;        /* the largest window advertised to the guest, bytes (tcp_buffer) */
    int vnet;                /* frames to the TAP start with a 12-byte virtio-net header */
    int offload;             /* ... flagged NEEDS_CSUM, GSO for payloads above the MSS */
    double idle_timeout;     /* s without a guest segment before RST both ways; 0: never */
    double connect_timeout;  /* s for the host connect */
    double linger;           /* s of guest silence in FIN-WAIT-2, of no progress in LAST-ACK/CLOSING: then RST */
    double time_wait;        /* s in TIME-WAIT after the guest's last segment (we closed first) */
    double ack_delay;        /* s an ACK of the guest's data may wait for our data or FIN to carry it
                              * (tcp_ack_delay, 0..0.5; 0: at the end of the call; tcpnat.c ack_data) */
    uint8_t gw_mac[6];       /* the source MAC of frames to the guest */
    uint64_t hash_key[2];    /* the flow hash's key (random per engine) */
    /* The guest's byte-rate caps (--rate-limit), bytes/s each way, 1..TN_RATE_MAX; 0: none. One
     * bucket per direction per engine, shared by its flows, as aioslirp.ratelimit.ByteBucket:
     * burst max(64 KiB, 10 ms of the rate), full at the start. Paced without loss: host -> guest,
     * the host socket is read (and frames sent) only while the bucket is above zero; guest ->
     * host, our window is at most what the bucket holds (the guest's sends wait in the guest).
     * A held flow is woken by its timer (TN_RATE_BATCH bytes refilled). */
    uint64_t rate_up, rate_down;
};

/* What Python hands over for a new flow (the guest's SYN, its addresses, the host). */
struct tn_adopt {
    int v6;
    uint8_t guest_mac[6];
    uint8_t guest_ip[16], dst_ip[16]; /* 4 bytes used for IPv4 */
    uint16_t guest_port, dst_port;
    uint8_t host_ip[16];              /* the NAT'd address connected to */
    uint16_t host_port;
    uint32_t irs;                     /* the guest's ISN */
    uint32_t iss;                     /* ours */
    int mss;                          /* the guest's MSS option, -1 none */
    int wscale;                       /* its window scale option, -1 none */
    uint32_t wnd;                     /* its SYN's window field */
};

/* Records for Python (tn_take_records). */
enum tn_rec_kind {
    TN_REC_CONNECTED = 1, /* the host connect completed (after tn_adopt said in progress) */
    TN_REC_ENDED = 2,     /* the flow is over: outcome, errno, byte counts */
};

enum tn_outcome {
    TN_OUT_NONE = 0,
    TN_OUT_CLOSED,       /* FIN both ways */
    TN_OUT_RESET,        /* a RST from the guest, or the host peer's */
    TN_OUT_REFUSED,      /* the host refused the connect: RST|ACK to the guest */
    TN_OUT_UNREACHABLE,  /* the connect failed otherwise: Python sends ICMP (err says which) */
    TN_OUT_TIMEOUT,      /* connect, idle or retransmission timeout */
    TN_OUT_SHUTDOWN,     /* tn_close_flow() (Python's shutdown) */
    TN_OUT_COUNT
};

/* Why an ended flow ended, in more detail than the outcome: Python's counters. */
enum tn_why {
    TN_WHY_NONE = 0,
    TN_WHY_GUEST_RST,     /* tcp_resets */
    TN_WHY_HOST_LOST,     /* tcp_host_lost: the host peer reset, an error */
    TN_WHY_IDLE,          /* tcp_idle_closed */
    TN_WHY_RETRIES,       /* retransmissions to the guest gave up */
    TN_WHY_CONNECT,       /* the connect failed or timed out */
    TN_WHY_LINGER,        /* tcp_linger ran out in FIN-WAIT-2, LAST-ACK or CLOSING */
};

struct tn_record {
    uint32_t slot, gen;
    uint8_t kind, outcome, why, pad;
    int32_t err;
    uint64_t bytes_up, bytes_down;
};

/* Counters of the engine (guest frames it took, drops by reason, socket events). */
struct tn_counters {
    uint64_t frames;            /* guest frames of native flows */
    uint64_t frames_out;        /* frames written to the guest */
    uint64_t tap_write_errors;
    uint64_t bad_checksum;
    uint64_t out_of_window;     /* data out of order, beyond the window, or old: dup ACK */
    uint64_t bad_ack;           /* an ACK of unsent data, or no ACK flag */
    uint64_t syn_on_open;       /* a SYN on an open flow: challenge ACK */
    uint64_t rst_bad_seq;       /* a RST not at rcv_nxt: dropped (challenge ACK in window) */
    uint64_t dup_acks;
    uint64_t fast_retransmits;
    uint64_t rto;               /* retransmission timeouts */
    uint64_t zero_window_probes;
    uint64_t host_write_paused; /* a send() took part: our window closes */
    uint64_t gathered;          /* guest segments sent to their socket in a sendmsg of several */
    uint64_t window_updates;    /* ... and opens again (EPOLLOUT, or the up rate cap refilled) */
    uint64_t acks_carried;      /* a delayed ACK of the guest's data rode on our data or FIN */
    uint64_t acks_delayed;      /* ... went alone when DELACK ran out */
    uint64_t rate_held_up;      /* our window to a flow that sent data was closed by the up cap */
    uint64_t rate_paused_down;  /* a flow stopped reading its host socket for the down cap */
    uint64_t held_up;           /* our window to a flow was kept from opening: the up allowance ran out */
    uint64_t held_down;         /* a flow stopped reading its host socket: the down allowance ran out */
    uint64_t bytes_up;          /* guest -> host bytes the host sockets took, all flows */
    uint64_t charged_up;        /* ... charged to the up allowance: taken, or window given (tn_allow) */
    uint64_t bytes_down;        /* host -> guest bytes sent to the guest (not counting retransmissions) */
    uint64_t adopted;
    uint64_t ended;
};

struct tn_engine;

/* A new engine (NULL on a bad config: max_flows 1..2^22, mtu 576..65521, a rate above
 * TN_RATE_MAX; or no memory). The io is copied. */
struct tn_engine *tn_new(const struct tn_config *cfg, const struct tn_io *io);
void tn_free(struct tn_engine *e); /* closes every socket still open (abort) */

/* Adopt a flow: 0 connected at once (SYN-ACK sent), 1 connecting, -EEXIST the 5-tuple is
 * native already, -ENOSPC no slot, or -errno of a failed socket/connect (the flow is then
 * over already: its ENDED record is queued; a refusal was answered with RST|ACK). */
int tn_adopt(struct tn_engine *e, const struct tn_adopt *a, double now, uint32_t *slot, uint32_t *gen);

/* A guest frame (without the vnet header) classified as rec: 1 when a native flow took it
 * (processed or dropped and counted), 0 when Python should. csum_ok: the vnet header vouched
 * for the L4 checksum. */
int tn_frame(struct tn_engine *e, const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok, double now);

/* tn_frame for a frame whose memory the caller keeps unchanged until it calls tn_gather_flush (or
 * tn_flush): an in-order payload of the same flow as the frames before it is gathered, not sent at
 * once, so that consecutive segments of one flow reach its socket in one sendmsg (one wake-up of
 * the host peer instead of one per segment). Any other frame, socket event, timer or call sends
 * the gather first; bytes are acknowledged to the guest only once the socket took them. */
int tn_frame_kept(struct tn_engine *e, const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok,
                  double now);

/* The bytes of a frame's start that tn_frame_zc's head holds: more than the longest headers
 * dp_classify() and the engine read (Ethernet 14 + IPv4 60 + TCP 60 = 134). */
#define TN_ZC_HEAD 160u

/* tn_frame_kept for a frame in pieces, its payload never copied: head[0..head_len) is a copy of
 * the frame's first min(len, TN_ZC_HEAD) bytes or more (rec was made from it; only it is parsed,
 * so what another party writes to the pieces meanwhile changes no decision), iov[0..n) the whole
 * frame (len bytes) in memory the caller keeps mapped and unreused until tn_gather_flush (or
 * tn_flush): the payload goes from there to the host socket. 1 or 0 as tn_frame, or -1 when the
 * frame cannot be taken this way (checksum not vouched for, payload in more than TN_GATHER_MAX
 * pieces, headers past head_len, no sock_sendv): nothing was done, the caller copies the frame
 * whole and calls tn_frame. */
int tn_frame_zc(struct tn_engine *e, const uint8_t *head, size_t head_len, const struct iovec *iov, int n,
                size_t len, const struct dp_frame *rec, int csum_ok, double now);

/* Send what tn_frame_kept gathered (before the caller reuses the frames' memory). */
void tn_gather_flush(struct tn_engine *e);
/* The most payload bytes one gathered sendmsg takes from now on (0: no bound, the default): a
 * shorter system call, so that the fair scheduler's yield point comes round sooner. */
void tn_gather_max(struct tn_engine *e, size_t n);

/* Send the ACKs that guest frames made due (after a batch of guest frames). */
void tn_flush(struct tn_engine *e, double now);

/* A readiness of the socket whose tag was tag (TN_EV_* bits). */
void tn_sock_event(struct tn_engine *e, uint64_t tag, uint32_t events, double now);

/* Run the timers due at now. */
void tn_timers(struct tn_engine *e, double now);

/* The next deadline (seconds), or a negative value when there is none. Records waiting to be
 * taken count as due now unless timers_only; held flows due to resume (tn_allow) always do. */
double tn_next_deadline(const struct tn_engine *e, double now, int timers_only);

/* Records wait to be taken. */
int tn_records_pending(const struct tn_engine *e);

/* Move up to max records into out; returns how many. A flow's slot is reused only after its
 * ENDED record was taken. */
size_t tn_take_records(struct tn_engine *e, struct tn_record *out, size_t max);

/* End a flow from Python (stack exit, reset, eviction): RST to the guest, socket aborted. Its
 * ENDED record (TN_OUT_SHUTDOWN) is queued. -ENOENT when (slot, gen) is not a live flow. */
int tn_close_flow(struct tn_engine *e, uint32_t slot, uint32_t gen, double now);

/* What Python shows of a live flow. state: an index into tn_state_name(). */
struct tn_info {
    uint8_t state;
    double last_active;
    uint64_t bytes_up, bytes_down;
    uint32_t snd_wnd, rcv_wnd;
};
int tn_flow_info(const struct tn_engine *e, uint32_t slot, uint32_t gen, struct tn_info *out);
const char *tn_state_name(unsigned state);
const char *tn_outcome_name(unsigned outcome);

/* ------------------------------------------------------------------ allowances (holds)
 * The fair scheduler of the loop (aioslirp.fair, through aioslirp.nat.native_tcp) holds a guest
 * that is over its share of a direction: the engine has one allowance per direction, bytes it
 * may still move that way before it holds itself (TN_ALLOW_ALL, the default: no bound). What
 * is moved is taken from it; at or below zero the direction is held:
 * - down: each byte sent to the guest (bytes_down of tn_counters; retransmissions are free). Held,
 *   no host socket is read (a flow about to peek is held instead; its bytes stay in the kernel,
 *   as with the down rate cap), retransmissions and our FIN included.
 * - up: each byte the guest may send (charged_up): while an allowance is set, our window is
 *   charged when it opens (the whole window, once, the first time it is advertised under an
 *   allowance: what the guest may send under the edge it was given), otherwise the bytes when
 *   taken. Held, our window does not open past the edge charged already; while the allowance is
 *   positive it opens at most that far beyond. The flows of the engine together get at most the
 *   allowance (plus the windows open when it was set).
 * A held flow is listed once (a list through the flows, bounded by max_flows). Raising an
 * allowance above zero makes the held flows due (tn_next_deadline says now): the next
 * tn_timers() resumes them all, in the order they were held (a window update where the window
 * grew, the host socket read again), without waiting for another event. */

/* Set the allowances (bytes; TN_ALLOW_ALL no bound, TN_ALLOW_KEEP unchanged, 0 hold now).
 * Returns 1 when held flows are now due to resume (at the next tn_timers), else 0. */
int tn_allow(struct tn_engine *e, int64_t up, int64_t down);
/* Flows held now (by either allowance). */
uint32_t tn_held_flows(const struct tn_engine *e);

const struct tn_counters *tn_counters(const struct tn_engine *e);
uint32_t tn_live_flows(const struct tn_engine *e);
uint32_t tn_capacity(const struct tn_engine *e);

/* ------------------------------------------------------------------ trace points
 * The native plane's own trace points (docs/observability.md, trace level "frames"; the
 * SYN-ACK and the flow events from "timeline"): off (the
 * default) each costs one predictable branch on a NULL ring; on (tn_trace_enable), each writes
 * one fixed-size record into a bounded ring that Python drains (tn_trace_take) into the same
 * OpenTelemetry spans as the Python path's. A full ring drops the new record and counts it
 * (tn_trace_overflow); it never grows. Built with -DTN_NO_TRACE the points are compiled out
 * (the A/B of their cost when off). Timestamps are CLOCK_MONOTONIC nanoseconds. */
enum tn_trace_type {
    TN_TR_FRAME = 1,   /* a guest frame of a native flow processed: a = frame bytes, b = frames it
                        * queued to the guest, tcp_flags = its flags, dur_ns = processing time */
    TN_TR_SYN_ACK = 2, /* the SYN-ACK of a new flow queued: a = host connect us, b = 1 when the
                        * connect completed at once (inside tn_adopt) */
    TN_TR_DRAIN = 3,   /* frames written to the guest since the last drain: a = frames, b = 1 when
                        * they belong to more than one flow (slot: the last one's), dur_ns = from
                        * the first write to the record */
    TN_TR_WAKE = 4,    /* a poll wake-up of the engine's epoll: a = socket events, b = timer
                        * expirations, c = frames written while running them, dur_ns = the time
                        * it ran them; slot: the flow whose frames they all were, else
                        * TN_TRACE_NO_FLOW (none written, or of more than one flow) */
    TN_TR_EVENT = 5,   /* a moment of the flow's TCP timeline (from trace level "timeline"): a = its
                        * enum tn_flow_event, b = bytes (TN_FE_GUEST_DATA, TN_FE_HOST_DATA; else 0) */
};
/* The flow events of TN_TR_EVENT: the Python path's span events of the same moments
 * (aioslirp.observe.tracing). The data events are written for the first TN_TRACE_DATA_EVENTS
 * of each direction of a flow only (the tracer's MAX_DATA_EVENTS), so a bulk flow writes few. */
enum tn_flow_event {
    TN_FE_ESTABLISHED = 1, /* the guest's ACK of our SYN-ACK: "established" */
    TN_FE_GUEST_DATA = 2,  /* guest bytes taken (sent to the host socket), b of them: "guest.data" */
    TN_FE_HOST_DATA = 3,   /* new host bytes read and sent to the guest, b of them: "host.data" */
    TN_FE_FIN_GUEST = 4,   /* the guest's FIN taken: "fin.guest" */
    TN_FE_FIN_HOST = 5,    /* the host's end of stream read: "fin.host" */
    TN_FE_RESET = 6,       /* the guest reset the flow or the engine gave up (retransmissions,
                            * tcp_linger): "reset" (then TN_FE_CLOSED) */
    TN_FE_CLOSED = 7,      /* the flow is over (not after a failed connect, an idle timeout or
                            * tn_close_flow: the Python path records none then): "closed" */
    TN_FE_CONNECT_REFUSED = 8,     /* the host refused the connect: "connect.refused" */
    TN_FE_CONNECT_UNREACHABLE = 9, /* ... it failed otherwise or timed out: "connect.unreachable" */
    /* A frame written to the guest (no queue: at once), as the Python path's writer stamps them
     * (trace level "frames"): a SYN-ACK, data (b = payload bytes; the first
     * TN_TRACE_DATA_EVENTS data frames of a flow only), a FIN, a RST; pure ACKs none. */
    TN_FE_SYN_ACK_SENT = 10,
    TN_FE_DATA_SENT = 11,
    TN_FE_FIN_SENT = 12,
    TN_FE_RST_SENT = 13,
};
#define TN_TRACE_DATA_EVENTS 8
#define TN_TRACE_NO_FLOW UINT32_MAX
/* Largest ring tn_trace_enable() takes (records of 40 bytes: 40 MiB). */
#define TN_TRACE_MAX (1u << 20)

/* One trace record: fixed size, written in place in the ring. t_ns: when the point ended
 * (CLOCK_MONOTONIC ns); it began dur_ns before. */
struct tn_trace_rec {
    uint8_t type, tcp_flags;
    uint16_t pad;
    uint32_t slot, gen;
    uint32_t a, b, c;
    uint32_t dur_ns;
    uint64_t t_ns;
};

/* Switch the trace points on with a ring of capacity records (1..TN_TRACE_MAX; the ring is
 * allocated once), or off with 0 (records not taken are dropped). 0, -EINVAL, -ENOMEM. */
int tn_trace_enable(struct tn_engine *e, uint32_t capacity);
/* Move up to max trace records, oldest first, into out; returns how many. */
size_t tn_trace_take(struct tn_engine *e, struct tn_trace_rec *out, size_t max);
/* Records dropped because the ring was full (since tn_trace_enable). */
uint64_t tn_trace_overflow(const struct tn_engine *e);
/* How many trace records wait to be taken. */
uint32_t tn_trace_pending(const struct tn_engine *e);
/* The binding's wake-up point: one TN_TR_WAKE record (t0_ns: when the wake-up began). */
void tn_trace_wake(struct tn_engine *e, uint32_t sock_events, uint32_t timer, uint64_t t0_ns);
/* Tracing is on (the binding's test before it reads the clock for tn_trace_wake). */
int tn_tracing(const struct tn_engine *e);
uint64_t tn_clock_ns(void);

/* The hash of the guest side's 5-tuple (exposed for the tests of its spread). */
uint64_t tn_hash(const uint64_t key[2], int v6, const uint8_t *gip, uint16_t gport, const uint8_t *dip, uint16_t dport);

#endif
