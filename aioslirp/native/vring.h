/* aioslirp's vhost-user-net rings: the split virtqueues of a virtio-net device whose memory a
 * vhost-user front end (QEMU, cloud-hypervisor) shared with us (C11, no Python object in it).
 *
 * Guest memory is a table of regions (SET_MEM_TABLE: guest physical address, size, the front
 * end's virtual address, and our mapping of the region's fd). Every address a ring or a
 * descriptor holds is translated through that table and the whole [addr, addr + len) must lie
 * in one region: the guest owns the ring contents, which are hostile input. Each field of the
 * shared memory is read once into a local before it is checked and used.
 *
 * What is dropped and counted (enum vr_reason), never followed:
 *  - per chain (the chain is returned in the used ring with length 0, the queue goes on): a
 *    descriptor outside the regions or crossing a region's end, a chain longer than the queue
 *    (a loop), an INDIRECT descriptor (not offered), a device-writable descriptor on TX or a
 *    read-only one on RX, a TX frame longer than the frame bound or shorter than its vnet header;
 *  - per queue (the queue is marked broken and processes nothing until it is set up again): an
 *    avail index that moved further than the queue size, a head index past the queue size.
 *
 * Split virtqueue layout (virtio 1.1 section 2.6), little-endian (the hosts this runs on):
 *   desc[num]  { u64 addr; u32 len; u16 flags; u16 next; }
 *   avail      { u16 flags; u16 idx; u16 ring[num]; u16 used_event; }
 *   used       { u16 flags; u16 idx; { u32 id; u32 len; } ring[num]; u16 avail_event; }
 *
 * MIT licensed, written for aioslirp; the message and ring semantics follow the vhost-user
 * specification (QEMU docs/interop/vhost-user.rst) and virtio 1.1; no code is taken from them.
 */
#ifndef AIOSLIRP_VRING_H
#define AIOSLIRP_VRING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define VR_MAX_REGIONS 32u  /* more than any front end sends (QEMU: 8, or its memslots limit) */
#define VR_MAX_QUEUE 32768u /* the largest split virtqueue */

#define VR_DESC_F_NEXT 1u
#define VR_DESC_F_WRITE 2u
#define VR_DESC_F_INDIRECT 4u
#define VR_USED_F_NO_NOTIFY 1u
#define VR_AVAIL_F_NO_INTERRUPT 1u

/* One region of guest memory and our mapping of it. */
struct vr_region {
    uint64_t gpa;   /* guest physical address of its first byte */
    uint64_t size;  /* bytes */
    uint64_t uva;   /* the front end's virtual address of its first byte (ring addresses use it) */
    uint8_t *host;  /* our address of its first byte (map + mmap_offset) */
    void *map;      /* what mmap() returned, and its length, for munmap() */
    size_t map_len;
};

struct vr_mem {
    unsigned n;
    struct vr_region r[VR_MAX_REGIONS];
};

/* Our address of guest physical [gpa, gpa + len) when it lies in one region, else NULL. */
uint8_t *vr_gpa(const struct vr_mem *m, uint64_t gpa, uint64_t len);
/* Our address of the front end's virtual [uva, uva + len) when it lies in one region, else NULL. */
uint8_t *vr_uva(const struct vr_mem *m, uint64_t uva, uint64_t len);

/* Why a chain or a queue was dropped; the order is the binding's ABI (vr_reason_name()). */
enum vr_reason {
    VR_R_NONE = 0,
    VR_R_AVAIL_JUMP,        /* queue: avail idx moved by more than num since the last chain taken */
    VR_R_BAD_HEAD,          /* queue: a head index (avail ring entry) >= num */
    VR_R_BAD_NEXT,          /* chain: a next index >= num */
    VR_R_CHAIN_LOOP,        /* chain: more than num descriptors */
    VR_R_DESC_OUT_OF_REGION,/* chain: [addr, addr + len) not inside one memory region */
    VR_R_INDIRECT,          /* chain: an INDIRECT descriptor (VIRTIO_RING_F_INDIRECT_DESC not offered) */
    VR_R_TX_WRITABLE,       /* chain: a device-writable descriptor in a TX chain */
    VR_R_RX_READONLY,       /* chain: a read-only descriptor in an RX chain */
    VR_R_TX_TOO_LARGE,      /* chain: a TX frame longer than the frame bound */
    VR_R_TX_TRUNCATED,      /* chain: a TX chain no longer than the vnet header (no frame) */
    VR_R_RX_TOO_SMALL,      /* frame: no RX chain (or, MRG_RXBUF, no run of chains) can hold it */
    VR_R_RX_HDR_SPLIT,      /* chain: an RX chain whose first descriptor is shorter than the vnet header */
    VR_R_BROKEN,            /* a call on a broken queue (counted once per call) */
    VR_R_COUNT
};

const char *vr_reason_name(unsigned reason);

struct vr_counters {
    uint64_t by_reason[VR_R_COUNT];
};

/* A piece of a frame in guest memory. */
struct vr_iov {
    uint8_t *base;
    uint32_t len;
};

/* One split virtqueue. The ring pointers are NULL until vr_queue_set_addr() succeeds. */
struct vr_queue {
    uint16_t num;            /* queue size (a power of 2, 1..VR_MAX_QUEUE) */
    uint16_t last_avail;     /* next avail ring entry to take */
    uint16_t used_idx;       /* next used ring entry to fill (published by vr_flush) */
    uint16_t signalled_used; /* used_idx at the last call signalled */
    uint16_t seen_avail;     /* the avail index last read (vr_avail_count) */
    uint8_t signalled_valid;
    uint8_t event_idx;       /* VIRTIO_RING_F_EVENT_IDX negotiated */
    uint8_t broken;          /* enum vr_reason that broke it, or 0 */
    uint8_t pad;
    uint64_t desc_uva, avail_uva, used_uva; /* as set, re-translated when the memory table changes */
    volatile uint8_t *desc;
    volatile uint8_t *avail;
    volatile uint8_t *used;
    struct vr_iov *iov;      /* num entries: one chain's pieces */
    uint16_t *heads;         /* num entries: RX chains taken for one frame */
    uint32_t *lens;
};

/* Set the size (allocates iov/heads/lens; 0 on success, -1 when num is not a power of 2 in
 * 1..VR_MAX_QUEUE, whose ring positions index % num would jump when the 16-bit indexes wrap, or
 * malloc fails); forgets the ring addresses. */
int vr_queue_set_num(struct vr_queue *q, unsigned num);
void vr_queue_free(struct vr_queue *q);
/* Translate and keep the three ring addresses (front-end virtual addresses); 0, or -1 when any
 * of the three areas is not inside one region (the queue then has no rings), or 1 when the used
 * ring's index was not the base (SET_VRING_BASE) and the queue now resumes from it. */
int vr_queue_set_addr(struct vr_queue *q, const struct vr_mem *m, uint64_t desc, uint64_t used, uint64_t avail);
/* Re-translate the kept addresses after a new memory table (-1: no longer mapped). */
int vr_queue_remap(struct vr_queue *q, const struct vr_mem *m);
/* Start at avail/used index base (SET_VRING_BASE); clears broken. */
void vr_queue_set_base(struct vr_queue *q, uint16_t base);
int vr_queue_ready(const struct vr_queue *q);

/* Outcome of vr_tx_pop() / vr_rx_put(). */
enum vr_pop {
    VR_OK = 0,
    VR_EMPTY = 1,    /* nothing available */
    VR_DROPPED = 2,  /* the chain (TX) or frame (RX) was dropped and counted */
    VR_BROKEN = 3,   /* the queue is broken (now or before) */
};

/* TX (guest -> us): take the next available chain. On VR_OK, iov[0..*niov) are the frame's bytes
 * (past the hdr_len-byte vnet header), *len their total, *vnet the header's first two bytes
 * (flags, gso_type), *head the chain to give back with vr_push_used(q, head, 0) after copying. A
 * dropped chain is given back here. max_frame: the longest frame accepted (past the header). */
enum vr_pop vr_tx_pop(struct vr_queue *q, const struct vr_mem *m, size_t hdr_len, size_t max_frame,
                      unsigned *niov, size_t *len, uint16_t *vnet, uint16_t *head, struct vr_counters *c);
/* Copy the frame vr_tx_pop() described into dst (len bytes). */
void vr_iov_copy(uint8_t *dst, const struct vr_iov *iov, unsigned niov);

/* RX (us -> guest): write hdr (hdr_len bytes: the virtio_net_hdr; num_buffers, at offset 10 when
 * hdr_len is 12, is set here) and frame[0..len) into the guest's available chains: one chain, or
 * with mrg (MRG_RXBUF) as many as it takes. VR_EMPTY: not enough buffers now, nothing taken;
 * VR_DROPPED: the frame cannot fit, or a chain was bad (given back with length 0). */
enum vr_pop vr_rx_put(struct vr_queue *q, const struct vr_mem *m, int mrg, size_t hdr_len, const uint8_t *hdr,
                      const uint8_t *frame, size_t len, struct vr_counters *c);
/* The same with the frame in pieces: iov[0..niov) (len bytes in all; the native TCP engine's
 * headers and payload, written without joining them first). */
enum vr_pop vr_rx_putv(struct vr_queue *q, const struct vr_mem *m, int mrg, size_t hdr_len, const uint8_t *hdr,
                       const struct iovec *iov, unsigned niov, size_t len, struct vr_counters *c);

/* RX in place (one copy: the caller has the kernel write a frame's payload straight into the
 * guest's buffers, then commits its headers). A reservation takes chains as vr_rx_putv() would
 * for each frame, in order, checking every descriptor as it does and writing nothing; the
 * frames' bytes are then written through the pieces it hands out, the frames committed in order
 * (their used entries filled), and vr_rx_release() puts back what was not committed: last_avail
 * goes back to the first chain not used, which the guest sees as never taken (the chains a
 * reservation takes are consecutive in the avail ring, the ones committed a prefix of them). */
#define VR_RSV_FRAMES 8u

struct vr_rsv {
    uint16_t start;   /* last_avail when the reservation began */
    uint8_t open;
    uint8_t sealed;   /* a frame committed shorter than reserved: no later frame commits */
    unsigned chains;  /* chains taken: q->heads[0..chains), the bytes each holds for its frame q->lens[] */
    unsigned done;    /* the first chains[0..done) went to the used ring */
    unsigned pieces;  /* q->iov[0..pieces): their writable pieces, in order */
    unsigned frames, next; /* frames reserved; the next to commit */
    unsigned chain0[VR_RSV_FRAMES + 1], piece0[VR_RSV_FRAMES + 1]; /* each frame's first; [frames]: the end */
};

/* Reserve chains for one more frame of need bytes (hdr_len of vnet header and the frame), after
 * those r holds: one chain, or with mrg as many as it takes. The frame's bytes past skip (the vnet
 * header and the frame's own headers, written at commit) are iov[0..return) (our addresses of
 * guest memory, inside its regions). 0 (nothing more taken, nothing counted: vr_rx_putv() then
 * handles the frame and counts what it finds): not enough chains available now, a chain that is
 * bad or whose first descriptor is shorter than hdr_len, a chain too short without mrg, more
 * pieces or chains (in all) than max_iov or than the queue holds, VR_RSV_FRAMES frames reserved already, a queue
 * broken or not ready. */
int vr_rx_reserve(struct vr_queue *q, struct vr_rsv *r, const struct vr_mem *m, int mrg, size_t hdr_len,
                  size_t need, size_t skip, struct iovec *iov, unsigned max_iov);
/* The reservation's next frame is complete but for its start: hdr (hdr_len bytes; num_buffers,
 * at offset 10 when hdr_len is 12, is set here) and head[0..head_len) are written there, and its
 * chains holding hdr_len + len bytes go to the used ring (not yet visible: vr_flush()). len
 * (head_len and the payload) at most what was reserved; a shorter frame seals the reservation.
 * 0, or -1 (nothing written): no frame to commit, sealed, len too long or shorter than head_len. */
int vr_rx_commit(struct vr_queue *q, struct vr_rsv *r, size_t hdr_len, const uint8_t *hdr, const uint8_t *head,
                 size_t head_len, size_t len);
/* The chains reserved and not committed go back (unseen by the guest); r is closed. */
void vr_rx_release(struct vr_queue *q, struct vr_rsv *r);

/* Fill a used ring entry (not yet visible: vr_flush() publishes the index). */
void vr_push_used(struct vr_queue *q, uint16_t head, uint32_t len);
/* Publish used_idx (release order). */
void vr_flush(struct vr_queue *q);
/* Whether the driver wants a call for what was published since the last one (EVENT_IDX:
 * used_event; else the avail ring's NO_INTERRUPT flag); records it as signalled when so. */
int vr_should_call(struct vr_queue *q);
/* Whether the driver wants a call for what was published since the last vr_should_call() or
 * vr_call_settle(), as vr_should_call() answers it, recording nothing (EVENT_IDX only: without it,
 * whether NO_INTERRUPT is clear). */
int vr_call_owed(const struct vr_queue *q);
/* Record what was published as settled without a call: the driver moved used_event past it (it
 * took those buffers back by itself), so no call is owed for them (EVENT_IDX). */
void vr_call_settle(struct vr_queue *q);
/* Ask the driver for a kick when it makes more chains available than the avail index last read
 * (EVENT_IDX: avail_event = that index; else clear NO_NOTIFY), or (on = 0) to not kick
 * (NO_NOTIFY; EVENT_IDX: nothing). Returns whether the driver made chains available since that
 * read (the index re-read after a full barrier): for RX, waiting for more buffers than it has,
 * new ones to try with. */
int vr_kick_me(struct vr_queue *q, int on);
/* Chains available now (0 for a broken or unready queue). */
unsigned vr_avail_count(struct vr_queue *q);

#endif
