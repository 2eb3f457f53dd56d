/* A guest driver for the rings' notification test (tests/adversarial/test_vring_model.py): it
 * runs beside the device, in its own process, and makes TX chains on a split virtqueue as a Linux
 * virtio driver with VIRTIO_RING_F_EVENT_IDX does: chains made, the avail index published, a full
 * barrier, then a kick only when the device's avail_event asks for one (virtio 1.1 2.6.10.2).
 *
 *   vring_driver MEMFD KICKFD NUM CHAINS SIZE burst|race
 *
 * burst: 1-4 chains at a time (never more than the free entries; a full ring waits for used
 *        entries), now and then a pause: the device's walk ends at every count of chains;
 * race:  one chain at a time, the next made just after the device wrote the last one's used
 *        entry (a short random pause first): it lands now and then between the device's last
 *        read of the avail index and its writing avail_event.
 *
 * The ring layout is the test's: descriptors at 0 (descriptor i is chain i, set up by the test),
 * avail at 0x1000, used at 0x2000. Prints "CHAINS KICKS" when every chain is published, or
 * "stuck CHAINS KICKS" when the device took no chain for 3 s (race). */
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define AVAIL 0x1000
#define USED 0x2000

static volatile uint16_t *ring, *aidx, *uidx, *avail_event;
static volatile uint32_t *used;
static int kick;
static unsigned long kicks;

/* Publish the chains made up to idx (old: the index before them); kick when avail_event asks. */
static int publish(uint16_t old, uint16_t idx)
{
    __atomic_thread_fence(__ATOMIC_RELEASE); /* the entries before the index */
    *aidx = idx;
    __atomic_thread_fence(__ATOMIC_SEQ_CST); /* the index published before avail_event is read */
    uint16_t event = *avail_event;
    if ((uint16_t)(idx - event - 1) < (uint16_t)(idx - old)) {
        uint64_t one = 1;
        if (write(kick, &one, sizeof one) != sizeof one)
            return -1;
        kicks++;
    }
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 7)
        return 2;
    int fd = atoi(argv[1]), race = !strcmp(argv[6], "race");
    kick = atoi(argv[2]);
    unsigned num = (unsigned)atoi(argv[3]);
    unsigned long n = strtoul(argv[4], NULL, 10);
    size_t size = strtoul(argv[5], NULL, 10);
    uint8_t *m = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED)
        return 2;
    ring = (volatile uint16_t *)(m + AVAIL + 4);
    aidx = (volatile uint16_t *)(m + AVAIL + 2);
    uidx = (volatile uint16_t *)(m + USED + 2);
    used = (volatile uint32_t *)(m + USED + 4);
    avail_event = (volatile uint16_t *)(m + USED + 4 + 8 * num);
    uint16_t idx = 0;
    unsigned long sent = 0, seed = 12345;
    while (sent < n) {
        seed = seed * 6364136223846793005ul + 1442695040888963407ul;
        if (race) {
            uint16_t old = idx;
            used[2 * (idx % num)] = 0xFFFF; /* the used entry's id, until the device writes it */
            ring[idx % num] = (uint16_t)(idx % num);
            idx++;
            sent++;
            if (publish(old, idx) < 0)
                return 3;
            struct timespec t0, t1;
            clock_gettime(CLOCK_MONOTONIC, &t0);
            while (used[2 * (old % num)] == 0xFFFF) {
                clock_gettime(CLOCK_MONOTONIC, &t1);
                if (t1.tv_sec - t0.tv_sec > 3) {
                    printf("stuck %lu %lu\n", sent, kicks);
                    return 0;
                }
            }
            for (volatile unsigned k = 0; k < (unsigned)((seed >> 33) % 200); k++)
                ;
            continue;
        }
        unsigned burst = 1 + (unsigned)((seed >> 33) % 4);
        for (;;) { /* a full ring: every chain made is published already; wait for used entries */
            uint16_t u = __atomic_load_n(uidx, __ATOMIC_ACQUIRE);
            unsigned room = num - (uint16_t)(idx - u);
            if (room) {
                burst = burst < room ? burst : room;
                break;
            }
            sched_yield();
        }
        uint16_t old = idx;
        for (unsigned b = 0; b < burst && sent < n; b++, sent++, idx++)
            ring[idx % num] = (uint16_t)(idx % num);
        if (publish(old, idx) < 0)
            return 3;
        if ((seed >> 40) % 8 == 0) /* now and then a pause: the device catches up, its ring empties */
            for (volatile unsigned k = 0; k < (unsigned)((seed >> 20) % 2000); k++)
                ;
    }
    printf("%lu %lu\n", sent, kicks);
    return 0;
}
