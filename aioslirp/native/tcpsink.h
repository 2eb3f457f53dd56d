/* What the two native extensions hand each other so that the TCP engine (_dataplane: tcpnat.c)
 * runs over a vhost-user device (_vhost: vring.c) as over a TAP, with no Python object per frame:
 *
 *  - the device's frame sink (a PyCapsule named TCPSINK_CAPSULE, from Device.tcp_sink(), given to
 *    TcpEngine(sink=...)): the engine writes its frames for the guest there instead of writev() on
 *    a TAP fd, and calls flush() at the end of each of its turns (one call to the guest per turn);
 *  - the engine's input (a PyCapsule named TCPNAT_API_CAPSULE, the module attribute
 *    aioslirp.native._dataplane.tcp_api, taken by Device.attach_tcp()): the device hands it each
 *    guest frame it takes from the TX ring, before making a Python object of it.
 *
 * MIT licensed, written for aioslirp. */
#ifndef AIOSLIRP_TCPSINK_H
#define AIOSLIRP_TCPSINK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define TCPSINK_CAPSULE "aioslirp.native._vhost.tcp_sink"
#define TCPNAT_API_CAPSULE "aioslirp.native._dataplane.tcp_api"
/* The bytes of a frame's start that frame_zc's head holds (TN_ZC_HEAD in tcpnat.h). */
#define TCPSINK_ZC_HEAD 160u

struct tcpsink {
    /* One frame for the guest: iov[0] starts with the 12-byte virtio_net_hdr_v1; 0, or -errno
     * (the frame is dropped, counted by the engine as a tap write error). */
    int (*write)(void *ctx, const struct iovec *iov, int n);
    /* The end of the engine's turn: what was written is published and the guest called. */
    void (*flush)(void *ctx);
    void *ctx;
    /* Frames written in place, with one copy: the engine has the kernel peek a host socket's bytes
     * straight into the guest's RX buffers and writes only the headers (NULL: not offered).
     *  - reserve: RX buffers for one more frame of head bytes of headers (Ethernet, IP, TCP; the
     *    vnet header's room is the sink's) and payload bytes, after those reserved since the last
     *    release: iov[0..return) is where its payload goes (guest memory, inside its regions). 0:
     *    not now (too few or too small buffers, frames of write() waiting, a bad chain, offloads
     *    the driver did not accept, more than max_iov pieces): write() takes the frame, and
     *    handles and counts each of those as it does;
     *  - commit: the next frame reserved, in order, is complete but for its headers: hdr (its
     *    12-byte virtio_net_hdr_v1 and then the headers, hdr_len bytes in all) is written at its
     *    start and it goes to the guest with payload bytes (at most what was reserved; one shorter
     *    ends the reservation: no later frame commits); 0, or -errno (dropped, as write());
     *  - release: the buffers reserved and not committed go back to the ring, never seen by the
     *    guest. Called after each peek into a reservation (whatever became of it), before anything
     *    else is written to the sink. */
    int (*reserve)(void *ctx, size_t head, size_t payload, struct iovec *iov, int max_iov);
    int (*commit)(void *ctx, const uint8_t *hdr, size_t hdr_len, size_t payload);
    void (*release)(void *ctx);
};

struct tcpnat_api {
    /* The engine behind a TcpEngine object, or NULL (not one, or closed). */
    void *(*engine_of)(PyObject *obj);
    /* A guest frame (no vnet header): 1 when a native flow took it. */
    int (*frame)(void *engine, const uint8_t *frame, size_t len, int csum_ok, double now);
    /* The end of a batch of guest frames. */
    void (*batch_end)(void *engine);
    /* CLOCK_MONOTONIC seconds. */
    double (*now)(void);
    /* A guest frame in pieces, its payload never copied (tn_frame_zc, tcpnat.h): head holds a copy
     * of its first min(len, TCPSINK_ZC_HEAD) bytes or more, iov[0..n) the whole frame (len bytes)
     * in guest memory that stays mapped and is not given back to the guest before batch_end. 1
     * taken, 0 Python's, -1 not this way (copy it whole and call frame()). */
    int (*frame_zc)(void *engine, const uint8_t *head, size_t head_len, const struct iovec *iov, int n, size_t len,
                    int csum_ok, double now);
};

#endif
