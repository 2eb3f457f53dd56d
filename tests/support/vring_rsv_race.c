/* A guest that moves the RX avail index between two reservations of one turn (the engine's
 * reserve_frames(): up to 4 vr_rx_reserve() calls, the guest running beside it): built with
 * vring.c itself (tests/adversarial/test_vhost_rx_reserve_race.py). Ring of 2; frame 1 takes a
 * zero-length chain and a data chain (MRG_RXBUF), then the guest publishes both entries again.
 * Prints "frame1 K1 frame2 K2 chains C num N". */
#include "vring.c"

#include <stdio.h>

#define SIZE (1u << 20)
#define UVA 0x10000000ull

static void desc(uint8_t *mem, unsigned i, uint64_t addr, uint32_t len, uint16_t flags, uint16_t next)
{
    uint8_t *d = mem + 16u * i;
    memcpy(d, &addr, 8);
    memcpy(d + 8, &len, 4);
    memcpy(d + 12, &flags, 2);
    memcpy(d + 14, &next, 2);
}

int main(void)
{
    static struct vr_mem m;
    static struct vr_queue q;
    static struct vr_rsv r;
    uint8_t *mem = aligned_alloc(4096, SIZE);
    if (!mem)
        return 2;
    memset(mem, 0, SIZE);
    m.n = 1;
    m.r[0].gpa = 0;
    m.r[0].size = SIZE;
    m.r[0].uva = UVA;
    m.r[0].host = mem;
    const unsigned num = 2;
    if (vr_queue_set_num(&q, num) < 0)
        return 2;
    desc(mem, 0, 0x10000, 0, VR_DESC_F_WRITE, 0);      /* a chain of one empty descriptor */
    desc(mem, 1, 0x20000, 0x20000, VR_DESC_F_WRITE, 0); /* a chain of 128 KB */
    uint8_t *avail = mem + 0x1000;
    uint16_t heads[2] = {0, 1}, idx = 2;
    memcpy(avail + 4, heads, sizeof heads);
    memcpy(avail + 2, &idx, 2);
    if (vr_queue_set_addr(&q, &m, UVA, UVA + 0x2000, UVA + 0x1000) < 0)
        return 2;
    vr_queue_set_base(&q, 0);
    struct iovec iov[8];
    int k1 = vr_rx_reserve(&q, &r, &m, 1, 12, 12 + 54 + 1000, 12 + 54, iov, 8);
    idx = 4; /* the guest, meanwhile: both entries made available again */
    memcpy(avail + 2, &idx, 2);
    int k2 = vr_rx_reserve(&q, &r, &m, 1, 12, 12 + 54 + 1000, 12 + 54, iov + 1, 7);
    printf("frame1 %d frame2 %d chains %u num %u\n", k1, k2, r.chains, num);
    vr_rx_release(&q, &r);
    vr_queue_free(&q);
    free(mem);
    return 0;
}
