/* The native trace records as the trace file's JSON lines: see _tracejson.h. Each line is
 * byte for byte what aioslirp.observe.sink.JsonLinesSink writes for the span that
 * aioslirp.observe.tracing makes of the record (names, attribute order, float text as
 * Python's repr). MIT licensed, written for aioslirp. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "_tracejson.h"

/* enum tn_flow_event -> the flow span's event name (aioslirp.nat.native_tcp._FLOW_EVENTS). */
static const char *const EVENT_NAMES[] = {
    NULL, "established", "guest.data", "host.data", "fin.guest", "fin.host", "reset", "closed",
    "connect.refused", "connect.unreachable", "syn_ack.sent", "data.sent", "fin.sent", "rst.sent",
};
#define N_EVENTS (sizeof EVENT_NAMES / sizeof EVENT_NAMES[0])
#define FE_SENT 10

static int grow(struct tj_ctx *c, size_t more)
{
    if (c->len + more <= c->cap)
        return 0;
    size_t cap = c->cap ? c->cap : 4096;
    while (cap < c->len + more)
        cap *= 2;
    char *p = realloc(c->buf, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    c->buf = p;
    c->cap = cap;
    return 0;
}

/* Small appenders into a local scratch line (lines are short; the buffer is grown per line). */
struct line {
    char b[2048];
    size_t n;
};

static void put(struct line *l, const char *s, size_t n)
{
    if (l->n + n < sizeof l->b) {
        memcpy(l->b + l->n, s, n);
        l->n += n;
    } else {
        l->n = sizeof l->b; /* marks an overlong line: dropped by flush_line */
    }
}

static void puts_(struct line *l, const char *s) { put(l, s, strlen(s)); }

static void put_u64(struct line *l, uint64_t v)
{
    char t[24];
    size_t i = sizeof t;
    do {
        t[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v);
    put(l, t + i, sizeof t - i);
}

static void put_i64(struct line *l, int64_t v)
{
    if (v < 0) {
        put(l, "-", 1);
        put_u64(l, (uint64_t)0 - (uint64_t)v);
    } else {
        put_u64(l, (uint64_t)v);
    }
}

/* ns / 1000.0 as Python's repr: the exact decimal (at most 3 fraction digits), trailing zeros
 * trimmed but one ("1.0", "1.5", "1234.567"); exact for any uint32 (a decimal of at most 10
 * significant digits is the shortest text of the double nearest to it). */
static void put_us(struct line *l, uint32_t ns)
{
    char f[4] = {'.', (char)('0' + ns % 1000 / 100), (char)('0' + ns % 100 / 10), (char)('0' + ns % 10)};
    size_t n = 4;
    while (n > 2 && f[n - 1] == '0')
        n--;
    put_u64(l, ns / 1000u);
    put(l, f, n);
}

static uint64_t next64(struct tj_ctx *c)
{
    uint64_t z = (c->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return z ? z : 1;
}

static void put_hex64(struct line *l, uint64_t v)
{
    static const char hex[] = "0123456789abcdef";
    char t[16];
    for (int i = 15; i >= 0; i--, v >>= 4)
        t[i] = hex[v & 15];
    put(l, t, 16);
}

/* The traced flow of (slot, gen): its tuple (borrowed), or NULL (none: not traced, or over). */
static PyObject *flow_of(struct tj_ctx *c, uint32_t slot, uint32_t gen, int *err)
{
    *err = 0;
    if (slot == TN_TRACE_NO_FLOW)
        return NULL;
    if (c->last_valid && c->last_slot == slot && c->last_gen == gen)
        return c->last;
    PyObject *key = Py_BuildValue("(kk)", (unsigned long)slot, (unsigned long)gen);
    if (!key) {
        *err = 1;
        return NULL;
    }
    PyObject *v = PyDict_GetItemWithError(c->spans, key);
    Py_DECREF(key);
    if (!v && PyErr_Occurred()) {
        *err = 1;
        return NULL;
    }
    if (v && (!PyTuple_Check(v) || PyTuple_Size(v) != 5)) {
        PyErr_SetString(PyExc_TypeError, "trace_json: spans values must be (trace_id, span_id, events, ports, v6)");
        *err = 1;
        return NULL;
    }
    c->last_slot = slot;
    c->last_gen = gen;
    c->last = v;
    c->last_valid = 1;
    return v;
}

static int put_str_item(struct line *l, PyObject *tuple, Py_ssize_t i)
{
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(PyTuple_GetItem(tuple, i), &n);
    if (!s)
        return -1;
    put(l, s, (size_t)n);
    return 0;
}

/* '{"name":"<name>","trace_id":"..","span_id":"..","parent_span_id":..,"kind":"INTERNAL","start_ns":..,
 * "end_ns":..,"attributes":{' : the head of a span's line, child of flow (or a root span). */
static int line_head(struct tj_ctx *c, struct line *l, const char *name, PyObject *flow, int64_t t0, int64_t t1)
{
    puts_(l, "{\"name\":\"");
    puts_(l, name);
    puts_(l, "\",\"trace_id\":\"");
    if (flow) {
        if (put_str_item(l, flow, 0) < 0)
            return -1;
    } else {
        put_hex64(l, next64(c));
        put_hex64(l, next64(c));
    }
    puts_(l, "\",\"span_id\":\"");
    put_hex64(l, next64(c));
    if (flow) {
        puts_(l, "\",\"parent_span_id\":\"");
        if (put_str_item(l, flow, 1) < 0)
            return -1;
        puts_(l, "\"");
    } else {
        puts_(l, "\",\"parent_span_id\":null");
    }
    puts_(l, ",\"kind\":\"INTERNAL\",\"start_ns\":");
    put_i64(l, t0);
    puts_(l, ",\"end_ns\":");
    put_i64(l, t1);
    puts_(l, ",\"attributes\":{");
    return 0;
}

/* The guest's attributes, the end of the attributes, the links (to link, if any) and the rest. */
static int line_tail(struct tj_ctx *c, struct line *l, PyObject *link)
{
    put(l, c->guest, (size_t)c->guest_len);
    puts_(l, "},\"events\":[],\"links\":[");
    if (link) {
        puts_(l, "{\"trace_id\":\"");
        if (put_str_item(l, link, 0) < 0)
            return -1;
        puts_(l, "\",\"span_id\":\"");
        if (put_str_item(l, link, 1) < 0)
            return -1;
        puts_(l, "\"}");
    }
    puts_(l, "],\"status\":\"UNSET\",\"resource\":");
    put(l, c->resource, (size_t)c->resource_len);
    puts_(l, "}\n");
    if (l->n >= sizeof l->b)
        return 0; /* overlong (a huge guest identity): not written */
    if (grow(c, l->n) < 0)
        return -1;
    memcpy(c->buf + c->len, l->b, l->n);
    c->len += l->n;
    c->lines++;
    return 0;
}

/* One event of a flow span, appended to its events list as its JSON text. */
static int add_event(PyObject *flow, const char *name, int64_t at, const char *attrs_open, int64_t v, int has_v)
{
    struct line l;
    l.n = 0;
    puts_(&l, "{\"name\":\"");
    puts_(&l, name);
    puts_(&l, "\",\"time_ns\":");
    put_i64(&l, at);
    puts_(&l, ",\"attributes\":{");
    if (attrs_open) {
        puts_(&l, attrs_open);
        if (has_v)
            put_i64(&l, v);
    }
    puts_(&l, "}}");
    PyObject *s = PyUnicode_FromStringAndSize(l.b, (Py_ssize_t)l.n);
    if (!s)
        return -1;
    int rc = PyList_Append(PyTuple_GetItem(flow, 2), s);
    Py_DECREF(s);
    return rc;
}

static const char FLAG_LETTERS[] = {'F', 'S', 'R', 'P', 'A'};
static const uint8_t FLAG_BITS[] = {0x01, 0x02, 0x04, 0x08, 0x10};

int tj_format(struct tj_ctx *c, const struct tn_trace_rec *recs, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        const struct tn_trace_rec *r = &recs[i];
        int64_t t1 = (int64_t)r->t_ns + c->off_ns;
        int64_t t0 = t1 - (int64_t)r->dur_ns;
        int err;
        PyObject *flow;
        struct line l;
        l.n = 0;
        switch (r->type) {
        case TN_TR_EVENT: {
            if (r->a == 0 || r->a >= N_EVENTS || (!c->frames && r->a >= FE_SENT))
                break;
            if (!(flow = flow_of(c, r->slot, r->gen, &err))) {
                if (err)
                    return -1;
                break;
            }
            const char *name = EVENT_NAMES[r->a];
            int rc;
            if (r->a == 2 || r->a == 3)
                rc = add_event(flow, name, t1, "\"aioslirp.bytes\":", (int64_t)r->b, 1);
            else if (r->a >= FE_SENT)
                rc = add_event(flow, name, t1, "\"aioslirp.wait_us\":0.0", 0, 0);
            else
                rc = add_event(flow, name, t1, NULL, 0, 0);
            if (rc < 0)
                return -1;
            break;
        }
        case TN_TR_SYN_ACK: {
            if (!(flow = flow_of(c, r->slot, r->gen, &err))) {
                if (err)
                    return -1;
                break;
            }
            /* as record_syn_ack(flow, a / 1e6, False, at=t1) */
            double connect_time = (double)r->a / 1e6;
            int64_t s0 = t1 - (int64_t)(connect_time * 1e9);
            int64_t connect_us = (int64_t)(connect_time * 1e6);
            if (add_event(flow, "host.connect", s0, NULL, 0, 0) < 0)
                return -1;
            if (line_head(c, &l, "tcp.syn_ack", flow, s0, t1) < 0 || put_str_item(&l, flow, 3) < 0)
                return -1;
            puts_(&l, ",\"aioslirp.connect.immediate\":false,\"aioslirp.connect_us\":");
            put_i64(&l, connect_us);
            if (line_tail(c, &l, NULL) < 0)
                return -1;
            if (add_event(flow, "syn_ack.queued", t1, "\"aioslirp.connect_us\":", connect_us, 1) < 0)
                return -1;
            break;
        }
        case TN_TR_FRAME: {
            if (!c->frames)
                break;
            flow = flow_of(c, r->slot, r->gen, &err);
            if (err)
                return -1;
            if (line_head(c, &l, "process_guest_frame", flow, t0, t1) < 0)
                return -1;
            puts_(&l, "\"aioslirp.frame.bytes\":");
            put_u64(&l, r->a);
            puts_(&l, ",\"aioslirp.frames_queued\":");
            put_u64(&l, r->b);
            puts_(&l, ",\"aioslirp.processing_us\":");
            put_us(&l, r->dur_ns);
            puts_(&l, ",\"network.transport\":\"tcp\",\"aioslirp.plane\":\"native\"");
            if (flow) {
                int v6 = PyObject_IsTrue(PyTuple_GetItem(flow, 4));
                puts_(&l, v6 ? ",\"aioslirp.ethertype\":34525,\"network.type\":\"ipv6\""
                             : ",\"aioslirp.ethertype\":2048,\"network.type\":\"ipv4\"");
            }
            if (r->tcp_flags) {
                puts_(&l, ",\"aioslirp.tcp.flags\":\"");
                for (size_t k = 0; k < sizeof FLAG_BITS; k++)
                    if (r->tcp_flags & FLAG_BITS[k])
                        put(&l, &FLAG_LETTERS[k], 1);
                puts_(&l, "\"");
            }
            if (line_tail(c, &l, NULL) < 0)
                return -1;
            break;
        }
        case TN_TR_DRAIN: {
            if (!c->frames)
                break;
            flow = r->b ? NULL : flow_of(c, r->slot, r->gen, &err);
            if (!flow && !r->b && err)
                return -1;
            if (line_head(c, &l, "drain_to_guest", flow, t0, t1) < 0)
                return -1;
            puts_(&l, "\"aioslirp.frames\":");
            put_u64(&l, r->a);
            puts_(&l, ",\"aioslirp.queue_depth\":0,\"aioslirp.drain_us\":");
            put_us(&l, r->dur_ns);
            puts_(&l, ",\"aioslirp.plane\":\"native\"");
            if (line_tail(c, &l, flow) < 0)
                return -1;
            break;
        }
        case TN_TR_WAKE: {
            if (!c->frames)
                break;
            flow = flow_of(c, r->slot, r->gen, &err);
            if (err)
                return -1;
            if (line_head(c, &l, "writer_wake", flow, t0, t1) < 0)
                return -1;
            puts_(&l, "\"aioslirp.frames\":");
            put_u64(&l, r->c);
            puts_(&l, ",\"aioslirp.events.socket\":");
            put_u64(&l, r->a);
            puts_(&l, ",\"aioslirp.events.timer\":");
            put_u64(&l, r->b);
            puts_(&l, ",\"aioslirp.wake_us\":");
            put_us(&l, r->dur_ns);
            puts_(&l, ",\"aioslirp.plane\":\"native\"");
            if (line_tail(c, &l, flow) < 0)
                return -1;
            break;
        }
        default:
            break;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------ span_lines()
 * One span of aioslirp.observe.sink.JsonLinesSink as its JSON line, in C (the writer thread's
 * formatting of the spans Python made: flow spans with their events, frame spans of the Python
 * path). Byte for byte json.dumps(separators=(",", ":")) (ASCII, floats as repr); a value it does
 * not format itself (not str/int/float/bool, an int beyond 64 bits, non-ASCII text) is given to
 * fallback(value) -> its JSON text. */
struct jbuf {
    char *p;
    size_t n, cap;
};

static int jput(struct jbuf *b, const char *s, size_t n)
{
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap : 1024;
        while (cap < b->n + n)
            cap *= 2;
        char *p = PyMem_Realloc(b->p, cap);
        if (!p) {
            PyErr_NoMemory();
            return -1;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

static int jputs(struct jbuf *b, const char *s) { return jput(b, s, strlen(s)); }

static int jput_i64(struct jbuf *b, long long v)
{
    char t[24];
    size_t i = sizeof t;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do {
        t[--i] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0)
        t[--i] = '-';
    return jput(b, t + i, sizeof t - i);
}

static int jput_fallback(struct jbuf *b, PyObject *value, PyObject *fallback)
{
    PyObject *s = PyObject_CallFunctionObjArgs(fallback, value, NULL);
    if (!s)
        return -1;
    Py_ssize_t n;
    const char *p = PyUnicode_Check(s) ? PyUnicode_AsUTF8AndSize(s, &n) : NULL;
    int rc = p ? jput(b, p, (size_t)n) : -1;
    if (!p && !PyErr_Occurred())
        PyErr_SetString(PyExc_TypeError, "span_lines: fallback must return str");
    Py_DECREF(s);
    return rc;
}

/* A str as JSON text, ASCII (json's encode_basestring_ascii): non-ASCII text to fallback. */
static int jput_str(struct jbuf *b, PyObject *s, PyObject *fallback)
{
    static const char hex[] = "0123456789abcdef";
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(s, &n);
    if (!p)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if ((unsigned char)p[i] >= 0x80)
            return jput_fallback(b, s, fallback);
    if (jput(b, "\"", 1) < 0)
        return -1;
    Py_ssize_t run = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        if (c >= 0x20 && c < 0x7f && c != '"' && c != '\\')
            continue;
        if (jput(b, p + run, (size_t)(i - run)) < 0)
            return -1;
        run = i + 1;
        char e[6] = {'\\', 'u', '0', '0', hex[c >> 4], hex[c & 15]};
        const char *esc = NULL;
        switch (c) {
        case '"': esc = "\\\""; break;
        case '\\': esc = "\\\\"; break;
        case '\n': esc = "\\n"; break;
        case '\r': esc = "\\r"; break;
        case '\t': esc = "\\t"; break;
        case '\b': esc = "\\b"; break;
        case '\f': esc = "\\f"; break;
        default: break;
        }
        if (esc ? jputs(b, esc) : jput(b, e, 6))
            return -1;
    }
    if (jput(b, p + run, (size_t)(n - run)) < 0)
        return -1;
    return jput(b, "\"", 1);
}

static int jput_value(struct jbuf *b, PyObject *v, PyObject *fallback)
{
    if (PyBool_Check(v))
        return jputs(b, v == Py_True ? "true" : "false");
    if (PyLong_Check(v)) {
        int overflow;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred())
            return -1;
        return overflow ? jput_fallback(b, v, fallback) : jput_i64(b, x);
    }
    if (PyFloat_Check(v)) {
        double d = PyFloat_AsDouble(v);
        if (d != d)
            return jputs(b, "NaN");
        if (d > 1.7976931348623157e308)
            return jputs(b, "Infinity");
        if (d < -1.7976931348623157e308)
            return jputs(b, "-Infinity");
        char *s = PyOS_double_to_string(d, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
        if (!s)
            return -1;
        int rc = jputs(b, s);
        PyMem_Free(s);
        return rc;
    }
    if (PyUnicode_Check(v))
        return jput_str(b, v, fallback);
    return jput_fallback(b, v, fallback);
}

/* A dict of str keys as a JSON object ({} for None or empty); other keys: the dict to fallback. */
static int jput_dict(struct jbuf *b, PyObject *d, PyObject *fallback)
{
    if (d == Py_None || (PyDict_Check(d) && PyDict_Size(d) == 0))
        return jputs(b, "{}");
    if (!PyDict_Check(d))
        return jput_fallback(b, d, fallback);
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v))
        if (!PyUnicode_Check(k))
            return jput_fallback(b, d, fallback);
    pos = 0;
    int first = 1;
    if (jput(b, "{", 1) < 0)
        return -1;
    while (PyDict_Next(d, &pos, &k, &v)) {
        if ((!first && jput(b, ",", 1) < 0) || jput_str(b, k, fallback) < 0 || jput(b, ":", 1) < 0 ||
            jput_value(b, v, fallback) < 0)
            return -1;
        first = 0;
    }
    return jput(b, "}", 1);
}

static int jput_text(struct jbuf *b, PyObject *s)
{
    Py_ssize_t n;
    const char *p = PyUnicode_AsUTF8AndSize(s, &n);
    return p ? jput(b, p, (size_t)n) : -1;
}

/* The events of a flow span: each (name, time_ns, attributes or None), or its JSON text. */
static int jput_events(struct jbuf *b, PyObject *events, PyObject *fallback)
{
    if (events == Py_None || !PyList_Check(events) || PyList_Size(events) == 0)
        return jputs(b, "[]");
    if (jput(b, "[", 1) < 0)
        return -1;
    Py_ssize_t n = PyList_Size(events);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GetItem(events, i);
        if (i && jput(b, ",", 1) < 0)
            return -1;
        if (PyUnicode_Check(e)) {
            if (jput_text(b, e) < 0)
                return -1;
            continue;
        }
        if (!PyTuple_Check(e) || PyTuple_Size(e) != 3) {
            PyErr_SetString(PyExc_TypeError, "span_lines: an event is (name, time_ns, attributes) or its JSON text");
            return -1;
        }
        if (jputs(b, "{\"name\":") < 0 || jput_str(b, PyTuple_GetItem(e, 0), fallback) < 0 ||
            jputs(b, ",\"time_ns\":") < 0 || jput_value(b, PyTuple_GetItem(e, 1), fallback) < 0 ||
            jputs(b, ",\"attributes\":") < 0 || jput_dict(b, PyTuple_GetItem(e, 2), fallback) < 0 ||
            jput(b, "}", 1) < 0)
            return -1;
    }
    return jput(b, "]", 1);
}

/* One entry of JsonLinesSink.put: (name, trace_id, span_id, parent, start_ns, end_ns, attributes,
 * events, links) (span_id a str: the caller makes one for None; parent and links JSON text),
 * appended to b as its line; resource the resource's JSON text. 0, or -1 with an exception set. */
static int span_entry(struct jbuf *b, PyObject *entry, PyObject *resource, PyObject *fallback)
{
    if (!PyTuple_Check(entry) || PyTuple_Size(entry) != 9) {
        PyErr_SetString(PyExc_TypeError, "span_lines: entry must be a tuple of 9 items");
        return -1;
    }
    return jputs(b, "{\"name\":") < 0 || jput_str(b, PyTuple_GetItem(entry, 0), fallback) < 0 ||
                   jputs(b, ",\"trace_id\":\"") < 0 || jput_text(b, PyTuple_GetItem(entry, 1)) < 0 ||
                   jputs(b, "\",\"span_id\":\"") < 0 || jput_text(b, PyTuple_GetItem(entry, 2)) < 0 ||
                   jputs(b, "\",\"parent_span_id\":") < 0 || jput_text(b, PyTuple_GetItem(entry, 3)) < 0 ||
                   jputs(b, ",\"kind\":\"INTERNAL\",\"start_ns\":") < 0 ||
                   jput_value(b, PyTuple_GetItem(entry, 4), fallback) < 0 || jputs(b, ",\"end_ns\":") < 0 ||
                   jput_value(b, PyTuple_GetItem(entry, 5), fallback) < 0 || jputs(b, ",\"attributes\":") < 0 ||
                   jput_dict(b, PyTuple_GetItem(entry, 6), fallback) < 0 || jputs(b, ",\"events\":") < 0 ||
                   jput_events(b, PyTuple_GetItem(entry, 7), fallback) < 0 || jputs(b, ",\"links\":") < 0 ||
                   jput_text(b, PyTuple_GetItem(entry, 8)) < 0 ||
                   jputs(b, ",\"status\":\"UNSET\",\"resource\":") < 0 || jput_text(b, resource) < 0 ||
                   jputs(b, "}\n") < 0
               ? -1
               : 0;
}

/* span_lines(entries, resource, fallback) -> (bytes, lines): a batch of the writer, in order, as
 * one bytes object: each entry a span of JsonLinesSink.put (span_entry: one line) or a
 * (bytes, lines) pair of lines already formatted (TcpEngine.trace_json's), copied as they are. */
PyObject *tj_span_lines(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *entries, *resource, *fallback;
    if (!PyArg_ParseTuple(args, "O!UO", &PyList_Type, &entries, &resource, &fallback))
        return NULL;
    struct jbuf b = {NULL, 0, 0};
    Py_ssize_t lines = 0;
    Py_ssize_t n = PyList_Size(entries);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *e = PyList_GetItem(entries, i);
        if (PyTuple_Check(e) && PyTuple_Size(e) == 2) {
            PyObject *text = PyTuple_GetItem(e, 0);
            Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GetItem(e, 1));
            if (!PyBytes_Check(text) || k < 0) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_TypeError, "span_lines: a text entry is (bytes, lines >= 0)");
                goto fail;
            }
            if (jput(&b, PyBytes_AsString(text), (size_t)PyBytes_Size(text)) < 0)
                goto fail;
            lines += k;
        } else {
            if (span_entry(&b, e, resource, fallback) < 0)
                goto fail;
            lines++;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(b.p ? b.p : "", (Py_ssize_t)b.n);
    PyMem_Free(b.p);
    return out ? Py_BuildValue("(Nn)", out, lines) : NULL;
fail:
    PyMem_Free(b.p);
    return NULL;
}
