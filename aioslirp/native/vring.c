/* aioslirp's vhost-user-net rings: see vring.h. MIT licensed, written for aioslirp. */
#include "vring.h"

#include <stdlib.h>
#include <string.h>

static const char *const REASONS[VR_R_COUNT] = {
    "none",           "avail_jump",  "bad_head",    "bad_next",      "chain_loop",
    "desc_out_of_region", "indirect", "tx_writable", "rx_readonly",  "tx_too_large",
    "tx_truncated",   "rx_too_small", "rx_hdr_split", "broken",
};

const char *vr_reason_name(unsigned reason)
{
    return reason < VR_R_COUNT ? REASONS[reason] : NULL;
}

/* ------------------------------------------------------------------ memory */

static uint8_t *lookup(const struct vr_mem *m, uint64_t addr, uint64_t len, int by_uva)
{
    for (unsigned i = 0; i < m->n; i++) {
        const struct vr_region *r = &m->r[i];
        uint64_t start = by_uva ? r->uva : r->gpa;
        if (addr < start)
            continue;
        uint64_t off = addr - start;
        if (off >= r->size || len > r->size - off)
            continue;
        return r->host + off;
    }
    return NULL;
}

uint8_t *vr_gpa(const struct vr_mem *m, uint64_t gpa, uint64_t len)
{
    return lookup(m, gpa, len, 0);
}

uint8_t *vr_uva(const struct vr_mem *m, uint64_t uva, uint64_t len)
{
    return lookup(m, uva, len, 1);
}

/* ------------------------------------------------------------------ shared-memory access */
/* Every ring field is naturally aligned (checked in vr_queue_set_addr); each is read once. */

static inline uint16_t ld16(const volatile uint8_t *p)
{
    return *(const volatile uint16_t *)(const volatile void *)p;
}

static inline uint32_t ld32(const volatile uint8_t *p)
{
    return *(const volatile uint32_t *)(const volatile void *)p;
}

static inline uint64_t ld64(const volatile uint8_t *p)
{
    return *(const volatile uint64_t *)(const volatile void *)p;
}

static inline void st16(volatile uint8_t *p, uint16_t v)
{
    *(volatile uint16_t *)(volatile void *)p = v;
}

static inline void st32(volatile uint8_t *p, uint32_t v)
{
    *(volatile uint32_t *)(volatile void *)p = v;
}

static inline uint16_t avail_idx_acquire(const struct vr_queue *q)
{
    uint16_t v = ld16(q->avail + 2);
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* ring entries after the index */
    return v;
}

/* ------------------------------------------------------------------ queue set-up */

void vr_queue_free(struct vr_queue *q)
{
    free(q->iov);
    free(q->heads);
    free(q->lens);
    q->iov = NULL;
    q->heads = NULL;
    q->lens = NULL;
}

int vr_queue_set_num(struct vr_queue *q, unsigned num)
{
    if (num == 0 || num > VR_MAX_QUEUE || (num & (num - 1)))
        return -1; /* a split ring's size is a power of 2 (virtio 1.1 2.6): indexes wrap at 65536 */
    struct vr_iov *iov = malloc(sizeof *iov * num);
    uint16_t *heads = malloc(sizeof *heads * num);
    uint32_t *lens = malloc(sizeof *lens * num);
    if (!iov || !heads || !lens) {
        free(iov);
        free(heads);
        free(lens);
        return -1;
    }
    vr_queue_free(q);
    q->iov = iov;
    q->heads = heads;
    q->lens = lens;
    q->num = (uint16_t)(num == VR_MAX_QUEUE ? VR_MAX_QUEUE : num);
    q->desc = q->avail = q->used = NULL;
    q->desc_uva = q->avail_uva = q->used_uva = 0;
    return 0;
}

static int translate(struct vr_queue *q, const struct vr_mem *m)
{
    uint64_t n = q->num;
    uint8_t *d = vr_uva(m, q->desc_uva, 16 * n);
    uint8_t *a = vr_uva(m, q->avail_uva, 6 + 2 * n);
    uint8_t *u = vr_uva(m, q->used_uva, 6 + 8 * n);
    if (!n || !d || !a || !u || (q->desc_uva & 15) || (q->avail_uva & 1) || (q->used_uva & 3)) {
        q->desc = q->avail = q->used = NULL;
        return -1;
    }
    q->desc = d;
    q->avail = a;
    q->used = u;
    return 0;
}

int vr_queue_set_addr(struct vr_queue *q, const struct vr_mem *m, uint64_t desc, uint64_t used, uint64_t avail)
{
    q->desc_uva = desc;
    q->used_uva = used;
    q->avail_uva = avail;
    if (translate(q, m) < 0)
        return -1;
    /* Every chain below the used index was consumed, by us or by a back end before us (the
     * front end kept running: DPDK virtio_user in server mode sends SET_VRING_BASE 0 to the back
     * end that connects next). Resume there, as DPDK's vhost library and libvhost-user do: from
     * the base, the old TX chains would be sent again and the RX avail index would jump. */
    uint16_t u = ld16(q->used + 2);
    if (u == q->last_avail)
        return 0;
    q->last_avail = q->used_idx = q->signalled_used = q->seen_avail = u;
    q->signalled_valid = 0;
    return 1;
}

int vr_queue_remap(struct vr_queue *q, const struct vr_mem *m)
{
    if (!q->desc_uva && !q->used_uva && !q->avail_uva)
        return 0;
    return translate(q, m);
}

void vr_queue_set_base(struct vr_queue *q, uint16_t base)
{
    q->last_avail = q->used_idx = q->signalled_used = q->seen_avail = base;
    q->signalled_valid = 0;
    q->broken = 0;
}

int vr_queue_ready(const struct vr_queue *q)
{
    return q->desc && q->avail && q->used && q->iov;
}

/* ------------------------------------------------------------------ avail / used */

static void brk(struct vr_queue *q, enum vr_reason why, struct vr_counters *c)
{
    q->broken = (uint8_t)why;
    if (c)
        c->by_reason[why]++;
}

unsigned vr_avail_count(struct vr_queue *q)
{
    if (!vr_queue_ready(q) || q->broken)
        return 0;
    uint16_t idx = avail_idx_acquire(q);
    q->seen_avail = idx;
    uint16_t n = (uint16_t)(idx - q->last_avail);
    if (n > q->num) {
        q->broken = VR_R_AVAIL_JUMP;
        return 0;
    }
    return n;
}

/* The head of the next available chain, or -1 (the queue is broken: bad head). */
static int take_head(struct vr_queue *q, struct vr_counters *c)
{
    uint16_t head = ld16(q->avail + 4 + 2u * (q->last_avail % q->num));
    if (head >= q->num) {
        brk(q, VR_R_BAD_HEAD, c);
        return -1;
    }
    q->last_avail++;
    return head;
}

void vr_push_used(struct vr_queue *q, uint16_t head, uint32_t len)
{
    volatile uint8_t *e = q->used + 4 + 8u * (q->used_idx % q->num);
    st32(e, head);
    st32(e + 4, len);
    q->used_idx++;
}

void vr_flush(struct vr_queue *q)
{
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the entries before the index */
    st16(q->used + 2, q->used_idx);
}

int vr_should_call(struct vr_queue *q)
{
    int owed = vr_call_owed(q);
    if (q->event_idx)
        vr_call_settle(q);
    return owed;
}

int vr_call_owed(const struct vr_queue *q)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the index published before the driver's word is read */
    if (!q->event_idx)
        return !(ld16(q->avail) & VR_AVAIL_F_NO_INTERRUPT);
    if (!q->signalled_valid)
        return 1;
    uint16_t old = q->signalled_used, now = q->used_idx;
    uint16_t event = ld16(q->avail + 4 + 2u * q->num);
    return (uint16_t)(now - event - 1) < (uint16_t)(now - old);
}

void vr_call_settle(struct vr_queue *q)
{
    q->signalled_used = q->used_idx;
    q->signalled_valid = 1;
}

int vr_kick_me(struct vr_queue *q, int on)
{
    if (!vr_queue_ready(q) || q->broken)
        return 0;
    uint16_t seen = q->seen_avail;
    if (q->event_idx) {
        /* kick me when you make an entry past the last index I read: not past last_avail, which
         * RX leaves behind chains too few for a frame (the driver, past it already, would never
         * kick again) */
        if (on)
            st16(q->used + 4 + 8u * q->num, seen);
    } else {
        st16(q->used, on ? 0 : VR_USED_F_NO_NOTIFY);
    }
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* our word visible before the index is re-read */
    uint16_t idx = ld16(q->avail + 2);
    return idx != seen && vr_avail_count(q) > 0;
}

/* ------------------------------------------------------------------ TX */

enum vr_pop vr_tx_pop(struct vr_queue *q, const struct vr_mem *m, size_t hdr_len, size_t max_frame,
                      unsigned *niov, size_t *len, uint16_t *vnet, uint16_t *head, struct vr_counters *c)
{
    *niov = 0;
    *len = 0;
    if (!vr_queue_ready(q))
        return VR_EMPTY;
    if (q->broken)
        return VR_BROKEN;
    unsigned n = vr_avail_count(q);
    if (q->broken) {
        if (c)
            c->by_reason[q->broken]++;
        return VR_BROKEN;
    }
    if (!n)
        return VR_EMPTY;
    int h = take_head(q, c);
    if (h < 0)
        return VR_BROKEN;
    *head = (uint16_t)h;
    uint8_t hdr[16] = {0};
    size_t skip = hdr_len < sizeof hdr ? hdr_len : sizeof hdr, got = 0, total = 0;
    unsigned count = 0, k = 0;
    uint16_t i = (uint16_t)h;
    enum vr_reason why = VR_R_NONE;
    for (;;) {
        if (count++ >= q->num) {
            why = VR_R_CHAIN_LOOP;
            break;
        }
        const volatile uint8_t *d = q->desc + 16u * i;
        uint64_t addr = ld64(d);
        uint32_t dlen = ld32(d + 8);
        uint16_t flags = ld16(d + 12), next = ld16(d + 14);
        if (flags & VR_DESC_F_INDIRECT) {
            why = VR_R_INDIRECT;
            break;
        }
        if (flags & VR_DESC_F_WRITE) {
            why = VR_R_TX_WRITABLE;
            break;
        }
        if (dlen) {
            uint8_t *p = vr_gpa(m, addr, dlen);
            if (!p) {
                why = VR_R_DESC_OUT_OF_REGION;
                break;
            }
            size_t off = 0;
            if (got < skip) {
                off = skip - got < dlen ? skip - got : dlen;
                memcpy(hdr + got, p, off);
                got += off;
            }
            if (dlen > off) {
                if (total + (dlen - off) > max_frame) {
                    why = VR_R_TX_TOO_LARGE;
                    break;
                }
                q->iov[k].base = p + off;
                q->iov[k].len = (uint32_t)(dlen - off);
                k++;
                total += dlen - off;
            }
        }
        if (!(flags & VR_DESC_F_NEXT))
            break;
        if (next >= q->num) {
            why = VR_R_BAD_NEXT;
            break;
        }
        i = next;
    }
    if (why == VR_R_NONE && (got < skip || total == 0))
        why = VR_R_TX_TRUNCATED;
    if (why != VR_R_NONE) {
        if (c)
            c->by_reason[why]++;
        vr_push_used(q, (uint16_t)h, 0);
        return VR_DROPPED;
    }
    *niov = k;
    *len = total;
    *vnet = (uint16_t)(hdr[0] | (hdr[1] << 8));
    return VR_OK;
}

void vr_iov_copy(uint8_t *dst, const struct vr_iov *iov, unsigned niov)
{
    for (unsigned k = 0; k < niov; k++) {
        memcpy(dst, iov[k].base, iov[k].len);
        dst += iov[k].len;
    }
}

/* ------------------------------------------------------------------ RX */

enum vr_pop vr_rx_put(struct vr_queue *q, const struct vr_mem *m, int mrg, size_t hdr_len, const uint8_t *hdr,
                      const uint8_t *frame, size_t len, struct vr_counters *c)
{
    struct iovec one = {(void *)frame, len};
    return vr_rx_putv(q, m, mrg, hdr_len, hdr, &one, 1, len, c);
}

/* A read position in a frame given in pieces (the frame is copied out in order, once). */
struct iov_cur {
    const struct iovec *iov;
    unsigned n, k;
    size_t off;
};

static void cur_copy(struct iov_cur *cur, uint8_t *dst, size_t len)
{
    while (len && cur->k < cur->n) {
        const struct iovec *v = &cur->iov[cur->k];
        size_t left = v->iov_len - cur->off, take = left < len ? left : len;
        memcpy(dst, (const uint8_t *)v->iov_base + cur->off, take);
        dst += take;
        len -= take;
        cur->off += take;
        if (cur->off == v->iov_len) {
            cur->k++;
            cur->off = 0;
        }
    }
}

enum vr_pop vr_rx_putv(struct vr_queue *q, const struct vr_mem *m, int mrg, size_t hdr_len, const uint8_t *hdr,
                       const struct iovec *iov, unsigned niov, size_t len, struct vr_counters *c)
{
    struct iov_cur cur = {iov, niov, 0, 0};
    if (!vr_queue_ready(q))
        return VR_EMPTY;
    if (q->broken)
        return VR_BROKEN;
    unsigned avail = vr_avail_count(q);
    if (q->broken) {
        if (c)
            c->by_reason[q->broken]++;
        return VR_BROKEN;
    }
    const size_t need = hdr_len + len;
    const uint16_t saved = q->last_avail;
    size_t written = 0;
    unsigned chains = 0;
    uint8_t *hdr_at = NULL;
    enum vr_reason why = VR_R_NONE;
    while (written < need) {
        if (!mrg && chains == 1) { /* without MRG_RXBUF one chain must hold it */
            q->last_avail = saved;
            if (c)
                c->by_reason[VR_R_RX_TOO_SMALL]++;
            return VR_DROPPED;
        }
        if (chains == avail) {
            q->last_avail = saved; /* nothing taken */
            if (chains < q->num)
                return VR_EMPTY; /* wait for more buffers */
            if (c) /* the whole queue cannot hold it */
                c->by_reason[VR_R_RX_TOO_SMALL]++;
            return VR_DROPPED;
        }
        int h = take_head(q, c);
        if (h < 0) {
            q->last_avail = saved;
            return VR_BROKEN;
        }
        uint16_t i = (uint16_t)h;
        uint32_t in_chain = 0;
        unsigned count = 0;
        for (;;) {
            if (count++ >= q->num) {
                why = VR_R_CHAIN_LOOP;
                break;
            }
            const volatile uint8_t *d = q->desc + 16u * i;
            uint64_t addr = ld64(d);
            uint32_t dlen = ld32(d + 8);
            uint16_t flags = ld16(d + 12), next = ld16(d + 14);
            if (flags & VR_DESC_F_INDIRECT) {
                why = VR_R_INDIRECT;
                break;
            }
            if (!(flags & VR_DESC_F_WRITE)) {
                why = VR_R_RX_READONLY;
                break;
            }
            if (dlen) {
                uint8_t *p = vr_gpa(m, addr, dlen);
                if (!p) {
                    why = VR_R_DESC_OUT_OF_REGION;
                    break;
                }
                if (!hdr_at) {
                    if (dlen < hdr_len) {
                        why = VR_R_RX_HDR_SPLIT;
                        break;
                    }
                    hdr_at = p;
                }
                size_t take = need - written < dlen ? need - written : dlen, done = 0;
                if (written < hdr_len) {
                    done = hdr_len - written < take ? hdr_len - written : take;
                    memcpy(p, hdr + written, done);
                }
                if (take > done)
                    cur_copy(&cur, p + done, take - done);
                written += take;
                in_chain += (uint32_t)take;
                if (written == need)
                    break;
            }
            if (!(flags & VR_DESC_F_NEXT))
                break;
            if (next >= q->num) {
                why = VR_R_BAD_NEXT;
                break;
            }
            i = next;
        }
        q->heads[chains] = (uint16_t)h;
        q->lens[chains] = in_chain;
        chains++;
        if (why != VR_R_NONE)
            break;
    }
    if (why != VR_R_NONE) { /* every chain taken goes back empty; the frame is dropped */
        if (c)
            c->by_reason[why]++;
        for (unsigned k = 0; k < chains; k++)
            vr_push_used(q, q->heads[k], 0);
        return VR_DROPPED;
    }
    if (hdr_len >= 12) {
        uint16_t nb = (uint16_t)chains; /* num_buffers (little-endian host) */
        memcpy(hdr_at + 10, &nb, sizeof nb);
    }
    for (unsigned k = 0; k < chains; k++)
        vr_push_used(q, q->heads[k], q->lens[k]);
    return VR_OK;
}

/* ------------------------------------------------------------------ RX in place */

int vr_rx_reserve(struct vr_queue *q, struct vr_rsv *r, const struct vr_mem *m, int mrg, size_t hdr_len,
                  size_t need, size_t skip, struct iovec *iov, unsigned max_iov)
{
    if (!vr_queue_ready(q) || q->broken || need <= skip || need > UINT32_MAX)
        return 0;
    if (!r->open) {
        r->open = 1;
        r->sealed = 0;
        r->start = q->last_avail;
        r->chains = r->done = r->pieces = r->frames = r->next = 0;
    }
    if (r->sealed || r->frames >= VR_RSV_FRAMES)
        return 0;
    /* what is left past the chains taken; a jump is left to vr_rx_putv(), which breaks the queue
     * and counts it (as a bad head below) */
    uint16_t idx = avail_idx_acquire(q);
    unsigned avail = (uint16_t)(idx - q->last_avail);
    if (avail > q->num)
        return 0;
    const uint16_t saved = q->last_avail;
    const unsigned c0 = r->chains, p0 = r->pieces;
    size_t have = 0;
    int first = 1;
    while (have < need) {
        if ((!mrg && r->chains > c0) || r->chains - c0 == avail || r->chains >= q->num)
            goto undo; /* one chain must hold it; or not enough chains now; or the reservation holds
                        * num already (q->heads/lens: the guest republished entries meanwhile) */
        uint16_t h = ld16(q->avail + 4 + 2u * (q->last_avail % q->num));
        if (h >= q->num)
            goto undo;
        q->last_avail++;
        uint16_t i = h;
        uint32_t in_chain = 0;
        unsigned count = 0;
        for (;;) {
            if (count++ >= q->num)
                goto undo;
            const volatile uint8_t *d = q->desc + 16u * i;
            uint64_t addr = ld64(d);
            uint32_t dlen = ld32(d + 8);
            uint16_t flags = ld16(d + 12), next = ld16(d + 14);
            if ((flags & VR_DESC_F_INDIRECT) || !(flags & VR_DESC_F_WRITE))
                goto undo;
            if (dlen) {
                uint8_t *p = vr_gpa(m, addr, dlen);
                if (!p || (first && dlen < hdr_len) || r->pieces >= q->num)
                    goto undo;
                first = 0;
                size_t take = need - have < dlen ? need - have : dlen;
                q->iov[r->pieces].base = p;
                q->iov[r->pieces].len = (uint32_t)take;
                r->pieces++;
                have += take;
                in_chain += (uint32_t)take;
                if (have == need)
                    break;
            }
            if (!(flags & VR_DESC_F_NEXT))
                break;
            if (next >= q->num)
                goto undo;
            i = next;
        }
        q->heads[r->chains] = h;
        q->lens[r->chains] = in_chain;
        r->chains++;
    }
    /* the pieces past skip: where the caller writes */
    unsigned k = 0;
    size_t off = 0;
    for (unsigned p = p0; p < r->pieces; p++) {
        size_t len = q->iov[p].len, from = off < skip ? (skip - off < len ? skip - off : len) : 0;
        off += len;
        if (from == len)
            continue;
        if (k == max_iov)
            goto undo;
        iov[k].iov_base = q->iov[p].base + from;
        iov[k].iov_len = len - from;
        k++;
    }
    r->chain0[r->frames] = c0;
    r->piece0[r->frames] = p0;
    r->frames++;
    r->chain0[r->frames] = r->chains;
    r->piece0[r->frames] = r->pieces;
    return (int)k;
undo:
    q->last_avail = saved;
    r->chains = c0;
    r->pieces = p0;
    return 0;
}

int vr_rx_commit(struct vr_queue *q, struct vr_rsv *r, size_t hdr_len, const uint8_t *hdr, const uint8_t *head,
                 size_t head_len, size_t len)
{
    if (!r->open || r->sealed || r->next >= r->frames || len < head_len)
        return -1;
    unsigned f = r->next, c0 = r->chain0[f], c1 = r->chain0[f + 1];
    if (c0 != r->done)
        return -1;
    size_t need = hdr_len + len, cap = 0;
    for (unsigned c = c0; c < c1; c++)
        cap += q->lens[c];
    if (need > cap)
        return -1;
    unsigned used = 0;
    for (size_t left = need; used < c1 - c0 && left; used++)
        left -= q->lens[c0 + used] < left ? q->lens[c0 + used] : left;
    /* the vnet header: in the frame's first piece (vr_rx_reserve: at least hdr_len bytes) */
    unsigned p = r->piece0[f];
    uint8_t *at = q->iov[p].base;
    memcpy(at, hdr, hdr_len);
    if (hdr_len >= 12) {
        uint16_t nb = (uint16_t)used;
        memcpy(at + 10, &nb, sizeof nb);
    }
    /* the frame's headers, from there on through the pieces */
    size_t in = hdr_len, done = 0;
    while (done < head_len && p < r->piece0[f + 1]) {
        size_t room = q->iov[p].len - in, take = head_len - done < room ? head_len - done : room;
        memcpy(q->iov[p].base + in, head + done, take);
        done += take;
        in += take;
        if (in == q->iov[p].len) {
            p++;
            in = 0;
        }
    }
    size_t left = need;
    for (unsigned c = c0; c < c0 + used; c++) {
        uint32_t u = q->lens[c] < left ? q->lens[c] : (uint32_t)left;
        vr_push_used(q, q->heads[c], u);
        left -= u;
    }
    r->done = c0 + used;
    r->next++;
    if (r->done < c1)
        r->sealed = 1;
    return 0;
}

void vr_rx_release(struct vr_queue *q, struct vr_rsv *r)
{
    if (!r->open)
        return;
    q->last_avail = (uint16_t)(r->start + r->done);
    r->open = 0;
}
