/* What the data plane's binding (_dataplane.c) uses of the TCP engine's binding (_tcpnat.c):
 * the TcpEngine type and the TAP reader's hook. MIT licensed, written for aioslirp. */
#ifndef AIOSLIRP__TCPNAT_H
#define AIOSLIRP__TCPNAT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

/* Add the type TcpEngine to the module. */
int tcpnat_add_type(PyObject *module);
/* The engine behind a TcpEngine object, or NULL (not one, or closed). */
void *tcpnat_engine_of(PyObject *obj);
/* A guest frame (no vnet header) from the TAP reader: 1 when a native flow took it. */
int tcpnat_tap_frame(void *engine, const uint8_t *frame, size_t len, int csum_ok, double now);
/* The same for a frame whose memory stays unchanged until tcpnat_gather_flush (or the batch's
 * end): one flow's consecutive in-order payloads reach its socket in one sendmsg. */
int tcpnat_tap_frame_kept(void *engine, const uint8_t *frame, size_t len, int csum_ok, double now);
/* A guest frame in pieces, its payload sent from them (tcpsink.h frame_zc, tn_frame_zc): 1 taken,
 * 0 Python's, -1 not this way. */
int tcpnat_frame_zc(void *engine, const uint8_t *head, size_t head_len, const struct iovec *iov, int n, size_t len,
                    int csum_ok, double now);
/* Send what kept frames gathered: before their memory is reused. */
void tcpnat_gather_flush(void *engine);
/* The most bytes one gathered sendmsg takes (tn_gather_max; 0: no bound). */
void tcpnat_gather_max(void *engine, size_t n);
/* The end of a batch of guest frames: the ACKs due go out, the timer follows. */
void tcpnat_batch_end(void *engine);
/* CLOCK_MONOTONIC in seconds (the clock of loop.time()). */
double tcpnat_now(void);
/* TcpEngine.pending() of a TcpEngine object, without a call: 1 when its records wait (or bytes
 * moved since moved() while metered), 0 otherwise or when obj is not an open engine. */
int tcpnat_pending(PyObject *obj);
/* 1 when the engine (tcpnat_engine_of) holds records Python has not taken (flows that ended or
 * connected): what the TAP reader's caller takes before the batch's frames for Python. */
int tcpnat_records_pending(void *engine);

/* The fair scheduler's yield point (_dataplane.c, set_yield()): at the places a busy guest's turn
 * can stop for a moment (between two frames of a batch, two socket events of a poll), at most once
 * every set_yield()'s interval, the express lane's epoll is polled (no wait) and, when readable,
 * its serve() runs the sparse guests' input there and then. plane and engine: whose turn it is
 * (either may be NULL); while serve() runs, neither is entered again (dp_yield_blocks). */
void dp_yield(const void *plane, const void *engine);
/* 1 while a yield point interrupted this engine's (or this plane's) turn: its reader must do nothing. */
int dp_yield_blocks(const void *plane, const void *engine);
/* 1 while the yield point is armed (some guest waits for its turn). */
int dp_yield_armed(void);

#endif
