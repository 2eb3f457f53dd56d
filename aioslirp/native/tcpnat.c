/* aioslirp's native TCP NAT engine: see tcpnat.h for the theory of operation and the bounds.
 * MIT licensed, written for aioslirp. */
#define _GNU_SOURCE
#include "tcpnat.h"

#include <time.h>

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#define TCP_FIN 0x01u
#define TCP_SYN 0x02u
#define TCP_RST 0x04u
#define TCP_PSH 0x08u
#define TCP_ACK 0x10u

#define RTO_MIN 0.2
#define RTO_MAX 60.0
#define SYN_ACK_RTO 1.0
#define MAX_RETRIES 12
#define DUPACK_THRESHOLD 3
/* Unacknowledged guest bytes from which an ACK goes at once (two full-sized segments, at most
 * this: the Python path's rule, aioslirp.tcp.connection _ack_now_at). */
#define ACK_NOW_MAX 16384u
#define OUR_WS_MAX 14

enum {
    ST_FREE = 0,
    ST_CONNECTING, /* host connect in progress: the guest's SYN not answered yet */
    ST_SYN_RCVD,   /* SYN-ACK sent */
    ST_ESTABLISHED,
    ST_TIME_WAIT,  /* both FINs done, we closed first: the socket is closed, the tuple kept */
    ST_ZOMBIE,     /* over: the slot waits for its ENDED record to be taken */
};

/* f->fl bits */
#define FL_GUEST_FIN 0x0001u  /* the guest's FIN taken (rcv_nxt past it), SHUT_WR done */
#define FL_HOST_EOF 0x0002u   /* the host's end of stream seen (peek returned 0) */
#define FL_FIN_SENT 0x0004u   /* our FIN sent (at fin_seq) */
#define FL_FIN_ACKED 0x0008u
#define FL_WE_FIRST 0x0010u   /* our FIN left before the guest's came: TIME-WAIT is ours */
#define FL_RX_READY 0x0020u   /* the socket may have bytes we have not peeked */
#define FL_RDHUP 0x0040u      /* the host shut down its write side (EPOLLRDHUP) */
#define FL_TX_BLOCKED 0x0080u /* a send() took part: window 0 until EPOLLOUT */
#define FL_ACK_DUE 0x0100u    /* an ACK goes out at the next tn_flush() */
#define FL_WS 0x0200u         /* window scaling on (the guest offered it) */
#define FL_SOCK_OPEN 0x0400u
#define FL_SPACE_STALE 0x0800u /* the socket's room may have changed since it was asked (sock_space) */
#define FL_WATCH_OUT 0x1000u   /* the socket's writability is watched (EPOLLOUT) */
#define FL_RATE_UP 0x2000u     /* our window is held small by the up rate cap: rate_at reopens it */
#define FL_RATE_DOWN 0x4000u   /* reading the host socket waits for the down rate cap: rate_at */

/* f->held bits (tn_allow) */
#define HOLD_UP 0x01u
#define HOLD_DOWN 0x02u

struct tn_flow {
    uint32_t gen;
    uint8_t state, v6, dupacks, retries;
    uint16_t fl;
    uint16_t mss;              /* payload per segment towards the guest */
    uint8_t snd_ws, rcv_ws;    /* the guest's shift (its windows) / ours (our windows) */
    uint16_t gport, dport;
    int fd;
    int32_t hpos;              /* index in the timer heap, -1 none */
    uint32_t ack_next;         /* next in the list of flows with an ACK due (slot + 1, 0 end) */
    uint8_t gip[16], dip[16];
    uint8_t eth[14];           /* the Ethernet header towards the guest */
    uint32_t irs, rcv_nxt;     /* guest -> host */
    uint32_t iss, snd_una, snd_nxt, snd_max, snd_wnd, fin_seq; /* host -> guest */
    uint32_t snd_wl1, snd_wl2; /* seq and ack of the segment that last set the window (RFC 9293 3.10.7.4) */
    uint32_t last_wnd_field;   /* the guest's last window field (duplicate ACK detection) */
    uint32_t space;            /* what the host socket takes (sock_space), less what was sent since */
    uint32_t rcv_adv;          /* the right edge of the window we advertised last */
    double last_active, started, deadline;
    double rto, rto_at, persist_at, tw_until, connect_until;
    double wnd_at, wnd_every;  /* our window is small: look at the socket's room again then */
    double progress_at;        /* our FIN sent: its time, then of each ACK of new data (linger) */
    double rate_at;            /* held by a rate cap: wake up then (0 none) */
    double ack_at;             /* a delayed ACK goes then unless a frame of ours carried it first (0 none) */
    uint32_t acked;            /* rcv_nxt as our last frame acknowledged it */
    uint32_t hold_prev, hold_next; /* in the list of held flows (slot + 1, 0 none): while held != 0 */
    uint32_t up_mark;          /* guest -> host bytes charged up to here (charged_up, the up allowance) */
    uint8_t held;              /* HOLD_UP / HOLD_DOWN: the allowance of that direction ran out */
    uint64_t bytes_up, bytes_down;
    uint8_t outcome, why;
    uint8_t tr_guest, tr_host, tr_sent; /* TN_FE_GUEST_DATA / HOST_DATA / DATA_SENT events written
                                         * (TN_TRACE_DATA_EVENTS at most each) */
    int32_t err;
};

/* A byte-rate cap (aioslirp.ratelimit.ByteBucket's rule) in integers: tokens in nanobytes
 * (bytes x 1e9), so that a refill is dt_ns x rate with nothing lost to rounding. With rate <=
 * TN_RATE_MAX the burst is below 2^60 nB and the debt is floored at -2^62 nB: no overflow. */
struct tn_bucket {
    uint64_t rate;  /* bytes/s; 0: no cap */
    int64_t burst;  /* nB */
    int64_t tokens; /* nB; below 0: a debt of a stream */
    int64_t stamp;  /* ns of the last refill, -1 none yet */
};

struct tn_engine {
    struct tn_config cfg;
    struct tn_bucket up, down; /* the rate caps (cfg.rate_up / rate_down) */
    int64_t allow_up, allow_down; /* bytes each way before a hold (tn_allow), TN_ALLOW_ALL none */
    uint32_t hold_head, hold_tail, nheld; /* the held flows, oldest first (slot + 1) */
    int resume_due;            /* an allowance rose above zero with flows held: resume them */
    struct tn_io io;
    struct tn_flow *flows;
    uint32_t cap, live, free_head;
    uint32_t *free_next;       /* free list of slots (index + 1, 0 end) */
    uint32_t *htab;            /* open addressing: slot + 1, 0 empty */
    uint32_t hmask;
    uint32_t *heap;            /* timer heap of slots, by deadline */
    uint32_t hlen;
    uint32_t ack_head;         /* flows with an ACK due */
    struct tn_record *ring;
    uint32_t ring_cap, ring_head, ring_len;
    uint16_t ip_id;
    uint32_t rcv_wnd;          /* our window, bytes */
    double now;                /* the time of the call being run */
    struct tn_counters c;
    /* trace points (tn_trace_enable): the ring, NULL while off */
    struct tn_trace_rec *tr;
    uint32_t tr_cap, tr_head, tr_len;
    uint64_t tr_overflow;
    uint32_t tr_out;           /* frames written since the last TN_TR_DRAIN */
    uint32_t tr_slot;          /* ... the flow of the last one, */
    uint8_t tr_mixed;          /* ... and whether they belong to more than one */
    uint64_t tr_first_ns;      /* ... when the first was written */
    /* the gather (tn_frame_kept): in-order payloads of one flow from consecutive frames whose
     * memory the caller keeps until tn_gather_flush, sent to its socket in one sendmsg */
    int gather_ok;             /* the frame being taken is kept (set by tn_frame_kept) */
    uint32_t g_slot, g_gen;    /* the flow (slot + 1, 0 none) and its generation */
    uint32_t g_n;              /* iovecs held */
    size_t g_len;              /* their bytes */
    size_t g_max;              /* the most bytes one sendmsg gathers (tn_gather_max), 0: no bound */
    struct iovec g_iov[TN_GATHER_MAX];
    /* tn_frame_zc: the frame's payload in the caller's pieces (zc set while it is taken) */
    int zc, zc_n;
    struct iovec zc_iov[TN_GATHER_MAX];
    uint8_t hdr[12 + 14 + 40 + 60];
    uint8_t peek[TN_PEEK_MAX];
    /* frames written in place (tn_io.rx_reserve): the payload pieces of the frames reserved, and
     * the bytes each frame holds */
    struct iovec dv[TN_DIRECT_IOV];
    size_t dcap[TN_DIRECT_FRAMES];
};

/* RFC 9293's names, as aioslirp.tcp.tcb spells them */
static const char *const state_names[] = {
    "CLOSED", "SYN-RECEIVED", "SYN-RECEIVED", "ESTABLISHED", "TIME-WAIT", "CLOSED",
    "CLOSE-WAIT", "FIN-WAIT-1", "FIN-WAIT-2", "LAST-ACK", "CLOSING",
};
enum { SN_CLOSE_WAIT = 6, SN_FIN_WAIT_1, SN_FIN_WAIT_2, SN_LAST_ACK, SN_CLOSING, SN_COUNT };

const char *tn_state_name(unsigned s)
{
    return s < SN_COUNT ? state_names[s] : NULL;
}

static const char *const outcome_names[TN_OUT_COUNT] = {
    "", "closed", "reset", "refused", "unreachable", "timeout", "shutdown",
};

const char *tn_outcome_name(unsigned o)
{
    return o < TN_OUT_COUNT ? outcome_names[o] : NULL;
}

#define SEQ_LT(a, b) ((int32_t)((uint32_t)(a) - (uint32_t)(b)) < 0)
#define SEQ_LE(a, b) ((int32_t)((uint32_t)(a) - (uint32_t)(b)) <= 0)
#define SEQ_GT(a, b) SEQ_LT(b, a)
#define SEQ_GE(a, b) SEQ_LE(b, a)

static inline uint16_t rd16(const uint8_t *p)
{
    return (uint16_t)((p[0] << 8) | p[1]);
}
static inline uint32_t rd32(const uint8_t *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline void wr16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)(v >> 8);
    p[1] = (uint8_t)v;
}
static inline void wr32(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)(v >> 24);
    p[1] = (uint8_t)(v >> 16);
    p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}

/* ------------------------------------------------------------------ checksums */

static uint32_t sum16(const uint8_t *p, size_t n, uint32_t s)
{
    uint64_t acc = s;
    while (n >= 2) {
        acc += rd16(p);
        p += 2;
        n -= 2;
    }
    if (n)
        acc += (uint32_t)p[0] << 8;
    while (acc >> 16)
        acc = (acc & 0xFFFFu) + (acc >> 16);
    return (uint32_t)acc;
}

static uint16_t fold(uint32_t s)
{
    while (s >> 16)
        s = (s & 0xFFFFu) + (s >> 16);
    return (uint16_t)s;
}

/* The sum of the pseudo-header (addresses, protocol 6, TCP length). */
static uint32_t pseudo_sum(int v6, const uint8_t *src, const uint8_t *dst, uint32_t tcp_len)
{
    size_t alen = v6 ? 16 : 4;
    uint32_t s = sum16(src, alen, 0);
    s = sum16(dst, alen, s);
    return s + 6u + (tcp_len & 0xFFFFu) + (tcp_len >> 16);
}

/* ------------------------------------------------------------------ the flow hash */

static inline uint64_t rotl(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

/* A keyed hash of the 5-tuple (SipHash-1-3 over the 40 tuple bytes, zero padded). */
uint64_t tn_hash(const uint64_t key[2], int v6, const uint8_t *gip, uint16_t gport, const uint8_t *dip, uint16_t dport)
{
    uint8_t m[40] = {0};
    size_t alen = v6 ? 16 : 4;
    memcpy(m, gip, alen);
    memcpy(m + 16, dip, alen);
    wr16(m + 32, gport);
    wr16(m + 34, dport);
    m[36] = (uint8_t)v6;
    uint64_t v0 = 0x736f6d6570736575ULL ^ key[0], v1 = 0x646f72616e646f6dULL ^ key[1];
    uint64_t v2 = 0x6c7967656e657261ULL ^ key[0], v3 = 0x7465646279746573ULL ^ key[1];
#define SIPROUND                                                                                                       \
    do {                                                                                                               \
        v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);                                                     \
        v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;                                                                        \
        v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;                                                                        \
        v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);                                                     \
    } while (0)
    for (size_t i = 0; i < sizeof m; i += 8) {
        uint64_t w;
        memcpy(&w, m + i, 8);
        v3 ^= w;
        SIPROUND;
        v0 ^= w;
    }
    uint64_t b = (uint64_t)sizeof m << 56;
    v3 ^= b;
    SIPROUND;
    v0 ^= b;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
#undef SIPROUND
    return v0 ^ v1 ^ v2 ^ v3;
}

static int same_tuple(const struct tn_flow *f, int v6, const uint8_t *gip, uint16_t gport, const uint8_t *dip,
                      uint16_t dport)
{
    size_t alen = v6 ? 16 : 4;
    return f->v6 == v6 && f->gport == gport && f->dport == dport && !memcmp(f->gip, gip, alen) &&
           !memcmp(f->dip, dip, alen);
}

static uint32_t hash_slot(const struct tn_engine *e, const struct tn_flow *f)
{
    return (uint32_t)tn_hash(e->cfg.hash_key, f->v6, f->gip, f->gport, f->dip, f->dport) & e->hmask;
}

static struct tn_flow *lookup(struct tn_engine *e, int v6, const uint8_t *gip, uint16_t gport, const uint8_t *dip,
                              uint16_t dport)
{
    uint32_t i = (uint32_t)tn_hash(e->cfg.hash_key, v6, gip, gport, dip, dport) & e->hmask;
    for (uint32_t n = 0; n <= e->hmask; n++, i = (i + 1) & e->hmask) {
        uint32_t v = e->htab[i];
        if (!v)
            return NULL;
        struct tn_flow *f = &e->flows[v - 1];
        if (same_tuple(f, v6, gip, gport, dip, dport))
            return f;
    }
    return NULL;
}

static void hash_insert(struct tn_engine *e, struct tn_flow *f)
{
    uint32_t i = hash_slot(e, f);
    while (e->htab[i])
        i = (i + 1) & e->hmask;
    e->htab[i] = (uint32_t)(f - e->flows) + 1;
}

/* Remove f, shifting back the entries of its probe run (no tombstones). */
static void hash_remove(struct tn_engine *e, struct tn_flow *f)
{
    uint32_t want = (uint32_t)(f - e->flows) + 1, i = hash_slot(e, f);
    while (e->htab[i] != want) {
        if (!e->htab[i])
            return;
        i = (i + 1) & e->hmask;
    }
    uint32_t j = i;
    for (;;) {
        e->htab[i] = 0;
        for (;;) {
            j = (j + 1) & e->hmask;
            if (!e->htab[j])
                return;
            uint32_t k = hash_slot(e, &e->flows[e->htab[j] - 1]);
            /* move j to i unless its home k lies cyclically in (i, j] */
            if (i <= j ? (i < k && k <= j) : (i < k || k <= j))
                continue;
            break;
        }
        e->htab[i] = e->htab[j];
        i = j;
    }
}

/* ------------------------------------------------------------------ the timer heap */

static void heap_swap(struct tn_engine *e, uint32_t a, uint32_t b)
{
    uint32_t sa = e->heap[a], sb = e->heap[b];
    e->heap[a] = sb;
    e->heap[b] = sa;
    e->flows[sb].hpos = (int32_t)a;
    e->flows[sa].hpos = (int32_t)b;
}

static void heap_up(struct tn_engine *e, uint32_t i)
{
    while (i) {
        uint32_t p = (i - 1) / 2;
        if (e->flows[e->heap[p]].deadline <= e->flows[e->heap[i]].deadline)
            break;
        heap_swap(e, i, p);
        i = p;
    }
}

static void heap_down(struct tn_engine *e, uint32_t i)
{
    for (;;) {
        uint32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < e->hlen && e->flows[e->heap[l]].deadline < e->flows[e->heap[m]].deadline)
            m = l;
        if (r < e->hlen && e->flows[e->heap[r]].deadline < e->flows[e->heap[m]].deadline)
            m = r;
        if (m == i)
            return;
        heap_swap(e, i, m);
        i = m;
    }
}

static void heap_remove(struct tn_engine *e, struct tn_flow *f)
{
    if (f->hpos < 0)
        return;
    uint32_t i = (uint32_t)f->hpos, last = --e->hlen;
    f->hpos = -1;
    if (i != last) {
        uint32_t s = e->heap[last];
        e->heap[i] = s;
        e->flows[s].hpos = (int32_t)i;
        heap_up(e, i);
        heap_down(e, (uint32_t)e->flows[s].hpos);
    }
}

/* FIN-WAIT-2 (bounded by the guest's silence) or LAST-ACK / CLOSING (by progress): tcp_linger. */
static int linger_applies(const struct tn_flow *f)
{
    uint16_t fl = f->fl;
    return (fl & FL_FIN_SENT) && (((fl & FL_FIN_ACKED) && !(fl & FL_GUEST_FIN)) ||
                                  ((fl & FL_GUEST_FIN) && !(fl & FL_FIN_ACKED)));
}

static double linger_deadline(const struct tn_engine *e, const struct tn_flow *f)
{
    if (e->cfg.linger <= 0)
        return 0;
    double from = f->progress_at;
    if (!(f->fl & FL_GUEST_FIN) && f->last_active > from) /* FIN-WAIT-2: any guest segment counts */
        from = f->last_active;
    return from + e->cfg.linger;
}

/* The flow's next deadline from its timers; the heap follows. */
static void rearm(struct tn_engine *e, struct tn_flow *f)
{
    double d = 0;
#define TAKE(t)                                                                                                        \
    do {                                                                                                               \
        if ((t) > 0 && (d == 0 || (t) < d))                                                                            \
            d = (t);                                                                                                   \
    } while (0)
    switch (f->state) {
    case ST_CONNECTING:
        TAKE(f->connect_until);
        break;
    case ST_SYN_RCVD:
    case ST_ESTABLISHED:
        TAKE(f->rto_at);
        TAKE(f->persist_at);
        TAKE(f->wnd_at);
        TAKE(f->rate_at);
        TAKE(f->ack_at);
        if (linger_applies(f))
            TAKE(linger_deadline(e, f));
        if (e->cfg.idle_timeout > 0)
            TAKE(f->last_active + e->cfg.idle_timeout);
        break;
    case ST_TIME_WAIT:
        TAKE(f->tw_until);
        break;
    default:
        break;
    }
#undef TAKE
    if (d == 0) {
        heap_remove(e, f);
        return;
    }
    f->deadline = d;
    if (f->hpos < 0) {
        uint32_t i = e->hlen++;
        e->heap[i] = (uint32_t)(f - e->flows);
        f->hpos = (int32_t)i;
        heap_up(e, i);
    } else {
        heap_up(e, (uint32_t)f->hpos);
        heap_down(e, (uint32_t)f->hpos);
    }
}

/* ------------------------------------------------------------------ rate caps */

#define NB INT64_C(1000000000)
#define DEBT_FLOOR (-(INT64_C(1) << 62))

static void bucket_init(struct tn_bucket *b, uint64_t rate)
{
    b->rate = rate;
    if (!rate)
        return;
    uint64_t burst = rate / 100; /* 10 ms of the rate, at least 64 KiB */
    if (burst < 65536)
        burst = 65536;
    b->burst = b->tokens = (int64_t)burst * NB;
    b->stamp = -1;
}

/* The bucket's tokens (nB) at now (seconds), refilled since the last call. */
static int64_t bucket_refill(struct tn_bucket *b, double now)
{
    int64_t t = now > 0 && now < 9.0e9 ? (int64_t)(now * 1e9) : 0;
    if (b->stamp >= 0 && t > b->stamp && b->tokens < b->burst) {
        uint64_t dt = (uint64_t)(t - b->stamp);
        uint64_t most = (uint64_t)(b->burst - b->tokens) / b->rate + 1; /* enough to fill it */
        if (dt > most)
            dt = most;
        b->tokens += (int64_t)(dt * b->rate);
        if (b->tokens > b->burst)
            b->tokens = b->burst;
    }
    if (t > b->stamp)
        b->stamp = t;
    return b->tokens;
}

/* n bytes passed (the balance may go below zero). */
static void bucket_spend(struct tn_bucket *b, uint64_t n)
{
    if (n > (UINT64_C(1) << 30)) /* never: a frame's payload, a peek */
        n = UINT64_C(1) << 30;
    int64_t d = (int64_t)n * NB;
    b->tokens = b->tokens < DEBT_FLOOR + d ? DEBT_FLOOR : b->tokens - d;
}

/* Seconds until the bucket holds at least need bytes (need <= its burst). */
static double bucket_wait(const struct tn_bucket *b, uint32_t need)
{
    int64_t want = (int64_t)need * NB;
    if (b->tokens >= want)
        return 0;
    uint64_t ns = (uint64_t)(want - b->tokens) / b->rate + 1;
    return (double)ns * 1e-9 + 1e-6; /* (a microsecond late rather than early: the clock is a double) */
}

/* ------------------------------------------------------------------ engine */

struct tn_engine *tn_new(const struct tn_config *cfg, const struct tn_io *io)
{
    if (!cfg || !io || cfg->max_flows < 1 || cfg->max_flows > (1u << 22) || cfg->mtu < 576 || cfg->mtu > 65521 ||
        cfg->rate_up > TN_RATE_MAX || cfg->rate_down > TN_RATE_MAX || !(cfg->ack_delay >= 0 && cfg->ack_delay <= 0.5))
        return NULL;
    struct tn_engine *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    e->cfg = *cfg;
    e->io = *io;
    e->cap = cfg->max_flows;
    uint32_t h = 16;
    while (h < 2 * e->cap)
        h <<= 1;
    e->hmask = h - 1;
    e->ring_cap = 2 * e->cap + 2;
    e->flows = calloc(e->cap, sizeof *e->flows);
    e->free_next = calloc(e->cap, sizeof *e->free_next);
    e->htab = calloc(h, sizeof *e->htab);
    e->heap = calloc(e->cap, sizeof *e->heap);
    e->ring = calloc(e->ring_cap, sizeof *e->ring);
    if (!e->flows || !e->free_next || !e->htab || !e->heap || !e->ring) {
        tn_free(e);
        return NULL;
    }
    for (uint32_t i = 0; i < e->cap; i++) {
        e->free_next[i] = i + 2 <= e->cap ? i + 2 : 0;
        e->flows[i].fd = -1;
        e->flows[i].hpos = -1;
    }
    e->free_head = 1;
    uint32_t w = cfg->rcv_buf ? cfg->rcv_buf : 65535;
    if (w > (65535u << OUR_WS_MAX))
        w = 65535u << OUR_WS_MAX;
    e->rcv_wnd = w;
    bucket_init(&e->up, cfg->rate_up);
    bucket_init(&e->down, cfg->rate_down);
    e->allow_up = e->allow_down = TN_ALLOW_ALL;
    return e;
}

void tn_free(struct tn_engine *e)
{
    if (!e)
        return;
    if (e->flows) {
        for (uint32_t i = 0; i < e->cap; i++) {
            struct tn_flow *f = &e->flows[i];
            if ((f->fl & FL_SOCK_OPEN) && f->fd >= 0)
                e->io.sock_close(e->io.ctx, f->fd, 1);
        }
    }
    free(e->flows);
    free(e->free_next);
    free(e->htab);
    free(e->heap);
    free(e->ring);
    free(e->tr);
    free(e);
}

const struct tn_counters *tn_counters(const struct tn_engine *e)
{
    return &e->c;
}

uint32_t tn_live_flows(const struct tn_engine *e)
{
    return e->live;
}

uint32_t tn_capacity(const struct tn_engine *e)
{
    return e->cap;
}

static uint64_t tag_of(const struct tn_engine *e, const struct tn_flow *f)
{
    return ((uint64_t)f->gen << 32) | (uint32_t)(f - e->flows);
}

static void push_record(struct tn_engine *e, struct tn_flow *f, uint8_t kind)
{
    if (e->ring_len == e->ring_cap) /* cannot happen: 2 records per slot at most (see tn_take_records) */
        return;
    struct tn_record *r = &e->ring[(e->ring_head + e->ring_len++) % e->ring_cap];
    memset(r, 0, sizeof *r);
    r->slot = (uint32_t)(f - e->flows);
    r->gen = f->gen;
    r->kind = kind;
    if (kind == TN_REC_ENDED) {
        r->outcome = f->outcome;
        r->why = f->why;
        r->err = f->err;
        r->bytes_up = f->bytes_up;
        r->bytes_down = f->bytes_down;
    }
}

size_t tn_take_records(struct tn_engine *e, struct tn_record *out, size_t max)
{
    size_t n = 0;
    while (n < max && e->ring_len) {
        struct tn_record *r = &e->ring[e->ring_head];
        out[n++] = *r;
        e->ring_head = (e->ring_head + 1) % e->ring_cap;
        e->ring_len--;
        if (r->kind == TN_REC_ENDED) { /* the slot is free again */
            struct tn_flow *f = &e->flows[r->slot];
            if (f->state == ST_ZOMBIE && f->gen == r->gen) {
                f->state = ST_FREE;
                e->free_next[r->slot] = e->free_head;
                e->free_head = r->slot + 1;
            }
        }
    }
    return n;
}

/* ------------------------------------------------------------------ trace points */

/* One predictable branch per point while off; nothing at all with -DTN_NO_TRACE. */
#ifdef TN_NO_TRACE
#define TRACING(e) 0
#else
#define TRACING(e) __builtin_expect((e)->tr != NULL, 0)
#endif

uint64_t tn_clock_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int tn_tracing(const struct tn_engine *e)
{
    return TRACING(e);
}

int tn_trace_enable(struct tn_engine *e, uint32_t capacity)
{
    if (capacity > TN_TRACE_MAX)
        return -EINVAL;
    free(e->tr);
    e->tr = NULL;
    e->tr_cap = e->tr_head = e->tr_len = 0;
    e->tr_overflow = 0;
    e->tr_out = 0;
    e->tr_mixed = 0;
    if (capacity == 0)
        return 0;
    e->tr = calloc(capacity, sizeof *e->tr);
    if (!e->tr)
        return -ENOMEM;
    e->tr_cap = capacity;
    return 0;
}

/* The next record of the ring (zeroed but for type, slot, gen and the time), or NULL when the
 * ring is full (counted). */
static struct tn_trace_rec *trace_rec(struct tn_engine *e, uint8_t type, const struct tn_flow *f, uint64_t t_ns)
{
    if (e->tr_len == e->tr_cap) {
        e->tr_overflow++;
        return NULL;
    }
    struct tn_trace_rec *r = &e->tr[(e->tr_head + e->tr_len++) % e->tr_cap];
    memset(r, 0, sizeof *r);
    r->type = type;
    r->slot = f ? (uint32_t)(f - e->flows) : TN_TRACE_NO_FLOW;
    r->gen = f ? f->gen : 0;
    r->t_ns = t_ns;
    return r;
}

static inline uint32_t clamp32(uint64_t v)
{
    return v > UINT32_MAX ? UINT32_MAX : (uint32_t)v;
}

/* TN_TR_EVENT: a moment of f's timeline (enum tn_flow_event), nbytes for the data events. */
static void trace_event(struct tn_engine *e, const struct tn_flow *f, uint32_t what, uint64_t nbytes)
{
    struct tn_trace_rec *r = trace_rec(e, TN_TR_EVENT, f, tn_clock_ns());
    if (r) {
        r->a = what;
        r->b = clamp32(nbytes);
    }
}

/* A data event of one direction of f, while *n (its events so far) is below TN_TRACE_DATA_EVENTS. */
static void trace_data(struct tn_engine *e, const struct tn_flow *f, uint8_t *n, uint32_t what, uint64_t nbytes)
{
    if (*n >= TN_TRACE_DATA_EVENTS)
        return;
    ++*n;
    trace_event(e, f, what, nbytes);
}

/* The *.sent event of a frame of f written to the guest (flags, plen payload bytes). */
static void trace_sent(struct tn_engine *e, struct tn_flow *f, uint8_t flags, size_t plen)
{
    if (flags & TCP_RST)
        trace_event(e, f, TN_FE_RST_SENT, 0);
    else if (flags & TCP_SYN)
        trace_event(e, f, TN_FE_SYN_ACK_SENT, 0);
    else if (flags & TCP_FIN)
        trace_event(e, f, TN_FE_FIN_SENT, 0);
    else if (plen)
        trace_data(e, f, &f->tr_sent, TN_FE_DATA_SENT, plen);
}

/* The events of f's end (finish): as the Python path's connection reports them, TN_FE_RESET when
 * the guest reset it or the engine gave up, then TN_FE_CLOSED; none after a failed connect, an idle
 * timeout or a shutdown by Python (the Python path ends those flows without its connection's events). */
static void trace_end(struct tn_engine *e, const struct tn_flow *f, uint8_t outcome, uint8_t why)
{
    if (why == TN_WHY_CONNECT || why == TN_WHY_IDLE || outcome == TN_OUT_SHUTDOWN)
        return;
    if (why == TN_WHY_GUEST_RST || why == TN_WHY_RETRIES || why == TN_WHY_LINGER)
        trace_event(e, f, TN_FE_RESET, 0);
    trace_event(e, f, TN_FE_CLOSED, 0);
}

/* A frame to the guest was written (send_seg): note it for the next TN_TR_DRAIN. */
static void trace_out(struct tn_engine *e, const struct tn_flow *f)
{
    uint32_t slot = (uint32_t)(f - e->flows);
    if (e->tr_out == 0) {
        e->tr_first_ns = tn_clock_ns();
        e->tr_mixed = 0;
    } else if (slot != e->tr_slot) {
        e->tr_mixed = 1;
    }
    e->tr_slot = slot;
    e->tr_out++;
}

/* TN_TR_DRAIN: the frames written since the last one (nothing when none was). */
static void trace_drain(struct tn_engine *e)
{
    if (e->tr_out == 0)
        return;
    uint64_t t = tn_clock_ns();
    struct tn_trace_rec *r = trace_rec(e, TN_TR_DRAIN, NULL, t);
    if (r) {
        struct tn_flow *f = &e->flows[e->tr_slot];
        r->slot = e->tr_slot;
        r->gen = f->gen;
        r->a = e->tr_out;
        r->b = e->tr_mixed;
        r->dur_ns = clamp32(t - e->tr_first_ns);
    }
    e->tr_out = 0;
}

void tn_trace_wake(struct tn_engine *e, uint32_t sock_events, uint32_t timer, uint64_t t0_ns)
{
    if (!TRACING(e))
        return;
    uint64_t t = tn_clock_ns();
    struct tn_trace_rec *r = trace_rec(e, TN_TR_WAKE, NULL, t);
    if (r) {
        r->a = sock_events;
        r->b = timer;
        r->c = e->tr_out;
        if (e->tr_out && !e->tr_mixed) { /* every frame it wrote was one flow's */
            r->slot = e->tr_slot;
            r->gen = e->flows[e->tr_slot].gen;
        }
        r->dur_ns = clamp32(t > t0_ns ? t - t0_ns : 0);
    }
}

size_t tn_trace_take(struct tn_engine *e, struct tn_trace_rec *out, size_t max)
{
    size_t n = 0;
    while (n < max && e->tr_len) {
        out[n++] = e->tr[e->tr_head];
        e->tr_head = (e->tr_head + 1) % e->tr_cap;
        e->tr_len--;
    }
    return n;
}

uint64_t tn_trace_overflow(const struct tn_engine *e)
{
    return e->tr_overflow;
}

uint32_t tn_trace_pending(const struct tn_engine *e)
{
    return e->tr_len;
}

/* ------------------------------------------------------------------ frames to the guest */

/* Below this many bytes of known room the socket is asked again (one getsockopt + ioctl). */
#define SPACE_REFRESH (256u * 1024u)
/* A window below this is watched (WND_WATCH_MIN s, doubling to WND_WATCH_MAX) for room. */
#define WND_SMALL (64u * 1024u)
#define WND_WATCH_MIN 0.001
#define WND_WATCH_MAX 0.2

static void rearm(struct tn_engine *e, struct tn_flow *f);

/* A flow held by a rate cap (flag FL_RATE_UP / FL_RATE_DOWN): wake up in wait seconds. */
static void rate_hold(struct tn_engine *e, struct tn_flow *f, uint16_t flag, double wait)
{
    if (!(f->fl & flag)) {
        f->fl |= flag;
        if (flag == FL_RATE_DOWN)
            e->c.rate_paused_down++;
        else if (f->bytes_up) /* a flow that never wrote to the host is not held back */
            e->c.rate_held_up++;
    }
    double at = e->now + wait;
    if (!(at > e->now)) /* a clock so large that the wait is below its precision: never a busy loop */
        at = e->now + 1.0;
    if (f->rate_at == 0 || at < f->rate_at) {
        f->rate_at = at;
        rearm(e, f);
    }
}

/* ------------------------------------------------------------------ allowances (tn_allow) */

/* f stops for the allowance of a direction (HOLD_UP / HOLD_DOWN, both when relisted): listed (at
 * the end) once; counted (held_up / held_down) when count. */
static void hold_as(struct tn_engine *e, struct tn_flow *f, uint8_t bit, int count)
{
    if ((f->held & bit) == bit)
        return;
    if (count && (bit & HOLD_UP))
        e->c.held_up++;
    if (count && (bit & HOLD_DOWN))
        e->c.held_down++;
    if (!f->held) {
        uint32_t me = (uint32_t)(f - e->flows) + 1;
        f->hold_prev = e->hold_tail;
        f->hold_next = 0;
        if (e->hold_tail)
            e->flows[e->hold_tail - 1].hold_next = me;
        else
            e->hold_head = me;
        e->hold_tail = me;
        e->nheld++;
    }
    f->held |= bit;
}

static void hold(struct tn_engine *e, struct tn_flow *f, uint8_t bit)
{
    hold_as(e, f, bit, 1);
}

/* f leaves the list of held flows (resumed, or over); its bits are returned. */
static uint8_t unhold(struct tn_engine *e, struct tn_flow *f)
{
    uint8_t bits = f->held;
    if (!bits)
        return 0;
    if (f->hold_prev)
        e->flows[f->hold_prev - 1].hold_next = f->hold_next;
    else
        e->hold_head = f->hold_next;
    if (f->hold_next)
        e->flows[f->hold_next - 1].hold_prev = f->hold_prev;
    else
        e->hold_tail = f->hold_prev;
    f->hold_prev = f->hold_next = 0;
    f->held = 0;
    e->nheld--;
    return bits;
}

int tn_allow(struct tn_engine *e, int64_t up, int64_t down)
{
    int rose = 0;
    tn_gather_flush(e);
    if (up != TN_ALLOW_KEEP) {
        rose |= e->allow_up <= 0 && up > 0;
        e->allow_up = up < 0 ? 0 : up;
    }
    if (down != TN_ALLOW_KEEP) {
        rose |= e->allow_down <= 0 && down > 0;
        e->allow_down = down < 0 ? 0 : down;
    }
    if (rose && e->nheld)
        e->resume_due = 1;
    return e->resume_due;
}

uint32_t tn_held_flows(const struct tn_engine *e)
{
    return e->nheld;
}

/* A direction's allowance spent by n bytes (nothing without a bound). */
static inline void allow_spend(int64_t *allow, uint64_t n)
{
    if (*allow != TN_ALLOW_ALL)
        *allow -= (int64_t)n; /* (n: a frame's payload or a peek; the allowance at most what Python set) */
}

/* The guest -> host bytes charged (charged_up) up to edge of f's sequence space: each byte once,
 * when taken, or while an up allowance is set, when our window first lets the guest send it (what
 * a held guest may still send is charged when it is held: nothing it sends later is free). */
static void charge_up(struct tn_engine *e, struct tn_flow *f, uint32_t edge)
{
    if (SEQ_GT(edge, f->up_mark)) {
        uint32_t n = edge - f->up_mark;
        f->up_mark = edge;
        e->c.charged_up += n;
        allow_spend(&e->allow_up, n);
    }
}

static void adv_window_update(struct tn_engine *e, struct tn_flow *f);
static void send_ack(struct tn_engine *e, struct tn_flow *f);
static void from_sock(struct tn_engine *e, struct tn_flow *f, double now);
static void maybe_done(struct tn_engine *e, struct tn_flow *f, double now);

/* The held flows, as they were when the allowance rose, in the order they were held: a window
 * update for those held up (where it grew), the host socket read for those held down; a hold
 * whose allowance is still spent stays (relisted, not counted again). A flow held again
 * meanwhile (the allowance ran out again) goes to the end of the list. */
static void resume_held(struct tn_engine *e, double now)
{
    e->resume_due = 0;
    uint8_t open = (e->allow_up > 0 ? HOLD_UP : 0) | (e->allow_down > 0 ? HOLD_DOWN : 0);
    for (uint32_t n = e->nheld; n && e->hold_head; n--) {
        struct tn_flow *f = &e->flows[e->hold_head - 1];
        uint8_t bits = unhold(e, f);
        if (f->state != ST_ESTABLISHED)
            continue;
        if (bits & ~open)
            hold_as(e, f, bits & ~open, 0);
        bits &= open;
        if (bits & HOLD_UP)
            adv_window_update(e, f);
        if ((bits & HOLD_DOWN) && f->state == ST_ESTABLISHED) {
            from_sock(e, f, now);
            if (f->state == ST_ESTABLISHED)
                maybe_done(e, f, now);
        }
        if (f->state == ST_ESTABLISHED)
            rearm(e, f);
    }
}

/* The window w (> 0) under the up cap: what the bucket holds; 0 below min(w, TN_RATE_BATCH), and
 * the flow is held (its timer sends the window update when the bucket has refilled). */
static uint32_t rate_window(struct tn_engine *e, struct tn_flow *f, uint32_t w)
{
    int64_t tok = bucket_refill(&e->up, e->now);
    uint64_t may = tok > 0 ? (uint64_t)(tok / NB) : 0;
    uint32_t batch = w < TN_RATE_BATCH ? w : TN_RATE_BATCH;
    if (may < batch) {
        rate_hold(e, f, FL_RATE_UP, bucket_wait(&e->up, batch));
        return 0;
    }
    return may < w ? (uint32_t)may : w;
}

/* Our window: what the host socket's send buffer takes (so that the guest does not send what
 * would be dropped), at most rcv_wnd; 0 while a send() is blocked (until EPOLLOUT). */
static uint32_t adv_window(struct tn_engine *e, struct tn_flow *f)
{
    if (f->fl & FL_TX_BLOCKED)
        return 0;
    if (f->space < SPACE_REFRESH && (f->fl & (FL_SOCK_OPEN | FL_SPACE_STALE)) == (FL_SOCK_OPEN | FL_SPACE_STALE)) {
        f->fl &= (uint16_t)~FL_SPACE_STALE;
        uint32_t queued = 0;
        ssize_t r = e->io.sock_space(e->io.ctx, f->fd, &queued);
        f->space = r > 0 ? (r > (ssize_t)e->rcv_wnd ? e->rcv_wnd : (uint32_t)r) : 0;
        if (f->space < WND_SMALL && queued && f->wnd_at == 0 && f->space < e->rcv_wnd) {
            /* the host peer has bytes to read: no event says when it does, so look again soon
             * (the timer heap); a small send buffer with nothing queued grows as it is used */
            f->wnd_every = WND_WATCH_MIN;
            f->wnd_at = e->now + f->wnd_every;
            rearm(e, f);
        }
    }
    uint32_t w = f->space < e->rcv_wnd ? f->space : e->rcv_wnd;
    if (e->allow_up != TN_ALLOW_ALL && w && f->state == ST_ESTABLISHED) {
        /* the up allowance: the window charged already (up to up_mark) and what is left of it */
        uint32_t open = SEQ_GT(f->up_mark, f->rcv_nxt) ? f->up_mark - f->rcv_nxt : 0;
        uint64_t left = e->allow_up > 0 ? (uint64_t)e->allow_up : 0;
        if (w > open && left < w - open) { /* cut short: listed, to open further when it is raised */
            hold(e, f, HOLD_UP);
            w = open + (uint32_t)left;
        }
    }
    if (e->up.rate && w) /* the up cap: at most what the bucket holds, nothing below a batch */
        w = rate_window(e, f, w);
    return w;
}

/* Our window may have grown (a hold or a rate cap over, room in the socket): a window update
 * when it did. */
static void adv_window_update(struct tn_engine *e, struct tn_flow *f)
{
    if (f->state != ST_ESTABLISHED || (f->fl & FL_TX_BLOCKED))
        return;
    uint32_t before = SEQ_GT(f->rcv_adv, f->rcv_nxt) ? f->rcv_adv - f->rcv_nxt : 0;
    if (adv_window(e, f) > before) {
        e->c.window_updates++;
        send_ack(e, f);
    }
}

/* One segment to the guest: seq, our rcv_nxt as ack (when ACK), flags, the payload (may be
 * longer than the MSS: one GSO frame with offload, the caller cuts it otherwise). in_place: the
 * payload (plen bytes, pay unused) is in the sink's next reserved frame already (offload only):
 * the headers are committed there (tn_io.rx_commit) instead of writing the frame. */
static void seg_out(struct tn_engine *e, struct tn_flow *f, uint32_t seq, uint8_t flags, const uint8_t *pay,
                    size_t plen, int in_place)
{
    uint8_t *h = e->hdr;
    size_t vh = e->cfg.vnet ? DP_VNET_HDR_LEN : 0;
    uint8_t *eth = h + vh, *ip = eth + 14;
    size_t iphl = f->v6 ? 40 : 20;
    uint8_t *t = ip + iphl;
    size_t optlen = (flags & TCP_SYN) ? ((f->fl & FL_WS) ? 8 : 4) : 0;
    size_t thl = 20 + optlen;
    uint32_t tcp_len = (uint32_t)(thl + plen);
    memcpy(eth, f->eth, 14);
    if (f->v6) {
        wr32(ip, 0x60000000u);
        wr16(ip + 4, (uint16_t)tcp_len);
        ip[6] = 6;
        ip[7] = 64;
        memcpy(ip + 8, f->dip, 16);
        memcpy(ip + 24, f->gip, 16);
    } else {
        ip[0] = 0x45;
        ip[1] = 0;
        wr16(ip + 2, (uint16_t)(20 + tcp_len));
        wr16(ip + 4, e->ip_id++);
        wr16(ip + 6, 0x4000); /* DF */
        ip[8] = 64;
        ip[9] = 6;
        wr16(ip + 10, 0);
        memcpy(ip + 12, f->dip, 4);
        memcpy(ip + 16, f->gip, 4);
        wr16(ip + 10, (uint16_t)~fold(sum16(ip, 20, 0)));
    }
    wr16(t, f->dport);
    wr16(t + 2, f->gport);
    wr32(t + 4, seq);
    wr32(t + 8, (flags & TCP_ACK) ? f->rcv_nxt : 0);
    if (flags & TCP_ACK) { /* what was due (now, or delayed) goes with this frame */
        if (f->ack_at > 0) {
            f->ack_at = 0;
            if (plen || (flags & TCP_FIN))
                e->c.acks_carried++;
        }
        f->acked = f->rcv_nxt;
    }
    t[12] = (uint8_t)((thl / 4) << 4);
    t[13] = flags;
    uint32_t w = adv_window(e, f);
    if (!(f->fl & FL_TX_BLOCKED) && SEQ_GT(f->rcv_adv, f->rcv_nxt + w) && !(flags & TCP_SYN))
        w = f->rcv_adv - f->rcv_nxt; /* the window's right edge never moves back (RFC 9293 3.8.6.2.2) */
    uint8_t shift = (flags & TCP_SYN) ? 0 : f->rcv_ws;
    uint32_t field = w >> shift;
    if (field > 65535)
        field = 65535;
    wr16(t + 14, (uint16_t)field);
    if ((flags & TCP_ACK) && SEQ_GT(f->rcv_nxt + (field << shift), f->rcv_adv))
        f->rcv_adv = f->rcv_nxt + (field << shift);
    if (e->allow_up != TN_ALLOW_ALL) /* bounded: the window given is charged (once), not the bytes later */
        charge_up(e, f, f->rcv_adv);
    wr16(t + 16, 0);
    wr16(t + 18, 0);
    if (flags & TCP_SYN) {
        uint16_t mss = (uint16_t)(e->cfg.mtu - (f->v6 ? 60 : 40));
        t[20] = 2;
        t[21] = 4;
        wr16(t + 22, mss);
        if (f->fl & FL_WS) {
            t[24] = 1;
            t[25] = 3;
            t[26] = 3;
            t[27] = f->rcv_ws;
        }
    }
    uint32_t ps = pseudo_sum(f->v6, f->dip, f->gip, tcp_len);
    if (e->cfg.offload) {
        wr16(t + 16, fold(ps)); /* the partial checksum: the kernel completes it */
        memset(h, 0, DP_VNET_HDR_LEN);
        h[0] = 1; /* NEEDS_CSUM */
        uint16_t l4 = (uint16_t)(14 + iphl);
        if (plen > f->mss) {
            h[1] = f->v6 ? 4 : 1; /* GSO TCPV6 / TCPV4 */
            uint16_t gso = f->mss;
            memcpy(h + 4, &gso, 2);
        }
        uint16_t hl = (uint16_t)(l4 + thl), off = 16;
        memcpy(h + 2, &hl, 2);
        memcpy(h + 6, &l4, 2);
        memcpy(h + 8, &off, 2);
    } else {
        if (vh)
            memset(h, 0, DP_VNET_HDR_LEN);
        uint32_t s = sum16(t, thl, ps);
        if (plen) /* thl is even: the payload's sum continues at an even offset */
            s = sum16(pay, plen, s);
        uint16_t c = (uint16_t)~fold(s);
        wr16(t + 16, c);
    }
    struct iovec iov[2] = {{h, vh + 14 + iphl + thl}, {(void *)pay, plen}};
    int r = in_place ? e->io.rx_commit(e->io.ctx, h, iov[0].iov_len, plen) : e->io.tap_write(e->io.ctx, iov, plen ? 2 : 1);
    if (r < 0) {
        e->c.tap_write_errors++;
    } else {
        e->c.frames_out++;
        if (TRACING(e)) {
            trace_out(e, f);
            trace_sent(e, f, flags, plen);
        }
    }
}

static void send_seg(struct tn_engine *e, struct tn_flow *f, uint32_t seq, uint8_t flags, const uint8_t *pay,
                     size_t plen)
{
    seg_out(e, f, seq, flags, pay, plen, 0);
}

static void send_ack(struct tn_engine *e, struct tn_flow *f)
{
    f->fl &= (uint16_t)~FL_ACK_DUE;
    send_seg(e, f, f->snd_nxt, TCP_ACK, NULL, 0);
}

static void ack_later(struct tn_engine *e, struct tn_flow *f)
{
    if ((f->fl & FL_ACK_DUE) || f->state == ST_ZOMBIE || f->state == ST_FREE)
        return; /* (an ended flow may still be linked: linked again, the list would lose its tail) */
    f->fl |= FL_ACK_DUE;
    f->ack_next = e->ack_head;
    e->ack_head = (uint32_t)(f - e->flows) + 1;
}

/* The guest's data or FIN was taken: its ACK waits up to cfg.ack_delay for a frame of ours to
 * carry it (the host's reply; our FIN after its FIN), so a request/response costs the guest one
 * frame, not a bare ACK and then the reply (RFC 9293 3.8.6.3, RFC 1122 4.2.3.2: delayed ACKs; the
 * rules of the Python path's aioslirp.tcp.arrival). At once (ack_later) from two full-sized
 * segments (at most ACK_NOW_MAX) unacknowledged on (bulk), after our FIN (the guest's FIN is then the last segment), or
 * with no delay configured. */
static void ack_data(struct tn_engine *e, struct tn_flow *f)
{
    uint32_t full = (uint32_t)e->cfg.mtu - (f->v6 ? 60u : 40u);
    uint32_t now_at = 2 * full < ACK_NOW_MAX ? 2 * full : ACK_NOW_MAX;
    if (!(e->cfg.ack_delay > 0) || f->state != ST_ESTABLISHED || (f->fl & (FL_ACK_DUE | FL_FIN_SENT)) ||
        f->rcv_nxt - f->acked >= now_at) {
        ack_later(e, f);
        return;
    }
    if (f->ack_at == 0) {
        f->ack_at = e->now + e->cfg.ack_delay;
        rearm(e, f);
    }
}

/* ------------------------------------------------------------------ ending */

static void close_sock(struct tn_engine *e, struct tn_flow *f, int abort)
{
    if (f->fl & FL_SOCK_OPEN) {
        f->fl &= (uint16_t)~FL_SOCK_OPEN;
        e->io.sock_close(e->io.ctx, f->fd, abort);
        f->fd = -1;
    }
}

static void finish(struct tn_engine *e, struct tn_flow *f, uint8_t outcome, uint8_t why, int err)
{
    if (f->state == ST_ZOMBIE || f->state == ST_FREE)
        return;
    if (TRACING(e))
        trace_end(e, f, outcome, why);
    close_sock(e, f, outcome != TN_OUT_CLOSED);
    heap_remove(e, f);
    hash_remove(e, f);
    unhold(e, f);
    f->state = ST_ZOMBIE;
    f->fl &= (uint16_t)~FL_ACK_DUE; /* tn_flush skips it */
    f->outcome = outcome;
    f->why = why;
    f->err = err;
    e->live--;
    e->c.ended++;
    push_record(e, f, TN_REC_ENDED);
}

/* RST towards the guest (the host side failed, a timeout, a shutdown), then the end. */
static void abort_flow(struct tn_engine *e, struct tn_flow *f, uint8_t outcome, uint8_t why, int err)
{
    if (f->state == ST_CONNECTING) {
        send_seg(e, f, 0, TCP_RST | TCP_ACK, NULL, 0); /* as a refusal: seq 0, ack irs + 1 */
    } else if (f->state == ST_SYN_RCVD || f->state == ST_ESTABLISHED) {
        send_seg(e, f, f->snd_max, TCP_RST | TCP_ACK, NULL, 0);
    }
    finish(e, f, outcome, why, err);
}

/* Both directions done: LAST-ACK ends at once; if our FIN went first, TIME-WAIT keeps the tuple. */
static void maybe_done(struct tn_engine *e, struct tn_flow *f, double now)
{
    uint16_t need = FL_GUEST_FIN | FL_FIN_ACKED;
    if ((f->fl & need) != need || f->state != ST_ESTABLISHED)
        return;
    if ((f->fl & FL_WE_FIRST) && e->cfg.time_wait > 0) {
        close_sock(e, f, 0);
        unhold(e, f);
        f->state = ST_TIME_WAIT;
        f->rto_at = f->persist_at = f->wnd_at = f->rate_at = 0;
        f->tw_until = now + e->cfg.time_wait;
        rearm(e, f);
        return;
    }
    finish(e, f, TN_OUT_CLOSED, TN_WHY_NONE, 0);
}

/* ------------------------------------------------------------------ host -> guest */

static void arm_rto(struct tn_flow *f, double now)
{
    if (f->rto_at == 0)
        f->rto_at = now + f->rto;
}

static void send_fin(struct tn_engine *e, struct tn_flow *f, double now)
{
    if (!(f->fl & FL_GUEST_FIN))
        f->fl |= FL_WE_FIRST;
    if (!(f->fl & FL_FIN_SENT) && f->progress_at == 0)
        f->progress_at = now;
    f->fl |= FL_FIN_SENT;
    f->fin_seq = f->snd_nxt;
    send_seg(e, f, f->snd_nxt, TCP_FIN | TCP_ACK, NULL, 0);
    f->snd_nxt++;
    if (SEQ_GT(f->snd_nxt, f->snd_max))
        f->snd_max = f->snd_nxt;
    f->fl &= (uint16_t)~FL_ACK_DUE;
    arm_rto(f, now);
}

/* RX buffers of the sink for up to TN_DIRECT_FRAMES frames of *chunk payload bytes in all (each
 * TN_PEEK_MAX but the last), their pieces in e->dv (nothing else written), what each holds in
 * e->dcap: the pieces (0: none; the caller peeks into e->peek and writes its frames), *chunk cut
 * to what was reserved. Data segments carry no TCP option: the headers are 14 + 20/40 + 20. */
static unsigned reserve_frames(struct tn_engine *e, struct tn_flow *f, size_t *chunk)
{
    size_t head = 14 + (f->v6 ? 40u : 20u) + 20, got = 0;
    unsigned nv = 0;
    for (unsigned k = 0; k < TN_DIRECT_FRAMES && got < *chunk; k++) {
        size_t want = *chunk - got < TN_PEEK_MAX ? *chunk - got : TN_PEEK_MAX;
        int r = e->io.rx_reserve(e->io.ctx, head, want, e->dv + nv, (int)(TN_DIRECT_IOV - nv));
        if (r <= 0)
            break;
        nv += (unsigned)r;
        e->dcap[k] = want;
        got += want;
    }
    if (!nv) {
        e->io.rx_release(e->io.ctx);
        return 0;
    }
    *chunk = got;
    return nv;
}

/* Peek new host bytes into frames as the guest's window allows; our FIN at the end of stream. */
static void from_sock(struct tn_engine *e, struct tn_flow *f, double now)
{
    if (f->state != ST_ESTABLISHED || !(f->fl & FL_SOCK_OPEN) || (f->fl & FL_FIN_SENT))
        return;
    for (;;) {
        uint32_t inflight = f->snd_nxt - f->snd_una;
        uint32_t edge = f->snd_wl2 + f->snd_wnd; /* the window is relative to the ACK that carried it */
        uint32_t room = SEQ_GT(edge, f->snd_nxt) ? edge - f->snd_nxt : 0;
        if (inflight + room > TN_DISCARD)
            room = inflight < TN_DISCARD ? TN_DISCARD - inflight : 0;
        if (!(f->fl & (FL_RX_READY | FL_RDHUP)))
            return;
        if (room == 0) {
            if (f->snd_wnd == 0 && inflight == 0 && f->persist_at == 0) {
                f->persist_at = now + f->rto;
                rearm(e, f);
            }
            return;
        }
        if (e->allow_down <= 0) { /* the down allowance is spent: held until tn_allow raises it */
            hold(e, f, HOLD_DOWN);
            return;
        }
        size_t chunk = room;
        int direct = e->cfg.offload && e->io.rx_reserve; /* into the guest's buffers, if the sink has them */
        size_t most = direct ? TN_DIRECT_FRAMES * TN_PEEK_MAX
                             : e->cfg.offload ? TN_PEEK_MAX : (TN_PEEK_MAX / f->mss) * f->mss;
        if (chunk > most)
            chunk = most;
        if ((uint64_t)e->allow_down < chunk) /* at most what is left of the allowance, a segment at least */
            chunk = (uint64_t)e->allow_down > f->mss ? (size_t)e->allow_down : f->mss;
        if (e->down.rate) { /* the down cap: read only while the bucket is above zero, at most what it holds */
            int64_t tok = bucket_refill(&e->down, now);
            if (tok <= 0) {
                rate_hold(e, f, FL_RATE_DOWN, bucket_wait(&e->down, TN_RATE_BATCH));
                return;
            }
            uint64_t may = (uint64_t)(tok / NB);
            if (may < f->mss)
                may = f->mss; /* (one segment over at most) */
            if (chunk > may)
                chunk = (size_t)may;
        }
        unsigned npv = direct ? reserve_frames(e, f, &chunk) : 0; /* pieces of guest memory reserved */
        ssize_t n;
        if (npv) {
            n = e->io.sock_peekv(e->io.ctx, f->fd, e->dv, (int)npv, inflight);
            if (n <= 0) /* nothing there to commit (EFAULT: guest memory that could not be written) */
                e->io.rx_release(e->io.ctx);
            if (n == -EFAULT) /* into the engine's buffer instead: the frame is copied (capped below) */
                npv = 0;
        }
        if (!npv) {
            if (chunk > TN_PEEK_MAX)
                chunk = TN_PEEK_MAX;
            n = e->io.sock_peek(e->io.ctx, f->fd, e->peek, chunk, inflight);
        }
        if (n == -EAGAIN || n == -EWOULDBLOCK || n == -EINTR) {
            f->fl &= (uint16_t)~FL_RX_READY;
            return;
        }
        if (n < 0) {
            abort_flow(e, f, TN_OUT_RESET, TN_WHY_HOST_LOST, (int)-n);
            return;
        }
        if (n == 0) { /* end of stream past what was sent */
            if (TRACING(e) && !(f->fl & FL_HOST_EOF)) /* (once: a rewind reads it again) */
                trace_event(e, f, TN_FE_FIN_HOST, 0);
            f->fl |= FL_HOST_EOF;
            f->fl &= (uint16_t)~(FL_RX_READY | FL_RDHUP);
            send_fin(e, f, now);
            rearm(e, f);
            return;
        }
        if ((size_t)n > chunk) /* a seam that returns more than asked: never trusted */
            n = (ssize_t)chunk;
        if (TRACING(e) && SEQ_GT(f->snd_nxt + (uint32_t)n, f->snd_max)) /* new bytes (before their frames) */
            trace_data(e, f, &f->tr_host, TN_FE_HOST_DATA, f->snd_nxt + (uint32_t)n - f->snd_max);
        size_t off = 0;
        for (unsigned k = 0; off < (size_t)n; k++) {
            size_t seg = (size_t)n - off;
            if (!e->cfg.offload && seg > f->mss)
                seg = f->mss;
            if (npv && seg > e->dcap[k]) /* in place: the frames as reserved (all full but the last) */
                seg = e->dcap[k];
            uint8_t fl = TCP_ACK;
            if (off + seg == (size_t)n)
                fl |= TCP_PSH;
            seg_out(e, f, f->snd_nxt, fl, npv ? NULL : e->peek + off, seg, npv != 0);
            f->snd_nxt += (uint32_t)seg;
            off += seg;
        }
        if (npv)
            e->io.rx_release(e->io.ctx); /* the frames the peek did not reach go back unseen */
        f->fl &= (uint16_t)~FL_ACK_DUE;
        if (SEQ_GT(f->snd_nxt, f->snd_max)) {
            uint32_t fresh = f->snd_nxt - f->snd_max; /* retransmissions are not spent again */
            f->bytes_down += fresh;
            e->c.bytes_down += fresh;
            allow_spend(&e->allow_down, fresh);
            f->snd_max = f->snd_nxt;
            if (e->down.rate)
                bucket_spend(&e->down, fresh);
        }
        f->persist_at = 0;
        arm_rto(f, now);
        rearm(e, f);
        if ((size_t)n < chunk && !(f->fl & FL_RDHUP)) {
            f->fl &= (uint16_t)~FL_RX_READY; /* drained; the next arrival is a new edge */
            return;
        }
    }
}

/* Go back to snd_una: what is unacknowledged goes again (RTO, fast retransmit). */
static void rewind_send(struct tn_engine *e, struct tn_flow *f, double now)
{
    if (f->state == ST_SYN_RCVD) {
        send_seg(e, f, f->iss, TCP_SYN | TCP_ACK, NULL, 0);
        return;
    }
    uint32_t data_end = (f->fl & FL_FIN_SENT) ? f->fin_seq : f->snd_nxt;
    f->snd_nxt = f->snd_una;
    if (f->fl & FL_FIN_SENT) {
        if (data_end == f->snd_una) { /* only the FIN is outstanding */
            send_seg(e, f, f->fin_seq, TCP_FIN | TCP_ACK, NULL, 0);
            f->snd_nxt = f->fin_seq + 1;
            return;
        }
        f->fl &= (uint16_t)~FL_FIN_SENT; /* the FIN follows the data again */
        f->fl |= FL_RDHUP;
    }
    if (f->fl & FL_SOCK_OPEN)
        e->io.sock_rewind(e->io.ctx, f->fd, 0);
    f->fl |= FL_RX_READY;
    from_sock(e, f, now);
}

/* ------------------------------------------------------------------ adoption */

static struct tn_flow *alloc_flow(struct tn_engine *e)
{
    if (!e->free_head)
        return NULL;
    uint32_t i = e->free_head - 1;
    e->free_head = e->free_next[i];
    struct tn_flow *f = &e->flows[i];
    uint32_t gen = f->gen + 1;
    memset(f, 0, sizeof *f);
    f->gen = gen ? gen : 1;
    f->fd = -1;
    f->hpos = -1;
    return f;
}

static void connected(struct tn_engine *e, struct tn_flow *f, double now, int at_once)
{
    f->state = ST_SYN_RCVD;
    f->connect_until = 0;
    f->rto = SYN_ACK_RTO;
    if (TRACING(e)) { /* (before the frame's write: its TN_FE_SYN_ACK_SENT follows) */
        struct tn_trace_rec *r = trace_rec(e, TN_TR_SYN_ACK, f, tn_clock_ns());
        if (r) {
            double us = (now - f->started) * 1e6;
            r->a = us <= 0 ? 0 : clamp32((uint64_t)(us + 0.5)); /* rounded: a difference of two float times */
            r->b = (uint32_t)at_once;
        }
    }
    send_seg(e, f, f->iss, TCP_SYN | TCP_ACK, NULL, 0);
    f->rto_at = now + f->rto;
    rearm(e, f);
}

static void connect_failed(struct tn_engine *e, struct tn_flow *f, int err)
{
    if (TRACING(e))
        trace_event(e, f, err == ECONNREFUSED ? TN_FE_CONNECT_REFUSED : TN_FE_CONNECT_UNREACHABLE, 0);
    if (err == ECONNREFUSED) {
        send_seg(e, f, 0, TCP_RST | TCP_ACK, NULL, 0); /* seq 0, ack irs + 1: RFC 9293 3.10.7.1 */
        finish(e, f, TN_OUT_REFUSED, TN_WHY_CONNECT, err);
    } else {
        finish(e, f, err == ETIMEDOUT ? TN_OUT_TIMEOUT : TN_OUT_UNREACHABLE, TN_WHY_CONNECT, err);
    }
}

static int adopt_in(struct tn_engine *e, const struct tn_adopt *a, double now, uint32_t *slot, uint32_t *gen);

int tn_adopt(struct tn_engine *e, const struct tn_adopt *a, double now, uint32_t *slot, uint32_t *gen)
{
    tn_gather_flush(e);
    int r = adopt_in(e, a, now, slot, gen);
    if (TRACING(e)) /* a SYN-ACK (or RST) written at once leaves now: its drain */
        trace_drain(e);
    return r;
}

static int adopt_in(struct tn_engine *e, const struct tn_adopt *a, double now, uint32_t *slot, uint32_t *gen)
{
    e->now = now;
    if (lookup(e, a->v6 ? 1 : 0, a->guest_ip, a->guest_port, a->dst_ip, a->dst_port))
        return -EEXIST;
    struct tn_flow *f = alloc_flow(e);
    if (!f)
        return -ENOSPC;
    f->v6 = a->v6 ? 1 : 0;
    size_t alen = f->v6 ? 16 : 4;
    memcpy(f->gip, a->guest_ip, alen);
    memcpy(f->dip, a->dst_ip, alen);
    f->gport = a->guest_port;
    f->dport = a->dst_port;
    memcpy(f->eth, a->guest_mac, 6);
    memcpy(f->eth + 6, e->cfg.gw_mac, 6);
    wr16(f->eth + 12, f->v6 ? 0x86DDu : 0x0800u);
    f->irs = a->irs;
    f->rcv_nxt = f->rcv_adv = f->up_mark = a->irs + 1;
    f->iss = a->iss;
    f->snd_una = f->snd_nxt = f->snd_max = a->iss + 1;
    f->snd_una = a->iss; /* the SYN-ACK is unacknowledged */
    uint32_t ours = e->cfg.mtu - (f->v6 ? 60u : 40u);
    uint32_t theirs = a->mss > 0 ? (uint32_t)a->mss : (f->v6 ? 1220u : 536u);
    if (theirs < 64)
        theirs = 64;
    f->mss = (uint16_t)(theirs < ours ? theirs : ours);
    if (a->wscale >= 0) {
        f->fl |= FL_WS;
        f->snd_ws = (uint8_t)(a->wscale > 14 ? 14 : a->wscale);
        uint8_t ws = 0;
        while (ws < OUR_WS_MAX && (e->rcv_wnd >> ws) > 65535)
            ws++;
        f->rcv_ws = ws;
    }
    f->snd_wnd = a->wnd; /* a SYN's window is never scaled */
    f->snd_wl1 = a->irs;
    f->snd_wl2 = a->iss + 1;
    f->last_wnd_field = a->wnd;
    f->last_active = f->started = now;
    f->rto = RTO_MIN;
    f->state = ST_CONNECTING;
    hash_insert(e, f);
    e->live++;
    e->c.adopted++;
    *slot = (uint32_t)(f - e->flows);
    *gen = f->gen;
    int fd = e->io.sock_open(e->io.ctx, f->v6);
    if (fd < 0) {
        abort_flow(e, f, TN_OUT_REFUSED, TN_WHY_CONNECT, -fd); /* as Python: no socket, a RST */
        return fd;
    }
    f->fd = fd;
    f->fl |= FL_SOCK_OPEN | FL_SPACE_STALE;
    /* watched once the connect says how it goes: writability only while it is in progress (no
     * wake-up for the writable edge of a connect done at once, as towards loopback) */
    int r = e->io.sock_connect(e->io.ctx, fd, f->v6, a->host_ip, a->host_port);
    if (r != 0 && r != -EINPROGRESS) {
        connect_failed(e, f, -r);
        return r;
    }
    int w = e->io.sock_watch(e->io.ctx, fd, tag_of(e, f), r == -EINPROGRESS);
    if (w < 0) {
        abort_flow(e, f, TN_OUT_REFUSED, TN_WHY_CONNECT, -w);
        return w;
    }
    if (r == 0) {
        connected(e, f, now, 1);
        return 0;
    }
    f->fl |= FL_WATCH_OUT;
    f->connect_until = now + e->cfg.connect_timeout;
    rearm(e, f);
    return 1;
}

/* ------------------------------------------------------------------ guest -> host */

static int ack_of_fin(const struct tn_flow *f, uint32_t ack)
{
    return (f->fl & FL_FIN_SENT) && ack == f->fin_seq + 1;
}

/* An ACK from the guest in ESTABLISHED: consume what it acknowledges, window, duplicates. */
static void take_ack(struct tn_engine *e, struct tn_flow *f, uint32_t seq, uint32_t ack, uint32_t wfield,
                     int has_data, double now)
{
    uint32_t wnd = (f->fl & FL_WS) ? (wfield << f->snd_ws) : wfield;
    if (SEQ_GT(ack, f->snd_max)) { /* acknowledges what was never sent */
        e->c.bad_ack++;
        ack_later(e, f);
        return;
    }
    if (SEQ_GT(ack, f->snd_una)) {
        uint32_t data_to = ack_of_fin(f, ack) ? f->fin_seq : ack;
        uint32_t n = data_to - f->snd_una;
        if (SEQ_GT(data_to, f->snd_una) && n && (f->fl & FL_SOCK_OPEN)) {
            ssize_t r = e->io.sock_consume(e->io.ctx, f->fd, n);
            if (r < 0 && r != -EAGAIN) {
                abort_flow(e, f, TN_OUT_RESET, TN_WHY_HOST_LOST, (int)-r);
                return;
            }
        }
        if (ack_of_fin(f, ack))
            f->fl |= FL_FIN_ACKED;
        f->snd_una = ack;
        f->progress_at = now;
        if (SEQ_LT(f->snd_nxt, f->snd_una)) /* acked past a rewind: resume from there */
            f->snd_nxt = f->snd_una;
        f->dupacks = 0;
        f->retries = 0;
        f->rto = RTO_MIN;
        f->rto_at = f->snd_una == f->snd_nxt ? 0 : now + f->rto;
    } else if (ack == f->snd_una && !has_data && wfield == f->last_wnd_field && f->snd_nxt != f->snd_una) {
        e->c.dup_acks++;
        if (++f->dupacks == DUPACK_THRESHOLD) {
            e->c.fast_retransmits++;
            rewind_send(e, f, now);
        }
    }
    f->last_wnd_field = wfield;
    /* the window, from a segment no older than the one that set it last (RFC 9293 3.10.7.4) */
    if (SEQ_GE(ack, f->snd_una) &&
        (SEQ_LT(f->snd_wl1, seq) || (f->snd_wl1 == seq && SEQ_LE(f->snd_wl2, ack)))) {
        /* A window that opens needs no new look at the socket: from_sock() clears FL_RX_READY only
         * when a peek found it drained, never when the window held bytes back (a peek for every
         * ACK that moves the edge would mostly find nothing: EAGAIN, a system call per ACK). */
        f->snd_wnd = wnd;
        f->snd_wl1 = seq;
        f->snd_wl2 = ack;
        if (wnd)
            f->persist_at = 0;
    }
    rearm(e, f);
}

/* plen in-order guest bytes (n buffers) to the host socket: what it took is ours (rcv_nxt moves,
 * acknowledged at the flush); what it did not take the guest sends again once our window opens.
 * The bytes taken, or -1 when the flow was aborted (the socket failed). */
static ssize_t up_send(struct tn_engine *e, struct tn_flow *f, const struct iovec *iov, int n, size_t plen)
{
    size_t took = 0;
    if (plen && (f->fl & FL_SOCK_OPEN)) {
        ssize_t r = n == 1 ? e->io.sock_send(e->io.ctx, f->fd, iov[0].iov_base, iov[0].iov_len)
                           : e->io.sock_sendv(e->io.ctx, f->fd, iov, n);
        if (r < 0 && r != -EAGAIN && r != -EWOULDBLOCK && r != -ENOBUFS) {
            abort_flow(e, f, TN_OUT_RESET, TN_WHY_HOST_LOST, (int)-r);
            return -1;
        }
        took = r > 0 ? (size_t)r : 0;
        if (took > plen)
            took = plen;
    }
    if (n > 1)
        e->c.gathered += (uint64_t)n;
    if (took < plen) {
        e->c.host_write_paused++;
        f->fl |= FL_TX_BLOCKED;
        if (!(f->fl & FL_WATCH_OUT)) { /* EPOLLOUT from now on: it says when the window opens */
            f->fl |= FL_WATCH_OUT;
            e->io.sock_want_out(e->io.ctx, f->fd, tag_of(e, f));
        }
    }
    f->rcv_nxt += (uint32_t)took;
    f->bytes_up += took;
    if (took && TRACING(e))
        trace_data(e, f, &f->tr_guest, TN_FE_GUEST_DATA, took);
    e->c.bytes_up += took;
    charge_up(e, f, f->rcv_nxt);
    if (e->up.rate && took) /* within the window we gave: taken, whatever the balance */
        bucket_spend(&e->up, took);
    f->space = f->space > took ? f->space - (uint32_t)took : 0;
    if (took)
        f->fl |= FL_SPACE_STALE; /* the send buffer grows with use (autotuning): ask again */
    ack_data(e, f);
    return (ssize_t)took;
}

void tn_gather_max(struct tn_engine *e, size_t n)
{
    e->g_max = n;
}

void tn_gather_flush(struct tn_engine *e)
{
    if (!e->g_slot)
        return;
    struct tn_flow *f = &e->flows[e->g_slot - 1];
    int n = (int)e->g_n;
    size_t len = e->g_len;
    e->g_slot = 0;
    e->g_n = 0;
    e->g_len = 0;
    /* the flow may have ended, or its socket failed, since (from_sock after the last frame): the
     * bytes were not acknowledged, so nothing is lost but what the guest sends again */
    if (f->gen != e->g_gen || f->state != ST_ESTABLISHED || (f->fl & (FL_TX_BLOCKED | FL_GUEST_FIN)))
        return;
    up_send(e, f, e->g_iov, n, len);
}

/* iov[0..n) (len bytes in all) from byte off, at most take bytes, into out[0..max): the pieces
 * (empty ones left out), or -1 when they need more than max. */
static int iov_slice(const struct iovec *iov, int n, size_t off, size_t take, struct iovec *out, int max)
{
    int k = 0;
    for (int i = 0; i < n && take; i++) {
        size_t l = iov[i].iov_len;
        if (off >= l) {
            off -= l;
            continue;
        }
        size_t c = l - off < take ? l - off : take;
        if (k == max)
            return -1;
        out[k].iov_base = (uint8_t *)iov[i].iov_base + off;
        out[k].iov_len = c;
        k++;
        take -= c;
        off = 0;
    }
    return k;
}

/* The payload (pn pieces, plen bytes) of a guest segment at seq: in order, to the host socket
 * (gathered with the segments after it when the caller keeps their memory: tn_frame_kept,
 * tn_frame_zc); FIN after it. */
static void take_payload(struct tn_engine *e, struct tn_flow *f, uint32_t seq, const struct iovec *piov, int pn,
                         size_t plen, int fin)
{
    if (e->g_slot) { /* the gather's flow (frame_in sent any other's): this payload next in it? */
        uint32_t wnd = SEQ_GT(f->rcv_adv, f->rcv_nxt) ? f->rcv_adv - f->rcv_nxt : 0;
        if (e->gather_ok && plen && !fin && seq == f->rcv_nxt + (uint32_t)e->g_len &&
            e->g_n + (uint32_t)pn <= TN_GATHER_MAX && e->g_len + plen <= wnd &&
            (!e->g_max || e->g_len + plen <= e->g_max)) {
            memcpy(&e->g_iov[e->g_n], piov, (size_t)pn * sizeof *piov);
            e->g_n += (uint32_t)pn;
            e->g_len += plen;
            return;
        }
        tn_gather_flush(e);
        if (f->state != ST_ESTABLISHED)
            return;
    }
    if (f->fl & FL_GUEST_FIN) { /* after its FIN: a retransmission at most */
        if (plen || fin)
            ack_later(e, f);
        return;
    }
    if (plen) {
        size_t skip = 0, whole = plen;
        uint32_t off = f->rcv_nxt - seq;
        if (SEQ_LT(seq, f->rcv_nxt) && off < plen) { /* the start was taken before: the rest is new */
            skip = off;
            plen -= off;
            seq = f->rcv_nxt;
        }
        uint32_t wnd = SEQ_GT(f->rcv_adv, f->rcv_nxt) ? f->rcv_adv - f->rcv_nxt : 0; /* as advertised */
        if (seq != f->rcv_nxt) { /* old, or out of order: dropped (no reassembly) */
            e->c.out_of_window++;
            ack_later(e, f);
            return;
        }
        if (plen > wnd) {
            e->c.out_of_window++;
            plen = wnd;
            fin = 0;
        }
        struct iovec cut[TN_GATHER_MAX];
        if (skip || plen < whole) { /* (fewer pieces than before, or as many: never -1) */
            pn = iov_slice(piov, pn, skip, plen, cut, TN_GATHER_MAX);
            piov = cut;
        }
        if (e->gather_ok && plen && !fin && e->io.sock_sendv && (f->fl & FL_SOCK_OPEN) &&
            !(f->fl & FL_TX_BLOCKED)) { /* the first of a gather: sent with the frames after it */
            e->g_slot = (uint32_t)(f - e->flows) + 1;
            e->g_gen = f->gen;
            memcpy(e->g_iov, piov, (size_t)pn * sizeof *piov);
            e->g_n = (uint32_t)pn;
            e->g_len = plen;
            return;
        }
        ssize_t took = up_send(e, f, piov, pn, plen); /* (plen 0, a closed window: acknowledged) */
        if (took < 0)
            return;
        if ((size_t)took < plen)
            fin = 0;
    }
    if (!plen && !fin && SEQ_LT(seq, f->rcv_nxt))
        ack_later(e, f); /* a window probe (or keep-alive) below rcv_nxt: answered */
    if (fin && seq + (uint32_t)plen == f->rcv_nxt) {
        f->rcv_nxt++;
        f->fl |= FL_GUEST_FIN;
        if (TRACING(e))
            trace_event(e, f, TN_FE_FIN_GUEST, 0);
        if (f->fl & FL_SOCK_OPEN)
            e->io.sock_shutdown_wr(e->io.ctx, f->fd);
        ack_data(e, f);
    }
}

/* Is a RST at seq acceptable (RFC 5961 3.2): exactly rcv_nxt. In the window: a challenge ACK. */
static int rst_ok(struct tn_engine *e, struct tn_flow *f, uint32_t seq)
{
    if (seq == f->rcv_nxt)
        return 1;
    e->c.rst_bad_seq++;
    uint32_t w = SEQ_GT(f->rcv_adv, f->rcv_nxt) ? f->rcv_adv - f->rcv_nxt : 0;
    if (SEQ_GT(seq, f->rcv_nxt) && SEQ_LT(seq, f->rcv_nxt + (w ? w : 1)) && f->state != ST_TIME_WAIT)
        ack_later(e, f);
    return 0;
}

static int frame_in(struct tn_engine *e, const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok,
                    double now);

int tn_frame_kept(struct tn_engine *e, const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok,
                  double now)
{
    e->gather_ok = e->io.sock_sendv != NULL;
    int took = tn_frame(e, buf, len, rec, csum_ok, now);
    e->gather_ok = 0;
    return took;
}

int tn_frame_zc(struct tn_engine *e, const uint8_t *head, size_t head_len, const struct iovec *iov, int n,
                size_t len, const struct dp_frame *rec, int csum_ok, double now)
{
    /* the checksum would be read from head (the payload is not there); headers past head: the
     * record was made from bytes head does not hold */
    if (!csum_ok || !e->io.sock_sendv || rec->payload_off > head_len || rec->end > len)
        return -1;
    int pn = iov_slice(iov, n, rec->payload_off, rec->payload_len, e->zc_iov, TN_GATHER_MAX);
    if (pn < 0)
        return -1;
    e->zc_n = pn;
    e->zc = 1;
    e->gather_ok = 1;
    int took = tn_frame(e, head, len, rec, csum_ok, now);
    e->gather_ok = 0;
    e->zc = 0;
    return took;
}

int tn_frame(struct tn_engine *e, const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok, double now)
{
    if (!TRACING(e))
        return frame_in(e, buf, len, rec, csum_ok, now);
    /* TN_TR_FRAME: the flow as found before the frame (it may end while processing it) */
    const struct tn_flow *f = NULL;
    if (rec->kind == DP_KIND_TCP && e->live)
        f = lookup(e, (rec->flags & DP_F_IPV6) ? 1 : 0, rec->src, rec->sport, rec->dst, rec->dport);
    uint64_t t0 = tn_clock_ns();
    uint64_t out0 = e->c.frames_out;
    uint32_t gen = f ? f->gen : 0;
    int took = frame_in(e, buf, len, rec, csum_ok, now);
    if (took && f) {
        uint64_t t1 = tn_clock_ns();
        struct tn_trace_rec *r = trace_rec(e, TN_TR_FRAME, f, t1);
        if (r) {
            r->gen = gen;
            r->tcp_flags = rec->tcp_flags;
            r->a = clamp32(len);
            r->b = clamp32(e->c.frames_out - out0);
            r->dur_ns = clamp32(t1 - t0);
        }
    }
    return took;
}

static int frame_in(struct tn_engine *e, const uint8_t *buf, size_t len, const struct dp_frame *rec, int csum_ok,
                    double now)
{
    e->now = now;
    if (rec->kind != DP_KIND_TCP || e->live == 0)
        return 0;
    int v6 = (rec->flags & DP_F_IPV6) ? 1 : 0;
    struct tn_flow *f = lookup(e, v6, rec->src, rec->sport, rec->dst, rec->dport);
    if (e->g_slot && (!f || e->g_slot - 1 != (uint32_t)(f - e->flows) || !e->gather_ok || !rec->payload_len ||
                      (rec->tcp_flags & (TCP_SYN | TCP_RST | TCP_FIN))))
        tn_gather_flush(e); /* sent before anything else happens to a flow */
    if (!f)
        return 0;
    if (f->state == ST_ZOMBIE) /* that send ended it (its socket failed: RST sent): nothing more of it */
        return 1;
    /* the record's offsets were checked against len by dp_classify(); checked again here, cheaply */
    if (rec->end > len || rec->l4_off + 20 > rec->end || rec->payload_off > rec->end ||
        rec->payload_off + rec->payload_len > rec->end)
        return 0;
    const uint8_t *t = buf + rec->l4_off;
    uint8_t flags = rec->tcp_flags;
    if (flags & TCP_SYN && !(flags & TCP_ACK) && f->state == ST_TIME_WAIT) {
        finish(e, f, TN_OUT_CLOSED, TN_WHY_NONE, 0); /* a new incarnation: Python opens it */
        return 0;
    }
    e->c.frames++;
    if (!csum_ok) {
        uint32_t tcp_len = rec->end - rec->l4_off;
        uint32_t s = sum16(t, tcp_len, pseudo_sum(v6, rec->src, rec->dst, tcp_len));
        if (fold(s) != 0xFFFFu) {
            e->c.bad_checksum++;
            return 1;
        }
    }
    uint32_t seq = rd32(t + 4), ack = rd32(t + 8);
    uint32_t wfield = rd16(t + 14);
    size_t plen = rec->payload_len;
    struct iovec one = {(void *)(buf + rec->payload_off), plen};
    const struct iovec *piov = e->zc ? e->zc_iov : &one; /* tn_frame_zc: in the caller's pieces */
    int pn = e->zc ? e->zc_n : (plen ? 1 : 0);
    if (flags & TCP_RST) {
        if (f->state == ST_CONNECTING || f->state == ST_SYN_RCVD) {
            if (seq == f->rcv_nxt)
                finish(e, f, TN_OUT_RESET, TN_WHY_GUEST_RST, 0);
            else
                e->c.rst_bad_seq++;
        } else if (rst_ok(e, f, seq)) {
            finish(e, f, TN_OUT_RESET, TN_WHY_GUEST_RST, 0);
        }
        return 1;
    }
    f->last_active = now;
    if (flags & TCP_SYN) {
        if (!(flags & TCP_ACK) && seq == f->irs) { /* the guest's SYN again */
            if (f->state == ST_SYN_RCVD)
                send_seg(e, f, f->iss, TCP_SYN | TCP_ACK, NULL, 0);
            return 1;
        }
        e->c.syn_on_open++; /* RFC 5961 4.2: a challenge ACK, nothing else */
        if (f->state == ST_ESTABLISHED || f->state == ST_TIME_WAIT)
            ack_later(e, f);
        return 1;
    }
    if (!(flags & TCP_ACK)) {
        e->c.bad_ack++;
        return 1;
    }
    switch (f->state) {
    case ST_CONNECTING:
        e->c.bad_ack++; /* nothing was sent to it yet */
        return 1;
    case ST_TIME_WAIT:
        f->tw_until = now + e->cfg.time_wait; /* time_wait after the guest's last segment */
        rearm(e, f);
        if (flags & TCP_FIN)
            ack_later(e, f); /* its FIN again: our ACK was lost */
        return 1;
    case ST_SYN_RCVD:
        if (ack != f->iss + 1) {
            e->c.bad_ack++;
            return 1;
        }
        f->state = ST_ESTABLISHED;
        if (TRACING(e))
            trace_event(e, f, TN_FE_ESTABLISHED, 0);
        f->snd_una = f->snd_nxt = f->iss + 1;
        f->rto_at = 0;
        f->rto = RTO_MIN;
        f->retries = 0;
        break;
    default:
        break;
    }
    take_ack(e, f, seq, ack, wfield, plen > 0, now);
    if (f->state != ST_ESTABLISHED)
        return 1;
    take_payload(e, f, seq, piov, pn, plen, flags & TCP_FIN);
    if (f->state != ST_ESTABLISHED)
        return 1;
    from_sock(e, f, now);
    if (f->state == ST_ESTABLISHED)
        maybe_done(e, f, now);
    if (f->state == ST_ESTABLISHED || f->state == ST_SYN_RCVD)
        rearm(e, f);
    return 1;
}

void tn_flush(struct tn_engine *e, double now)
{
    e->now = now;
    tn_gather_flush(e);
    while (e->ack_head) {
        struct tn_flow *f = &e->flows[e->ack_head - 1];
        e->ack_head = f->ack_next;
        f->ack_next = 0;
        if (f->fl & FL_ACK_DUE)
            send_ack(e, f);
    }
    if (TRACING(e))
        trace_drain(e);
}

/* ------------------------------------------------------------------ socket events and timers */

void tn_sock_event(struct tn_engine *e, uint64_t tag, uint32_t events, double now)
{
    e->now = now;
    tn_gather_flush(e);
    uint32_t slot = (uint32_t)tag, gen = (uint32_t)(tag >> 32);
    if (slot >= e->cap)
        return;
    struct tn_flow *f = &e->flows[slot];
    if (f->gen != gen || !(f->fl & FL_SOCK_OPEN))
        return;
    if (f->state == ST_CONNECTING) {
        if (events & TN_EV_IN) /* the host spoke first: its bytes go once the guest's handshake completes */
            f->fl |= FL_RX_READY;
        if (!(events & (TN_EV_OUT | TN_EV_ERR | TN_EV_HUP)))
            return;
        int r = e->io.sock_error(e->io.ctx, f->fd);
        if (r == 0 && !(events & TN_EV_ERR)) {
            connected(e, f, now, 0);
            push_record(e, f, TN_REC_CONNECTED);
        } else {
            connect_failed(e, f, r ? -r : ECONNREFUSED);
        }
        return;
    }
    if (events & TN_EV_ERR) {
        int r = e->io.sock_error(e->io.ctx, f->fd);
        abort_flow(e, f, TN_OUT_RESET, TN_WHY_HOST_LOST, r ? -r : EPIPE);
        return;
    }
    if ((events & TN_EV_OUT) && (f->fl & FL_TX_BLOCKED)) {
        f->fl &= (uint16_t)~FL_TX_BLOCKED;
        f->space = 0; /* asked again */
        f->fl |= FL_SPACE_STALE;
        e->c.window_updates++;
        if (f->state == ST_ESTABLISHED)
            send_ack(e, f); /* the window opens again */
    }
    if (events & TN_EV_IN)
        f->fl |= FL_RX_READY;
    if (events & (TN_EV_RDHUP | TN_EV_HUP))
        f->fl |= FL_RDHUP;
    from_sock(e, f, now);
    if (f->state == ST_ESTABLISHED)
        maybe_done(e, f, now);
}

static void flow_timer(struct tn_engine *e, struct tn_flow *f, double now)
{
    switch (f->state) {
    case ST_CONNECTING:
        if (f->connect_until > 0 && now >= f->connect_until)
            connect_failed(e, f, ETIMEDOUT);
        return;
    case ST_TIME_WAIT:
        if (now >= f->tw_until)
            finish(e, f, TN_OUT_CLOSED, TN_WHY_NONE, 0);
        return;
    case ST_SYN_RCVD:
    case ST_ESTABLISHED:
        break;
    default:
        return;
    }
    if (e->cfg.idle_timeout > 0 && now >= f->last_active + e->cfg.idle_timeout) {
        abort_flow(e, f, TN_OUT_TIMEOUT, TN_WHY_IDLE, 0);
        return;
    }
    if (linger_applies(f) && e->cfg.linger > 0 && now >= linger_deadline(e, f)) {
        abort_flow(e, f, TN_OUT_RESET, TN_WHY_LINGER, 0); /* as the Python path: an RST after tcp_linger */
        return;
    }
    if (f->rto_at > 0 && now >= f->rto_at) {
        if (++f->retries > MAX_RETRIES) {
            abort_flow(e, f, TN_OUT_TIMEOUT, TN_WHY_RETRIES, ETIMEDOUT);
            return;
        }
        e->c.rto++;
        f->rto = f->rto * 2 > RTO_MAX ? RTO_MAX : f->rto * 2;
        f->rto_at = now + f->rto;
        f->dupacks = 0;
        rewind_send(e, f, now);
        if (f->state != ST_ESTABLISHED && f->state != ST_SYN_RCVD)
            return;
    }
    if (f->ack_at > 0 && now >= f->ack_at) { /* no frame of ours came to carry it: a bare ACK */
        e->c.acks_delayed++;
        send_ack(e, f); /* (clears ack_at) */
    }
    if (f->rate_at > 0 && now >= f->rate_at) { /* the rate caps' bucket has refilled: resume */
        uint16_t held = f->fl & (FL_RATE_UP | FL_RATE_DOWN);
        f->rate_at = 0;
        f->fl &= (uint16_t)~(FL_RATE_UP | FL_RATE_DOWN);
        if (held & FL_RATE_UP) /* (held again when others spent the refill) */
            adv_window_update(e, f);
        if (held & FL_RATE_DOWN)
            from_sock(e, f, now); /* (held again when others spent the refill) */
        if (f->state != ST_ESTABLISHED && f->state != ST_SYN_RCVD)
            return;
    }
    if (f->wnd_at > 0 && now >= f->wnd_at) {
        uint32_t before = f->space;
        f->space = 0;
        f->fl |= FL_SPACE_STALE;
        f->wnd_at = 0;
        uint32_t w = adv_window(e, f); /* re-arms wnd_at while still small */
        if (w > before && f->state == ST_ESTABLISHED) {
            e->c.window_updates++;
            send_ack(e, f);
        }
        if (f->wnd_at > 0) {
            f->wnd_every = f->wnd_every * 2 > WND_WATCH_MAX ? WND_WATCH_MAX : f->wnd_every * 2;
            f->wnd_at = now + f->wnd_every;
        }
    }
    if (f->persist_at > 0 && now >= f->persist_at) {
        if (f->snd_wnd == 0) { /* probe the closed window: an ACK it must answer */
            e->c.zero_window_probes++;
            send_seg(e, f, f->snd_nxt - 1, TCP_ACK, NULL, 0);
            f->rto = f->rto * 2 > RTO_MAX ? RTO_MAX : f->rto * 2;
            f->persist_at = now + f->rto;
        } else {
            f->persist_at = 0;
        }
    }
    rearm(e, f);
}

void tn_timers(struct tn_engine *e, double now)
{
    e->now = now;
    tn_gather_flush(e);
    if (e->resume_due)
        resume_held(e, now);
    while (e->hlen) {
        struct tn_flow *f = &e->flows[e->heap[0]];
        if (f->deadline > now)
            return;
        heap_remove(e, f);
        flow_timer(e, f, now);
    }
}

int tn_records_pending(const struct tn_engine *e)
{
    return e->ring_len != 0 || e->tr_len != 0;
}

double tn_next_deadline(const struct tn_engine *e, double now, int timers_only)
{
    if ((e->ring_len && !timers_only) || e->resume_due)
        return now;
    return e->hlen ? e->flows[e->heap[0]].deadline : -1.0;
}

/* ------------------------------------------------------------------ Python's side */

int tn_close_flow(struct tn_engine *e, uint32_t slot, uint32_t gen, double now)
{
    e->now = now;
    tn_gather_flush(e);
    if (slot >= e->cap)
        return -ENOENT;
    struct tn_flow *f = &e->flows[slot];
    if (f->gen != gen || f->state == ST_FREE || f->state == ST_ZOMBIE)
        return -ENOENT;
    abort_flow(e, f, TN_OUT_SHUTDOWN, TN_WHY_NONE, 0);
    return 0;
}

int tn_flow_info(const struct tn_engine *e, uint32_t slot, uint32_t gen, struct tn_info *out)
{
    if (slot >= e->cap)
        return -ENOENT;
    const struct tn_flow *f = &e->flows[slot];
    if (f->gen != gen || f->state == ST_FREE)
        return -ENOENT;
    uint8_t s = f->state;
    if (s == ST_ESTABLISHED) {
        int gfin = (f->fl & FL_GUEST_FIN) != 0, sent = (f->fl & FL_FIN_SENT) != 0, acked = (f->fl & FL_FIN_ACKED) != 0;
        if (gfin && !sent)
            s = SN_CLOSE_WAIT;
        else if (gfin && sent)
            s = (f->fl & FL_WE_FIRST) ? SN_CLOSING : SN_LAST_ACK;
        else if (sent)
            s = acked ? SN_FIN_WAIT_2 : SN_FIN_WAIT_1;
    }
    out->state = s;
    out->last_active = f->last_active;
    out->bytes_up = f->bytes_up;
    out->bytes_down = f->bytes_down;
    out->snd_wnd = f->snd_wnd;
    out->rcv_wnd = (f->fl & FL_TX_BLOCKED) ? 0 : (f->space < e->rcv_wnd ? f->space : e->rcv_wnd);
    return 0;
}
