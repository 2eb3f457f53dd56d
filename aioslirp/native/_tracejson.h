/* The native trace records as the trace file's JSON lines (the direct span sink of
 * aioslirp.observe.sink): TcpEngine.trace_json() of _tcpnat.c formats each record of the
 * engine's trace ring (struct tn_trace_rec of tcpnat.h) into the line or flow-span event that
 * aioslirp.observe.tracing records for it through the OpenTelemetry SDK, with no Python object
 * per record. MIT licensed, written for aioslirp. */
#ifndef AIOSLIRP__TRACEJSON_H
#define AIOSLIRP__TRACEJSON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "tcpnat.h"

struct tj_ctx {
    PyObject *spans;     /* dict: (slot, gen) -> (trace_id, span_id, events, ports, v6) of each traced flow */
    int frames;          /* trace level "frames": the per-frame records and the *.sent events too */
    int64_t off_ns;      /* CLOCK_MONOTONIC -> time.time_ns() */
    uint64_t rng;        /* splitmix64 state for the span and trace ids */
    const char *guest;   /* ',"aioslirp.guest.name":"..."...' or "" (JSON, ASCII) */
    Py_ssize_t guest_len;
    const char *resource; /* the resource's JSON object */
    Py_ssize_t resource_len;
    char *buf;           /* the lines so far */
    size_t len, cap;
    size_t lines;
    /* the last lookup (records of one flow come in runs) */
    uint32_t last_slot, last_gen;
    PyObject *last; /* borrowed from spans, or NULL */
    int last_valid;
};

/* Format n records into ctx->buf (the lines) and the flows' events lists. 0, or -1 with a
 * Python exception set. */
int tj_format(struct tj_ctx *ctx, const struct tn_trace_rec *recs, size_t n);

/* The module function span_lines(entries, resource, fallback) -> (bytes, lines) (_tracejson.c). */
PyObject *tj_span_lines(PyObject *self, PyObject *args);

#endif
