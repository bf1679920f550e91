/*
 * epp.wire._fast: the read path of an HTTP/2 connection (epp/wire/http2.py), with the one message
 * that dominates a streamed LLM response answered in C.
 *
 * With Envoy's ext_proc response body mode FULL_DUPLEX_STREAMED, every SSE event of a response is a
 * DATA frame carrying a ProcessingRequest{response_body: HttpBody{body}}, to be answered with a
 * ProcessingResponse{response_body: BodyResponse{response: CommonResponse{body_mutation:
 * BodyMutation{streamed_response: StreamedBodyResponse{body}}}}} carrying the same bytes. Woken once
 * per such message, a Python handler paid ~40-60 us of CPU per chunk on a busy 2-core machine, most
 * of it the interpreter's cold caches, not its instructions (see epp/extproc/processor.py,
 * "Transport"). Here:
 *
 *   ConnectionBase.data_received(data): no Python bytecode runs for a read that holds only such
 *   frames. Every complete frame is looked at in order; a DATA frame on a stream whose echo is on
 *   (StreamBase.echo), holding exactly one whole uncompressed gRPC message that is a non-empty
 *   response body chunk without end_of_stream, is answered here: the answer's frame goes to the
 *   connection's out list, the chunk is tallied on its stream (bytes, and the last few chunks, for
 *   the usage read at the end), windows are accounted both ways. Any other frame is handed to the
 *   Python method _frame(data, position) and the loop goes on where it says. A frame not yet whole
 *   goes to _keep(data, position). What is in out is written once at the end (_flush); then, if
 *   after_pending is set, _run_after() runs what the read's answers were not to wait for.
 *   ConnectionBase.frames(data, position) is the same loop, for the Python side's reads (after the
 *   preface, or a buffered partial frame).
 *
 * A stream Envoy's observability mode sends (epp envoy-config --observe-responses) reads no answer:
 * with its echo OBSERVE its chunks (which all carry observability_mode) are tallied the same way and
 * answered with nothing, and the I/O thread reads a connection of such streams in batches (below).
 *
 * What a stream's echo does not take (the first body chunk: its response-start signal; the last:
 * end_of_stream and the usage; an empty chunk; anything with other fields; a message split over
 * frames, and every frame of that stream until the message is whole, since one of them could read
 * as a message of its own; a frame over our 1 MiB maximum, which Python refuses; an answer the
 * peer's windows or frame size cannot take now) goes to Python, which answers it the same way. The
 * answer's bytes are exactly what upb serializes for the same message (tests/wire/test_fast.py).
 *
 * The I/O thread (below) gives the same answers to a connection lent to it: echo_core is the one
 * function both call, and it uses no Python API (the kept tail of chunks is plain memory for that).
 *
 * TLS (TlsTransport, below): a TLS port's records are decrypted and encrypted here too, so that a TLS
 * connection's chunks take the same C path, and its session can go with it to the I/O thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include "structmember.h"

#define MAX_TAIL 16
/* StreamBase.echo: what C does with a stream's response body chunks (see the member) */
#define ECHO 1
#define OBSERVE 2
#define IDLE 3
#define HALF_WINDOW (((int64_t)1 << 30) - 1) /* (2^31 - 1) / 2: top a receive window up past this */

/* ---- StreamBase: one stream's windows and its response tally ------------------------------------ */

typedef struct {
    char *data;
    size_t size;
} Piece;

typedef struct {
    PyObject_HEAD
    long long window;         /* what we may still send (the peer's window for this stream) */
    long long received;       /* bytes received since our last WINDOW_UPDATE for it */
    long long response_bytes; /* response body bytes seen, by C and Python alike */
    long long chunks;         /* response body chunks seen */
    int echo;                 /* ECHO: non-empty response body chunks are answered in C; OBSERVE: taken in C,
                               * unanswered (an observability-mode stream); IDLE: nothing but its end is
                               * expected (a routed stream whose response phase Envoy skips) */
    int tail_cap, tail_start, tail_len;
    Piece tail[MAX_TAIL];     /* copies of the last chunks, oldest first from tail_start (a ring); plain
                               * memory, so that the I/O thread can keep them without the GIL */
} StreamBase;

/* Keep a copy of a chunk among the last few; -1 if out of memory (nothing changed). No Python API:
 * the I/O thread calls it too. */
static int tail_push(StreamBase *self, const char *data, size_t size) {
    if (self->tail_cap <= 0) return 0;
    char *copy = malloc(size ? size : 1);
    if (copy == NULL) return -1;
    memcpy(copy, data, size);
    if (self->tail_len < self->tail_cap) {
        Piece *slot = &self->tail[(self->tail_start + self->tail_len) % self->tail_cap];
        slot->data = copy;
        slot->size = size;
        self->tail_len++;
    } else {
        Piece *slot = &self->tail[self->tail_start];
        free(slot->data);
        slot->data = copy;
        slot->size = size;
        self->tail_start = (self->tail_start + 1) % self->tail_cap;
    }
    return 0;
}

static void tail_clear(StreamBase *self) {
    for (int i = 0; i < self->tail_len; i++) {
        Piece *slot = &self->tail[(self->tail_start + i) % self->tail_cap];
        free(slot->data);
        slot->data = NULL;
    }
    self->tail_len = 0;
    self->tail_start = 0;
}

static void stream_dealloc(StreamBase *self) {
    tail_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int stream_init(StreamBase *self, PyObject *args, PyObject *kwds) {
    self->tail_cap = 4;
    return 0;
}

static PyObject *stream_tally(StreamBase *self, PyObject *chunk) {
    if (!PyBytes_Check(chunk)) {
        PyErr_SetString(PyExc_TypeError, "tally() takes bytes");
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(chunk);
    if (size > 0) {
        if (tail_push(self, PyBytes_AS_STRING(chunk), (size_t)size) < 0) return PyErr_NoMemory();
        self->response_bytes += size;
        self->chunks++;
    }
    Py_RETURN_NONE;
}

static PyObject *stream_get_tail(StreamBase *self, PyObject *unused) {
    PyObject *list = PyList_New(self->tail_len);
    if (list == NULL) return NULL;
    for (int i = 0; i < self->tail_len; i++) {
        Piece *slot = &self->tail[(self->tail_start + i) % self->tail_cap];
        PyObject *chunk = PyBytes_FromStringAndSize(slot->data, (Py_ssize_t)slot->size);
        if (chunk == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, chunk);
    }
    return list;
}

static PyObject *stream_keep_tail(StreamBase *self, PyObject *arg) {
    long cap = PyLong_AsLong(arg);
    if (cap == -1 && PyErr_Occurred()) return NULL;
    if (cap < 0 || cap > MAX_TAIL) {
        PyErr_Format(PyExc_ValueError, "keep_tail() takes 0 to %d chunks", MAX_TAIL);
        return NULL;
    }
    tail_clear(self);
    self->tail_cap = (int)cap;
    Py_RETURN_NONE;
}

static PyMethodDef stream_methods[] = {
    {"tally", (PyCFunction)stream_tally, METH_O, "Count a response body chunk and keep it among the last few."},
    {"tail", (PyCFunction)stream_get_tail, METH_NOARGS, "The last chunks tallied, oldest first."},
    {"keep_tail", (PyCFunction)stream_keep_tail, METH_O, "How many of the last chunks to keep (0-16; default 4)."},
    {NULL},
};

static PyMemberDef stream_members[] = {
    {"window", T_LONGLONG, offsetof(StreamBase, window), 0, "the peer's flow-control window for this stream"},
    {"received", T_LONGLONG, offsetof(StreamBase, received), 0, "bytes received since our last WINDOW_UPDATE"},
    {"response_bytes", T_LONGLONG, offsetof(StreamBase, response_bytes), READONLY, "response body bytes tallied"},
    {"response_chunks", T_LONGLONG, offsetof(StreamBase, chunks), READONLY, "response body chunks tallied"},
    {"echo", T_INT, offsetof(StreamBase, echo), 0,
     "0: Python's; 1: answer non-empty response body chunks in C; 2: take them unanswered; 3: idle"},
    {NULL},
};

static PyTypeObject StreamBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "epp.wire._fast.StreamBase",
    .tp_basicsize = sizeof(StreamBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE, /* it holds no Python object (subclasses may) */
    .tp_doc = "One HTTP/2 stream's flow-control windows and its response body tally.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)stream_init,
    .tp_dealloc = (destructor)stream_dealloc,
    .tp_methods = stream_methods,
    .tp_members = stream_members,
};

/* ---- ConnectionBase ----------------------------------------------------------------------------- */

typedef struct {
    unsigned char *data;
    size_t len, cap;
} Buffer;

static int buf_reserve(Buffer *b, size_t more) {
    if (b->cap - b->len >= more) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap - b->len < more) cap *= 2;
    unsigned char *data = realloc(b->data, cap);
    if (data == NULL) return -1;
    b->data = data;
    b->cap = cap;
    return 0;
}

/* A connection is lent only with at most this many answered (ECHO) streams open: past that its reads
 * carry several chunks each, which the loop answers as cheaply, and it would be handed back and forth
 * at every new stream and last chunk (measured with 64: 16 streams cost more; epp/extproc/processor.py).
 * Idle streams (a routed request's, when Envoy observes its response on another stream) do not count
 * toward it, up to LEND_MAX_OPEN streams in all; nor does a connection of observed streams only, which
 * is lent with up to LEND_MAX_OPEN of them: nothing is answered there, and the thread reads it in
 * coalescing windows where the loop read it at every wake-up (16 observed 1,024-event streams on one
 * connection: 3.3 against 23.7 µs of picker CPU a chunk; epp/extproc/processor.py). */
#define LEND_MAX_STREAMS 4
#define LEND_MAX_OPEN 32
/* A connection is lent only once each open stream has had this many response chunks: a lend and its
 * hand-back cost about two wake-ups of the event loop, which a short stream's chunks do not repay
 * (measured: bench/routing_quality.py's 16-token streams cost the picker 7-15% more CPU when lent at
 * their first chunk; see epp/extproc/processor.py, "Transport"). */
#define LEND_AFTER_CHUNKS 32

typedef struct {
    PyObject_HEAD
    PyObject *streams;  /* dict: stream id (int) -> Stream (a StreamBase) */
    PyObject *out;      /* list of bytes to write at the end of the read */
    PyObject *transport; /* the asyncio transport, None until made and once closed */
    long long window;   /* what we may still send on the connection */
    long long received; /* bytes received since our last connection WINDOW_UPDATE */
    long long max_frame;
    int plain;          /* 1: preface read, nothing buffered, no header block pending: frames can be read as they come */
    int reading;        /* 1: inside a read (answers are written at its end) */
    int closed;         /* 1: nothing more is written */
    int flush_scheduled; /* 1: a _flush is due soon (a write outside a read) */
    int after_pending;  /* 1: work waits for the end of this read, after its write (_run_after) */
    /* Lending to the I/O thread (see "The I/O thread" below); all under io_mutex. */
    int lend_ok;        /* 1: this connection may be lent (plaintext, a socket of its own) */
    int lent;           /* 0 Python's; 1 the thread's; 2 handed back, waiting for Python's reclaim */
    int fd;
    uint32_t slot;
    int paused;         /* 1: its socket is out of the thread's epoll until the coalescing window ends */
    int n_lent;
    uint32_t lent_ids[LEND_MAX_OPEN];
    StreamBase *lent_streams[LEND_MAX_OPEN]; /* strong references while lent */
    Buffer in;          /* bytes the thread read and has not answered (a partial frame, or what it hands back) */
    Buffer unsent;      /* answers the thread could not write (the socket was full): Python writes them first;
                         * on a TLS connection they are TLS records already */
    SSL *tls;           /* while a TLS connection is lent: its session, which the thread then reads and writes */
    PyObject *tls_owner; /* while lent: the TlsTransport that owns tls (a strong reference) */
    int tls_end;        /* the thread read the TLS session's end: 1 the peer's close_notify, -1 an error */
    unsigned long long lends, thread_chunks; /* counters, for tests and benchmarks */
} ConnectionBase;

static PyObject *str_frame, *str_keep, *str_slow, *str_error, *str_write, *str_writelines, *str_lend, *str_run_after;

static int conn_traverse(ConnectionBase *self, visitproc visit, void *arg) {
    Py_VISIT(self->streams);
    Py_VISIT(self->out);
    Py_VISIT(self->transport);
    return 0;
}

static int conn_clear(ConnectionBase *self) {
    Py_CLEAR(self->streams);
    Py_CLEAR(self->out);
    Py_CLEAR(self->transport);
    return 0;
}

static void conn_dealloc(ConnectionBase *self) {
    PyObject_GC_UnTrack(self);
    conn_clear(self);
    free(self->in.data);
    free(self->unsent.data);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int conn_init(ConnectionBase *self, PyObject *args, PyObject *kwds) {
    Py_XSETREF(self->streams, PyDict_New());
    Py_XSETREF(self->out, PyList_New(0));
    if (self->streams == NULL || self->out == NULL) return -1;
    Py_INCREF(Py_None);
    Py_XSETREF(self->transport, Py_None);
    self->window = 65535;
    self->max_frame = 16384;
    self->fd = -1;
    return 0;
}

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* A protobuf varint at p (at most `end`); the number of bytes read, 0 if malformed or > 2^32. */
static inline int varint(const unsigned char *p, const unsigned char *end, uint64_t *value) {
    uint64_t v = 0;
    for (int i = 0; i < 5 && p + i < end; i++) {
        v |= (uint64_t)(p[i] & 0x7F) << (7 * i);
        if (!(p[i] & 0x80)) {
            *value = v;
            return i + 1;
        }
    }
    return 0;
}

static inline int varint_size(uint64_t v) {
    int n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline unsigned char *put_varint(unsigned char *p, uint64_t v) {
    while (v >= 0x80) {
        *p++ = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    *p++ = (unsigned char)v;
    return p;
}

/* If msg is a ProcessingRequest whose response_body(5) is HttpBody{body(1) non-empty} and nothing
 * else, the chunk's offset and length (1); else 0. Besides response_body, the message may carry
 * metadata_context(8), attributes(9) and protocol_config(11), which the response phase does not read
 * (Envoy sends an empty metadata_context with every body chunk), and on an observed stream (observed:
 * Envoy's observability mode) must carry observability_mode(10) true; any other field is Python's. */
static int response_chunk(const unsigned char *msg, size_t size, size_t *offset, size_t *length, int observed) {
    const unsigned char *end = msg + size, *p = msg;
    int found = 0, flagged = 0;
    while (p < end) {
        unsigned char tag = *p++;
        uint64_t n;
        int k = varint(p, end, &n);
        if (!k) return 0;
        if (tag == 0x50) { /* observability_mode: true, which an observed stream's chunks all carry */
            if (!observed || n != 1) return 0;
            flagged = 1;
            p += k;
            continue;
        }
        if ((size_t)(end - (p + k)) < n) return 0;
        p += k;
        if (tag == 0x2A && !found) { /* response_body: HttpBody{body} exactly */
            const unsigned char *body = p, *body_end = p + n;
            uint64_t m;
            if (n < 2 || *body != 0x0A) return 0;
            body++;
            int j = varint(body, body_end, &m);
            if (!j || m == 0 || (size_t)(body_end - (body + j)) != m) return 0;
            *offset = (size_t)(body + j - msg);
            *length = (size_t)m;
            found = 1;
        } else if (tag != 0x42 && tag != 0x4A && tag != 0x5A) {
            return 0;
        }
        p += n;
    }
    return found && flagged == observed;
}

/* Write the answer for a chunk of `n` bytes at `body` (frame header, gRPC prefix, message) to dst;
 * returns the bytes written. `size` must be answer_size(n). */
static size_t answer_size(size_t n, size_t *message) {
    size_t s = 1 + varint_size(n) + n;   /* StreamedBodyResponse{body} */
    size_t bm = 1 + varint_size(s) + s;  /* BodyMutation{streamed_response(3)} */
    size_t cr = 1 + varint_size(bm) + bm; /* CommonResponse{body_mutation(3)} */
    size_t br = 1 + varint_size(cr) + cr; /* BodyResponse{response(1)} */
    size_t pr = 1 + varint_size(br) + br; /* ProcessingResponse{response_body(4)} */
    *message = pr;
    return 9 + 5 + pr;
}

static void write_answer(unsigned char *p, uint32_t stream_id, const unsigned char *body, size_t n, size_t message) {
    size_t payload = 5 + message;
    size_t s = 1 + varint_size(n) + n;
    size_t bm = 1 + varint_size(s) + s;
    size_t cr = 1 + varint_size(bm) + bm;
    size_t br = 1 + varint_size(cr) + cr;
    /* DATA frame header: length (24 bits), type 0, flags 0, stream id */
    *p++ = (unsigned char)(payload >> 16);
    *p++ = (unsigned char)(payload >> 8);
    *p++ = (unsigned char)payload;
    *p++ = 0;
    *p++ = 0;
    *p++ = (unsigned char)(stream_id >> 24);
    *p++ = (unsigned char)(stream_id >> 16);
    *p++ = (unsigned char)(stream_id >> 8);
    *p++ = (unsigned char)stream_id;
    /* gRPC message prefix: uncompressed, length */
    *p++ = 0;
    *p++ = (unsigned char)(message >> 24);
    *p++ = (unsigned char)(message >> 16);
    *p++ = (unsigned char)(message >> 8);
    *p++ = (unsigned char)message;
    *p++ = 0x22;
    p = put_varint(p, br);
    *p++ = 0x0A;
    p = put_varint(p, cr);
    *p++ = 0x1A;
    p = put_varint(p, bm);
    *p++ = 0x1A;
    p = put_varint(p, s);
    *p++ = 0x0A;
    p = put_varint(p, n);
    memcpy(p, body, n);
}

/* A WINDOW_UPDATE frame onto out, whose room the caller reserved. */
static void put_window_update(Buffer *out, uint32_t stream_id, long long increment) {
    unsigned char frame[13] = {0, 0, 4, 8, 0,
                               (unsigned char)(stream_id >> 24), (unsigned char)(stream_id >> 16),
                               (unsigned char)(stream_id >> 8), (unsigned char)stream_id,
                               (unsigned char)(increment >> 24), (unsigned char)(increment >> 16),
                               (unsigned char)(increment >> 8), (unsigned char)increment};
    memcpy(out->data + out->len, frame, 13);
    out->len += 13;
}

/* Answer the DATA frame at `frame` (payload of `length` bytes) of `stream` if C may: its answer (and
 * any WINDOW_UPDATE due) appended to out, the chunk tallied, the windows accounted; 1 done, 0 not for
 * C (nothing changed). No Python API: the I/O thread runs it without the GIL, the read path with it. */
static int echo_core(ConnectionBase *self, StreamBase *stream, const unsigned char *frame, size_t length, Buffer *out) {
    uint8_t flags = frame[4];
    uint32_t stream_id = be32(frame + 5) & 0x7FFFFFFF;
    const unsigned char *payload = frame + 9;
    if (flags & 0x09) return 0; /* END_STREAM or PADDED: Python's */
    if (length < 5 || payload[0] != 0 || be32(payload + 1) != length - 5) return 0;
    int observed = stream->echo == OBSERVE;
    if ((stream->echo != ECHO && !observed) || stream->response_bytes == 0) return 0;
    size_t offset = 0, n = 0;
    if (!response_chunk(payload + 5, length - 5, &offset, &n, observed)) return 0;
    const unsigned char *body = payload + 5 + offset;
    if (observed) { /* Envoy ignores answers here: the chunk is tallied, nothing is sent but windows */
        if (buf_reserve(out, 26) < 0) return 0;
        if (tail_push(stream, (const char *)body, n) < 0) return 0;
    } else {
        size_t message;
        size_t size = answer_size(n, &message);
        long long sent = (long long)(5 + message);
        if (sent > self->max_frame || sent > stream->window || sent > self->window) return 0;
        if (buf_reserve(out, size + 26) < 0) return 0; /* the answer and two WINDOW_UPDATEs */
        if (tail_push(stream, (const char *)body, n) < 0) return 0;
        write_answer(out->data + out->len, stream_id, body, n, message);
        out->len += size;
        stream->window -= sent;
        self->window -= sent;
    }
    stream->response_bytes += (long long)n;
    stream->chunks++;
    /* The frame counts against our receive windows; top them up past half (room reserved above). */
    self->received += (long long)length;
    if (self->received > HALF_WINDOW) {
        put_window_update(out, 0, self->received);
        self->received = 0;
    }
    stream->received += (long long)length;
    if (stream->received > HALF_WINDOW) {
        put_window_update(out, stream_id, stream->received);
        stream->received = 0;
    }
    return 1;
}

static Buffer read_out; /* the read path's answers (under the GIL) */

/* The read path's echo: the stream looked up in the dict; the answer goes to the out list. */
static int echo_frame(ConnectionBase *self, PyObject *data, const unsigned char *frame, size_t length) {
    uint32_t stream_id = be32(frame + 5) & 0x7FFFFFFF;
    PyObject *key = PyLong_FromUnsignedLong(stream_id);
    if (key == NULL) return -1;
    PyObject *item = PyDict_GetItemWithError(self->streams, key); /* borrowed */
    Py_DECREF(key);
    if (item == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyObject_TypeCheck(item, &StreamBaseType)) return 0;
    read_out.len = 0;
    if (!echo_core(self, (StreamBase *)item, frame, length, &read_out)) return 0;
    PyObject *answer = PyBytes_FromStringAndSize((const char *)read_out.data, (Py_ssize_t)read_out.len);
    if (answer == NULL) return -1;
    int rc = PyList_Append(self->out, answer);
    Py_DECREF(answer);
    return rc < 0 ? -1 : 1;
}

/* The frames of data from position on; the position of the first frame not yet whole, or -1. */
static Py_ssize_t run_frames(ConnectionBase *self, PyObject *data, Py_ssize_t position) {
    const unsigned char *buffer = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    while (size - position >= 9) {
        const unsigned char *frame = buffer + position;
        size_t length = ((size_t)frame[0] << 16) | ((size_t)frame[1] << 8) | frame[2];
        if ((Py_ssize_t)(9 + length) > size - position) {
            if (length > (1u << 20)) break; /* too large: Python says so */
            return position;
        }
        if (frame[3] == 0 && self->plain && length <= (1u << 20)) { /* an oversized DATA frame: Python refuses it */
            int done = echo_frame(self, data, frame, length);
            if (done < 0) return -1;
            if (done) {
                position += 9 + (Py_ssize_t)length;
                continue;
            }
        }
        PyObject *pos = PyLong_FromSsize_t(position);
        if (pos == NULL) return -1;
        PyObject *next = PyObject_CallMethodObjArgs((PyObject *)self, str_frame, data, pos, NULL);
        Py_DECREF(pos);
        if (next == NULL) return -1;
        Py_ssize_t value = PyLong_AsSsize_t(next);
        Py_DECREF(next);
        if (value == -1 && PyErr_Occurred()) return -1;
        if (value < 0) return size; /* the connection is done with (an error, closed) */
        position = value;
    }
    if (size - position >= 9) { /* an oversized frame header: let Python read it and fail */
        PyObject *pos = PyLong_FromSsize_t(position);
        if (pos == NULL) return -1;
        PyObject *next = PyObject_CallMethodObjArgs((PyObject *)self, str_frame, data, pos, NULL);
        Py_DECREF(pos);
        if (next == NULL) return -1;
        Py_DECREF(next);
        return size;
    }
    return position;
}

/* ---- TLS in C: TlsTransport ------------------------------------------------------------------------
 *
 * On a TLS port (--secure-serving=true, upstream's default) the records of a connection are decrypted
 * and encrypted here, with OpenSSL on memory BIOs, instead of by uvloop's SSL protocol and Python's
 * ssl objects (~30 us more per message at one stream, measured: bench/streaming_cost.py --tls). A
 * TlsTransport sits between uvloop's plain transport of the socket and the Connection: to uvloop it is
 * the protocol (data_received: the records in; the plaintext goes on to the Connection's C read path
 * without Python code), to the Connection it is the transport (write, writelines: the plaintext out,
 * as records, one write of uvloop's per call). Because the session is plain C state, a lent TLS
 * connection's records are the I/O thread's to read and write too (io_serve), like a plaintext one's.
 *
 * The session comes from the server's ssl.SSLContext (its SSL_CTX, so certificates, protocols,
 * ciphers and ALPN "h2" are exactly what Python configured), which is used only where tls_usable()
 * checked that this module and Python's ssl module run the same OpenSSL and that the context's
 * SSL_CTX reads back the context's own options; else the server keeps uvloop's TLS. The Connection is
 * made (factory()) only once the handshake is done; on_ready(transport, None or the error's text) is
 * called once, when the handshake ends either way.
 */

typedef struct {
    PyObject_HEAD
    SSL_CTX *ctx;
} SSLContextHead; /* the start of CPython's PySSLContext (Modules/_ssl.c): the SSL_CTX comes first */

static PyTypeObject *sslcontext_type; /* _ssl._SSLContext, once tls_usable() found it */

typedef struct {
    PyObject_HEAD
    SSL *ssl;
    PyObject *context;  /* the ssl.SSLContext (for get_extra_info, and to keep its SSL_CTX alive) */
    PyObject *factory;  /* makes the protocol once the handshake is done (cleared then) */
    PyObject *on_ready; /* called once the handshake ends (cleared then) */
    PyObject *raw;      /* uvloop's transport of the socket; None before connection_made and after lost */
    PyObject *protocol; /* the Connection, once made */
    int state;          /* 0 handshaking, 1 open, 2 closing or closed by this side, 3 lost */
    int ended;          /* the session's end was read (1 close_notify, -1 an error); when the I/O thread
                         * read it, the Connection acts on it once what the thread read before is handled */
} TlsTransport;

static PyTypeObject TlsTransportType, ConnectionBaseType;
static PyObject *conn_data_received(ConnectionBase *self, PyObject *data);
static PyObject *tls_close(TlsTransport *self, PyObject *unused);
static PyObject *tls_abort(TlsTransport *self, PyObject *unused);
static PyObject *str_connection_made, *str_connection_lost, *str_data_received, *str_close, *str_abort,
    *str_get_extra_info, *str_pause_writing, *str_resume_writing;

/* Decrypt what the session's read BIO holds onto b: 0 all read (more records needed), 1 the peer's
 * close_notify, -1 an error (left on OpenSSL's error queue for the caller) or out of memory. No
 * Python API: the I/O thread calls it too. */
static int tls_decrypt(SSL *ssl, Buffer *b) {
    for (;;) {
        if (buf_reserve(b, 16384 + 256) < 0) return -1;
        size_t room = b->cap - b->len;
        int n = SSL_read(ssl, b->data + b->len, room > INT32_MAX ? INT32_MAX : (int)room);
        if (n > 0) {
            b->len += (size_t)n;
            /* All read (the usual case: one record per read): no SSL_read just to be told so. */
            if (BIO_ctrl_pending(SSL_get_rbio(ssl)) == 0 && SSL_pending(ssl) == 0) return 0;
            continue;
        }
        int error = SSL_get_error(ssl, n);
        if (error == SSL_ERROR_WANT_READ) {
            ERR_clear_error();
            return 0;
        }
        return error == SSL_ERROR_ZERO_RETURN ? 1 : -1;
    }
}

/* The text of OpenSSL's first queued error (the queue emptied), or `fallback`. */
static PyObject *tls_error_text(const char *fallback) {
    unsigned long code = ERR_get_error();
    ERR_clear_error();
    if (code == 0) return PyUnicode_FromString(fallback);
    char text[256];
    ERR_error_string_n(code, text, sizeof text);
    return PyUnicode_FromString(text);
}

/* Write what the session's write BIO holds to the socket's transport (one write); -1 on error. */
static int tls_flush(TlsTransport *self) {
    BIO *wbio = SSL_get_wbio(self->ssl);
    size_t pending = BIO_ctrl_pending(wbio);
    if (pending == 0) return 0;
    PyObject *records = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)pending);
    if (records == NULL) return -1;
    int got = BIO_read(wbio, PyBytes_AS_STRING(records), (int)pending);
    if (got != (int)pending || self->raw == Py_None) {
        Py_DECREF(records);
        return 0; /* (a memory BIO reads back what it holds; no socket: nothing to write to) */
    }
    PyObject *result = PyObject_CallMethodOneArg(self->raw, str_write, records);
    Py_DECREF(records);
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

static int tls_traverse(TlsTransport *self, visitproc visit, void *arg) {
    Py_VISIT(self->context);
    Py_VISIT(self->factory);
    Py_VISIT(self->on_ready);
    Py_VISIT(self->raw);
    Py_VISIT(self->protocol);
    return 0;
}

static int tls_clear(TlsTransport *self) {
    Py_CLEAR(self->context);
    Py_CLEAR(self->factory);
    Py_CLEAR(self->on_ready);
    Py_CLEAR(self->raw);
    Py_CLEAR(self->protocol);
    return 0;
}

static void tls_dealloc(TlsTransport *self) {
    PyObject_GC_UnTrack(self);
    tls_clear(self);
    if (self->ssl != NULL) SSL_free(self->ssl); /* (frees its BIOs) */
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int tls_init(TlsTransport *self, PyObject *args, PyObject *kwds) {
    PyObject *context, *factory, *on_ready;
    if (!PyArg_ParseTuple(args, "OOO", &context, &factory, &on_ready)) return -1;
    if (sslcontext_type == NULL || !PyObject_TypeCheck(context, sslcontext_type)) {
        PyErr_SetString(PyExc_TypeError, "TlsTransport() takes an ssl.SSLContext that tls_usable() accepted");
        return -1;
    }
    if (self->ssl != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "TlsTransport is initialized once");
        return -1;
    }
    SSL *ssl = SSL_new(((SSLContextHead *)context)->ctx);
    BIO *rbio = BIO_new(BIO_s_mem()), *wbio = BIO_new(BIO_s_mem());
    if (ssl == NULL || rbio == NULL || wbio == NULL) {
        if (ssl != NULL) SSL_free(ssl);
        if (rbio != NULL) BIO_free(rbio);
        if (wbio != NULL) BIO_free(wbio);
        ERR_clear_error();
        PyErr_NoMemory();
        return -1;
    }
    BIO_set_mem_eof_return(rbio, -1); /* an empty read BIO means "more to come", not the end */
    BIO_set_mem_eof_return(wbio, -1);
    SSL_set_bio(ssl, rbio, wbio);
    SSL_set_accept_state(ssl);
    SSL_set_mode(ssl, SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER | SSL_MODE_AUTO_RETRY);
    self->ssl = ssl;
    Py_INCREF(context);
    Py_XSETREF(self->context, context);
    Py_INCREF(factory);
    Py_XSETREF(self->factory, factory);
    Py_INCREF(on_ready);
    Py_XSETREF(self->on_ready, on_ready);
    Py_INCREF(Py_None);
    Py_XSETREF(self->raw, Py_None);
    return 0;
}

/* The handshake ended (error: None, or its text): on_ready is called, once. */
static int tls_ready(TlsTransport *self, PyObject *error) {
    PyObject *on_ready = self->on_ready;
    if (on_ready == NULL) return 0;
    self->on_ready = NULL;
    PyObject *result = PyObject_CallFunctionObjArgs(on_ready, (PyObject *)self, error, NULL);
    Py_DECREF(on_ready);
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

static PyObject *tls_raw_call(TlsTransport *self, PyObject *name) {
    if (self->raw == Py_None) Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs(self->raw, name);
}

/* -- the protocol side (uvloop calls these) -- */

static PyObject *tls_connection_made(TlsTransport *self, PyObject *raw) {
    Py_INCREF(raw);
    Py_XSETREF(self->raw, raw);
    Py_RETURN_NONE;
}

static Buffer tls_plain; /* the loop's decrypted bytes of one read (under the GIL) */

static PyObject *tls_data_received(TlsTransport *self, PyObject *data) {
    if (self->state >= 2) Py_RETURN_NONE;
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return NULL;
    int fed = view.len == 0 || BIO_write(SSL_get_rbio(self->ssl), view.buf, (int)view.len) == (int)view.len;
    PyBuffer_Release(&view);
    if (!fed) {
        ERR_clear_error();
        return PyErr_NoMemory();
    }
    if (self->state == 0) {
        int done = SSL_do_handshake(self->ssl);
        int error = done == 1 ? SSL_ERROR_NONE : SSL_get_error(self->ssl, done);
        if (tls_flush(self) < 0) return NULL; /* our handshake messages, or the alert of a failure */
        if (error == SSL_ERROR_WANT_READ) {
            ERR_clear_error();
            Py_RETURN_NONE;
        }
        if (error != SSL_ERROR_NONE) {
            PyObject *text = tls_error_text("the TLS handshake failed");
            if (text == NULL) return NULL;
            self->state = 2;
            PyObject *closed = tls_raw_call(self, str_close);
            Py_XDECREF(closed);
            int rc = closed == NULL ? -1 : tls_ready(self, text);
            Py_DECREF(text);
            if (rc < 0) return NULL;
            Py_RETURN_NONE;
        }
        self->state = 1;
        PyObject *factory = self->factory;
        self->factory = NULL;
        PyObject *protocol = PyObject_CallNoArgs(factory);
        Py_DECREF(factory);
        if (protocol == NULL) return NULL;
        Py_XSETREF(self->protocol, protocol);
        PyObject *result = PyObject_CallMethodOneArg(protocol, str_connection_made, (PyObject *)self);
        if (result == NULL) return NULL;
        Py_DECREF(result);
        if (tls_ready(self, Py_None) < 0) return NULL;
        if (self->state != 1) Py_RETURN_NONE; /* closed by connection_made or on_ready */
    }
    tls_plain.len = 0;
    int end = tls_decrypt(self->ssl, &tls_plain);
    if (end != 0) {
        ERR_clear_error();
        self->ended = end; /* so that reading what came before cannot lend the session to the thread */
    }
    if (tls_flush(self) < 0) return NULL; /* what reading asked to send (a KeyUpdate's answer, say) */
    if (tls_plain.len > 0 && self->protocol != NULL) {
        PyObject *plain = PyBytes_FromStringAndSize((const char *)tls_plain.data, (Py_ssize_t)tls_plain.len);
        if (plain == NULL) return NULL;
        PyObject *protocol = self->protocol, *result;
        Py_INCREF(protocol);
        if (PyObject_TypeCheck(protocol, &ConnectionBaseType))
            result = conn_data_received((ConnectionBase *)protocol, plain);
        else
            result = PyObject_CallMethodOneArg(protocol, str_data_received, plain);
        Py_DECREF(protocol);
        Py_DECREF(plain);
        if (result == NULL) return NULL;
        Py_DECREF(result);
    }
    if (end != 0 && self->state == 1) {
        /* The peer's close_notify (its end, as an EOF: ours, and the transport closes), or records that
         * do not decrypt (the connection is aborted); the protocol's connection_lost follows either way. */
        PyObject *result = end > 0 ? tls_close(self, NULL) : tls_abort(self, NULL);
        if (result == NULL) return NULL;
        Py_DECREF(result);
    }
    Py_RETURN_NONE;
}

static PyObject *tls_eof_received(TlsTransport *self, PyObject *unused) {
    Py_RETURN_NONE; /* (falsy: uvloop closes the transport) */
}

static PyObject *tls_connection_lost(TlsTransport *self, PyObject *exc) {
    self->state = 3;
    PyObject *protocol = self->protocol, *raw = self->raw;
    self->protocol = NULL;
    Py_INCREF(Py_None);
    self->raw = Py_None;
    Py_XDECREF(raw);
    Py_CLEAR(self->factory);
    int rc = 0;
    if (protocol != NULL) {
        PyObject *result = PyObject_CallMethodOneArg(protocol, str_connection_lost, exc);
        Py_DECREF(protocol);
        if (result == NULL) return NULL;
        Py_DECREF(result);
    } else {
        PyObject *text = exc == Py_None ? PyUnicode_FromString("the peer closed the connection during the handshake")
                                        : PyObject_Str(exc);
        if (text == NULL) return NULL;
        rc = tls_ready(self, text);
        Py_DECREF(text);
    }
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tls_forward_protocol(TlsTransport *self, PyObject *name) {
    if (self->protocol == NULL) Py_RETURN_NONE;
    return PyObject_CallMethodNoArgs(self->protocol, name);
}

static PyObject *tls_pause_writing(TlsTransport *self, PyObject *unused) {
    return tls_forward_protocol(self, str_pause_writing);
}

static PyObject *tls_resume_writing(TlsTransport *self, PyObject *unused) {
    return tls_forward_protocol(self, str_resume_writing);
}

/* -- the transport side (the Connection calls these) -- */

static int tls_encrypt(TlsTransport *self, PyObject *data) {
    Py_buffer view;
    if (PyObject_GetBuffer(data, &view, PyBUF_SIMPLE) < 0) return -1;
    const char *p = view.buf;
    Py_ssize_t left = view.len;
    while (left > 0) {
        int n = SSL_write(self->ssl, p, left > INT32_MAX ? INT32_MAX : (int)left);
        if (n <= 0) {
            PyBuffer_Release(&view);
            PyObject *text = tls_error_text("TLS write failed");
            if (text != NULL) {
                PyErr_SetObject(PyExc_OSError, text);
                Py_DECREF(text);
            }
            return -1;
        }
        p += n;
        left -= n;
    }
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *tls_write(TlsTransport *self, PyObject *data) {
    if (self->state != 1) Py_RETURN_NONE; /* closing or lost: nothing more goes out (as a closed transport) */
    if (tls_encrypt(self, data) < 0 || tls_flush(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tls_writelines(TlsTransport *self, PyObject *pieces) {
    if (self->state != 1) Py_RETURN_NONE;
    PyObject *iterator = PyObject_GetIter(pieces);
    if (iterator == NULL) return NULL;
    PyObject *piece;
    while ((piece = PyIter_Next(iterator)) != NULL) {
        int rc = tls_encrypt(self, piece);
        Py_DECREF(piece);
        if (rc < 0) {
            Py_DECREF(iterator);
            return NULL;
        }
    }
    Py_DECREF(iterator);
    if (PyErr_Occurred() || tls_flush(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *tls_write_raw(TlsTransport *self, PyObject *records) {
    if (self->state != 1 || self->raw == Py_None) Py_RETURN_NONE;
    return PyObject_CallMethodOneArg(self->raw, str_write, records);
}

static PyObject *tls_close(TlsTransport *self, PyObject *unused) {
    if (self->state == 1) {
        SSL_shutdown(self->ssl); /* our close_notify (the peer's is not waited for) */
        ERR_clear_error();
        if (tls_flush(self) < 0) return NULL;
    }
    if (self->state < 2) self->state = 2;
    return tls_raw_call(self, str_close);
}

static PyObject *tls_abort(TlsTransport *self, PyObject *unused) {
    if (self->state < 2) self->state = 2;
    return tls_raw_call(self, str_abort);
}

static PyObject *tls_is_closing(TlsTransport *self, PyObject *unused) {
    if (self->state >= 2 || self->raw == Py_None) Py_RETURN_TRUE;
    return PyObject_CallMethod(self->raw, "is_closing", NULL);
}

static PyObject *tls_pause_reading(TlsTransport *self, PyObject *unused) {
    if (self->raw == Py_None) Py_RETURN_NONE;
    return PyObject_CallMethod(self->raw, "pause_reading", NULL);
}

static PyObject *tls_resume_reading(TlsTransport *self, PyObject *unused) {
    if (self->raw == Py_None) Py_RETURN_NONE;
    return PyObject_CallMethod(self->raw, "resume_reading", NULL);
}

static PyObject *tls_get_write_buffer_size(TlsTransport *self, PyObject *unused) {
    if (self->raw == Py_None) return PyLong_FromLong(0);
    return PyObject_CallMethod(self->raw, "get_write_buffer_size", NULL);
}

static PyObject *tls_get_extra_info(TlsTransport *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"name", "default", NULL};
    PyObject *name, *fallback = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "U|O", names, &name, &fallback)) return NULL;
    if (PyUnicode_CompareWithASCIIString(name, "sslcontext") == 0) {
        Py_INCREF(self->context);
        return self->context;
    }
    if (PyUnicode_CompareWithASCIIString(name, "cipher") == 0 && self->state == 1) {
        const SSL_CIPHER *cipher = SSL_get_current_cipher(self->ssl);
        if (cipher != NULL)
            return Py_BuildValue("(ssi)", SSL_CIPHER_get_name(cipher), SSL_get_version(self->ssl),
                                 SSL_CIPHER_get_bits(cipher, NULL));
    }
    if (PyUnicode_CompareWithASCIIString(name, "alpn_protocol") == 0 && self->state >= 1) {
        const unsigned char *protocol = NULL;
        unsigned int length = 0;
        SSL_get0_alpn_selected(self->ssl, &protocol, &length);
        if (length) return PyUnicode_FromStringAndSize((const char *)protocol, length);
    }
    if (self->raw == Py_None) {
        Py_INCREF(fallback);
        return fallback;
    }
    return PyObject_CallMethodObjArgs(self->raw, str_get_extra_info, name, fallback, NULL);
}

static PyMethodDef tls_methods[] = {
    {"connection_made", (PyCFunction)tls_connection_made, METH_O, "(protocol side) the socket's transport"},
    {"data_received", (PyCFunction)tls_data_received, METH_O, "(protocol side) records in: the handshake, then plaintext to the protocol"},
    {"eof_received", (PyCFunction)tls_eof_received, METH_NOARGS, "(protocol side) the peer's end: close"},
    {"connection_lost", (PyCFunction)tls_connection_lost, METH_O, "(protocol side) the socket is gone"},
    {"pause_writing", (PyCFunction)tls_pause_writing, METH_NOARGS, "(protocol side) passed on to the protocol"},
    {"resume_writing", (PyCFunction)tls_resume_writing, METH_NOARGS, "(protocol side) passed on to the protocol"},
    {"write", (PyCFunction)tls_write, METH_O, "Encrypt and send."},
    {"writelines", (PyCFunction)tls_writelines, METH_O, "Encrypt each piece; send them in one write."},
    {"write_raw", (PyCFunction)tls_write_raw, METH_O, "Send TLS records as they are (what the I/O thread encrypted)."},
    {"close", (PyCFunction)tls_close, METH_NOARGS, "Send close_notify and close the socket (without waiting for the peer's)."},
    {"abort", (PyCFunction)tls_abort, METH_NOARGS, "Close the socket now."},
    {"is_closing", (PyCFunction)tls_is_closing, METH_NOARGS, "True once closing or lost."},
    {"pause_reading", (PyCFunction)tls_pause_reading, METH_NOARGS, "Stop reading the socket."},
    {"resume_reading", (PyCFunction)tls_resume_reading, METH_NOARGS, "Read the socket again."},
    {"get_write_buffer_size", (PyCFunction)tls_get_write_buffer_size, METH_NOARGS, "Bytes waiting to be sent."},
    {"get_extra_info", (PyCFunction)(void (*)(void))tls_get_extra_info, METH_VARARGS | METH_KEYWORDS,
     "sslcontext, cipher and alpn_protocol from the session; anything else from the socket's transport."},
    {NULL},
};

static PyMemberDef tls_members[] = {
    {"ended", T_INT, offsetof(TlsTransport, ended), READONLY,
     "the I/O thread read the session's end: 1 the peer's close_notify, -1 records that do not decrypt"},
    {NULL},
};

static PyTypeObject TlsTransportType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "epp.wire._fast.TlsTransport",
    .tp_basicsize = sizeof(TlsTransport),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "TlsTransport(context, factory, on_ready): TLS in C between uvloop's socket transport and a Connection.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)tls_init,
    .tp_dealloc = (destructor)tls_dealloc,
    .tp_traverse = (traverseproc)tls_traverse,
    .tp_clear = (inquiry)tls_clear,
    .tp_methods = tls_methods,
    .tp_members = tls_members,
};

/* tls_usable(context): whether TlsTransport can serve this ssl.SSLContext (see above). */
static PyObject *tls_usable(PyObject *module, PyObject *context) {
    if (sslcontext_type == NULL) {
        PyObject *ssl_module = PyImport_ImportModule("_ssl");
        if (ssl_module == NULL) return NULL;
        PyObject *type = PyObject_GetAttrString(ssl_module, "_SSLContext");
        PyObject *version = PyObject_GetAttrString(ssl_module, "OPENSSL_VERSION_NUMBER");
        Py_DECREF(ssl_module);
        if (type == NULL || version == NULL) {
            Py_XDECREF(type);
            Py_XDECREF(version);
            return NULL;
        }
        unsigned long theirs = PyLong_AsUnsignedLong(version);
        Py_DECREF(version);
        if (!PyType_Check(type) || theirs != OpenSSL_version_num()) { /* another OpenSSL: never */
            Py_DECREF(type);
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        sslcontext_type = (PyTypeObject *)type; /* (kept for the process) */
    }
    if (!PyObject_TypeCheck(context, sslcontext_type)) Py_RETURN_FALSE;
    PyObject *options = PyObject_GetAttrString(context, "options");
    if (options == NULL) return NULL;
    unsigned long long expected = PyLong_AsUnsignedLongLong(options);
    Py_DECREF(options);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    SSL_CTX *ctx = ((SSLContextHead *)context)->ctx;
    if (ctx == NULL || (unsigned long long)SSL_CTX_get_options(ctx) != expected) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* ---- The I/O thread ------------------------------------------------------------------------------
 *
 * One native thread per process, started at the first lend, with its own epoll and an eventfd to the
 * event loop. A connection is lent to it (ConnectionBase.lend) when every open stream echoes (at most
 * LEND_MAX_STREAMS of them, or LEND_MAX_OPEN observed ones, each past LEND_AFTER_CHUNKS): uvloop stops
 * reading the socket, this thread reads it, and answers the middle chunks (echo_core) without the GIL
 * and without waking the event loop. The first frame it cannot answer (anything but such a
 * chunk: a new stream's HEADERS, the last chunk, a WINDOW_UPDATE, a PING, ...), the peer's end or an
 * error, or an answer the socket cannot take now, hands the connection back: the socket leaves this
 * epoll, the connection goes on the returned list, and the eventfd wakes the loop, which reclaims it
 * (ConnectionBase.reclaim: the bytes not answered, to be read as a read of its own, and the answers
 * not written, to be written first) and reads the socket again. Python also reclaims a lent connection
 * before it touches it at all (a send, a finish, a GOAWAY, a close: epp/wire/http2.py), so that the
 * connection's state has one owner at a time, handed over under io_mutex.
 *
 * io_mutex is held by the thread while it serves the events of one epoll_wait, and by Python while it
 * lends or reclaims. The thread never takes the GIL, so Python may wait for io_mutex holding it. A
 * stale event (a connection reclaimed after epoll_wait returned it) is told by the slot's generation.
 */

typedef struct {
    ConnectionBase *conn;
    uint32_t gen;
} Slot;

static long long lend_after = LEND_AFTER_CHUNKS; /* (tests lower it: set_lend_after) */
/* Observed connections (every lent stream OBSERVE: nobody waits for what the thread reads there) are
 * read at most this often: once the thread has served one, it leaves the thread's epoll (its
 * registration kept, waiting for no event) until the window ends, and what came meanwhile is read in
 * one wake-up; while it keeps streaming, the thread reads it at each window's end without watching
 * it in between. Their response ends (handed back) come up to this late; any other connection is
 * served at once, a new lend included (set_observe_coalesce). */
static long observe_coalesce_us = 5000;
static struct timespec io_resume; /* when the paused connections are watched again (0: none is paused) */


static pthread_mutex_t io_mutex = PTHREAD_MUTEX_INITIALIZER;
static int io_epoll = -1, io_event = -1;
static pid_t io_pid = 0;
static Slot *io_slots;
static uint32_t io_slots_len;
static ConnectionBase **io_returned;
static size_t io_returned_len, io_returned_cap;

static void give_back(ConnectionBase *c) {
    epoll_ctl(io_epoll, EPOLL_CTL_DEL, c->fd, NULL);
    c->lent = 2;
    io_returned[io_returned_len++] = c; /* (room reserved at the lend: one place per slot) */
}

/* Serve one readable lent connection; 1 if it was handed back (the loop must be woken). */
static Buffer io_records; /* the thread's: TLS records read, then TLS records to send */

/* Read the socket of a lent connection onto c->in (decrypted, for TLS): 1 read, 0 nothing to read
 * now, -1 the peer's end or an error (what was read before it is on c->in: answered, then handed back). */
static int io_read(ConnectionBase *c) {
    Buffer *to = c->tls == NULL ? &c->in : &io_records;
    if (c->tls != NULL) io_records.len = 0;
    if (buf_reserve(to, 65536) < 0) return -1;
    ssize_t got;
    do {
        got = recv(c->fd, to->data + to->len, to->cap - to->len, MSG_DONTWAIT);
    } while (got < 0 && errno == EINTR);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
    if (got <= 0) return -1; /* the peer's end, or an error: Python's transport sees it once it reads again */
    if (c->tls == NULL) {
        c->in.len += (size_t)got;
        return 1;
    }
    if (BIO_write(SSL_get_rbio(c->tls), io_records.data, (int)got) != (int)got) {
        ERR_clear_error();
        return -1;
    }
    int end = tls_decrypt(c->tls, &c->in);
    if (end != 0) {
        ERR_clear_error();
        c->tls_end = end;
        return -1;
    }
    return 1;
}

/* Serve one readable lent connection; 1 if it was handed back (the loop must be woken). */
static int io_serve(ConnectionBase *c, Buffer *out) {
    int got = io_read(c);
    if (got == 0) return 0;
    if (got < 0 && c->in.len == 0) {
        give_back(c);
        return 1;
    }
    out->len = 0;
    size_t position = 0;
    int back = got < 0;
    while (c->in.len - position >= 9) {
        const unsigned char *frame = c->in.data + position;
        size_t length = ((size_t)frame[0] << 16) | ((size_t)frame[1] << 8) | frame[2];
        if (length > (1u << 20)) { /* Python refuses it */
            back = 1;
            break;
        }
        StreamBase *stream = NULL;
        if (frame[3] == 0 && !(frame[4] & 0x09)) { /* DATA, neither END_STREAM nor PADDED */
            uint32_t id = be32(frame + 5) & 0x7FFFFFFF;
            for (int i = 0; i < c->n_lent; i++)
                if (c->lent_ids[i] == id) stream = c->lent_streams[i];
        }
        if (stream == NULL) { /* Python's, whole or not: handed back without waiting for the rest */
            back = 1;
            break;
        }
        if (9 + length > c->in.len - position) break; /* not yet whole */
        if (!echo_core(c, stream, frame, length, out)) {
            back = 1;
            break;
        }
        c->thread_chunks++;
        position += 9 + length;
    }
    if (position) {
        memmove(c->in.data, c->in.data + position, c->in.len - position);
        c->in.len -= position;
    }
    const unsigned char *send_data = out->data;
    size_t send_len = out->len;
    if (c->tls != NULL) { /* the answers as TLS records (and whatever else the session has to send) */
        if (out->len > 0 && SSL_write(c->tls, out->data, (int)out->len) != (int)out->len) {
            ERR_clear_error();
            back = 1; /* (a memory BIO takes any write: only a broken session fails here) */
        }
        io_records.len = 0;
        size_t pending = BIO_ctrl_pending(SSL_get_wbio(c->tls));
        if (pending > 0 && buf_reserve(&io_records, pending) == 0 &&
            BIO_read(SSL_get_wbio(c->tls), io_records.data, (int)pending) == (int)pending)
            io_records.len = pending;
        send_data = io_records.data;
        send_len = io_records.len;
    }
    size_t written = 0;
    while (written < send_len) {
        ssize_t n = send(c->fd, send_data + written, send_len - written, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        written += (size_t)n;
    }
    if (written < send_len) { /* the socket is full (or failed): Python's transport takes the rest */
        if (buf_reserve(&c->unsent, send_len - written) == 0) {
            memcpy(c->unsent.data + c->unsent.len, send_data + written, send_len - written);
            c->unsent.len += send_len - written;
        }
        back = 1;
    }
    if (back) give_back(c);
    return back;
}

static int observed_only(ConnectionBase *c) {
    for (int j = 0; j < c->n_lent; j++)
        if (c->lent_streams[j]->echo != OBSERVE) return 0;
    return c->n_lent > 0;
}

/* Leave c unread until the window ends (its registration waits for no event: the caller's io_watch). */
static void io_pause(ConnectionBase *c) {
    c->paused = 1;
    if (io_resume.tv_sec == 0 && io_resume.tv_nsec == 0) {
        clock_gettime(CLOCK_MONOTONIC, &io_resume);
        io_resume.tv_nsec += observe_coalesce_us * 1000;
        io_resume.tv_sec += io_resume.tv_nsec / 1000000000;
        io_resume.tv_nsec %= 1000000000;
    }
}

static void io_watch(ConnectionBase *c, uint32_t events) {
    struct epoll_event event = {.events = events};
    event.data.u64 = (uint64_t)c->slot | ((uint64_t)io_slots[c->slot].gen << 32);
    epoll_ctl(io_epoll, EPOLL_CTL_MOD, c->fd, &event);
}

/* The epoll_wait timeout, in ms, until the paused connections are watched again (-1: none is). */
static int io_timeout(void) {
    if (io_resume.tv_sec == 0 && io_resume.tv_nsec == 0) return -1;
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    long long ns = (io_resume.tv_sec - now.tv_sec) * 1000000000LL + (io_resume.tv_nsec - now.tv_nsec);
    return ns <= 0 ? 0 : (int)((ns + 999999) / 1000000);
}

static void *io_main(void *arg) {
    int epoll = (int)(intptr_t)arg;
    pthread_setname_np(pthread_self(), "epp-io");
    struct epoll_event events[64];
    Buffer out = {0};
    for (;;) {
        pthread_mutex_lock(&io_mutex);
        int timeout = io_timeout();
        pthread_mutex_unlock(&io_mutex);
        int n = epoll_wait(epoll, events, 64, timeout);
        if (n < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        int wake = 0;
        pthread_mutex_lock(&io_mutex);
        if (io_timeout() == 0) { /* the window is over: what the paused connections got meanwhile is read */
            io_resume.tv_sec = io_resume.tv_nsec = 0;
            for (uint32_t i = 0; i < io_slots_len; i++) {
                ConnectionBase *c = io_slots[i].conn;
                if (c == NULL || !c->paused) continue;
                c->paused = 0;
                if (c->lent != 1) continue;
                unsigned long long chunks = c->thread_chunks;
                size_t kept = c->in.len;
                wake |= io_serve(c, &out);
                if (c->lent != 1) continue;
                if (c->thread_chunks != chunks || c->in.len != kept) io_pause(c); /* still streaming */
                else io_watch(c, EPOLLIN); /* quiet: woken by its next bytes */
            }
        }
        for (int i = 0; i < n; i++) {
            uint32_t slot = (uint32_t)events[i].data.u64, gen = (uint32_t)(events[i].data.u64 >> 32);
            if (slot >= io_slots_len || io_slots[slot].gen != gen) continue; /* reclaimed meanwhile */
            ConnectionBase *c = io_slots[slot].conn;
            if (c == NULL || c->lent != 1) continue; /* (a paused one here: its peer's hang-up, or an error) */
            wake |= io_serve(c, &out);
            if (c->lent == 1 && observe_coalesce_us > 0 && observed_only(c)) {
                io_watch(c, 0); /* read again once the window is over (see observe_coalesce_us) */
                io_pause(c);
            }
        }
        pthread_mutex_unlock(&io_mutex);
        if (wake) {
            uint64_t one = 1;
            ssize_t rc = write(io_event, &one, sizeof one);
            (void)rc;
        }
    }
}

/* Start the thread in this process (again after a fork: the parent's thread is not in the child). */
static int io_start(void) {
    if (io_pid == getpid()) return 0;
    pthread_mutex_init(&io_mutex, NULL);
    io_slots = NULL; /* a parent's entries, if forked, are the parent's: forgotten, not freed */
    io_slots_len = 0;
    io_returned = NULL;
    io_returned_len = io_returned_cap = 0;
    int epoll = epoll_create1(EPOLL_CLOEXEC);
    if (epoll < 0) return -1;
    int event = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (event < 0) {
        close(epoll);
        return -1;
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    pthread_t thread;
    int rc = pthread_create(&thread, &attr, io_main, (void *)(intptr_t)epoll);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        close(epoll);
        close(event);
        errno = rc;
        return -1;
    }
    io_epoll = epoll;
    io_event = event;
    io_pid = getpid();
    return 0;
}

/* The connection may be lent now: not lent or closed, no partial frame or header block, at most
 * LEND_MAX_OPEN streams open, of which at least one echoes or is observed, every such stream past
 * lend_after chunks, the rest idle; and at most LEND_MAX_STREAMS busy ones unless none of them is
 * answered (a connection of observed streams only). */
static int lendable(ConnectionBase *self) {
    if (self->lent || self->closed || !self->plain) return 0;
    if (Py_TYPE(self->transport) == &TlsTransportType) { /* an open session whose end nobody read yet */
        TlsTransport *tls = (TlsTransport *)self->transport;
        if (tls->state != 1 || tls->ended) return 0;
    }
    Py_ssize_t count = PyDict_GET_SIZE(self->streams);
    if (count == 0 || count > LEND_MAX_OPEN) return 0;
    Py_ssize_t position = 0;
    PyObject *key, *value;
    int busy = 0; /* streams with chunks to take: lending a connection of idle streams only would pay nothing */
    int answered = 0; /* of them, streams whose chunks are answered (ECHO) */
    while (PyDict_Next(self->streams, &position, &key, &value)) {
        if (!PyObject_TypeCheck(value, &StreamBaseType)) return 0;
        StreamBase *stream = (StreamBase *)value;
        if (stream->echo == IDLE) continue;
        if ((stream->echo != ECHO && stream->echo != OBSERVE) || stream->chunks < lend_after) return 0;
        busy++;
        answered += stream->echo == ECHO;
    }
    return busy > 0 && (busy <= LEND_MAX_STREAMS || answered == 0);
}

/* lend(fd, loop_epoll=-1): give the connection to the I/O thread if every open stream echoes; True if
 * lent. loop_epoll: the event loop's own epoll (uvloop's libuv backend), in which the socket's
 * registration is then disabled (see below). */
static PyObject *conn_lend(ConnectionBase *self, PyObject *args) {
    long fd, loop_epoll = -1;
    if (!PyArg_ParseTuple(args, "l|l", &fd, &loop_epoll)) return NULL;
    if (!lendable(self) || PyList_GET_SIZE(self->out) > 0) Py_RETURN_FALSE;
    if (io_start() < 0) return PyErr_SetFromErrno(PyExc_OSError);
    pthread_mutex_lock(&io_mutex);
    uint32_t slot = 0;
    while (slot < io_slots_len && io_slots[slot].conn != NULL) slot++;
    if (slot == io_slots_len) {
        Slot *slots = realloc(io_slots, (io_slots_len + 16) * sizeof *slots);
        if (slots == NULL) {
            pthread_mutex_unlock(&io_mutex);
            return PyErr_NoMemory();
        }
        memset(slots + io_slots_len, 0, 16 * sizeof *slots);
        io_slots = slots;
        io_slots_len += 16;
    }
    if (io_returned_cap < io_slots_len) { /* room for every lent connection: give_back never allocates */
        ConnectionBase **list = realloc(io_returned, io_slots_len * sizeof *list);
        if (list == NULL) {
            pthread_mutex_unlock(&io_mutex);
            return PyErr_NoMemory();
        }
        io_returned = list;
        io_returned_cap = io_slots_len;
    }
    int n = 0;
    Py_ssize_t position = 0;
    PyObject *key, *value;
    while (PyDict_Next(self->streams, &position, &key, &value)) {
        StreamBase *stream = (StreamBase *)value;
        unsigned long id = PyLong_AsUnsignedLong(key);
        if (id == (unsigned long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            id = 0; /* not a stream id: no frame will name it */
        }
        Py_INCREF(stream);
        self->lent_ids[n] = (uint32_t)id;
        self->lent_streams[n++] = stream;
    }
    self->n_lent = n;
    if (Py_TYPE(self->transport) == &TlsTransportType) { /* the session goes with the socket */
        Py_INCREF(self->transport);
        self->tls_owner = self->transport;
        self->tls = ((TlsTransport *)self->transport)->ssl;
        self->tls_end = 0;
    }
    self->fd = (int)fd;
    self->slot = slot;
    self->in.len = 0;
    self->unsent.len = 0;
    io_slots[slot].conn = self;
    struct epoll_event event = {.events = EPOLLIN};
    event.data.u64 = (uint64_t)slot | ((uint64_t)io_slots[slot].gen << 32);
    self->lent = 1;
    self->paused = 0;
    if (epoll_ctl(io_epoll, EPOLL_CTL_ADD, (int)fd, &event) < 0) {
        int error = errno;
        self->lent = 0;
        io_slots[slot].conn = NULL;
        io_slots[slot].gen++;
        self->n_lent = 0;
        PyObject *owner = self->tls_owner;
        self->tls_owner = NULL;
        self->tls = NULL;
        pthread_mutex_unlock(&io_mutex);
        for (int i = 0; i < n; i++) Py_DECREF(self->lent_streams[i]);
        Py_XDECREF(owner);
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_INCREF(self); /* the thread's reference, until reclaimed */
    self->lends++;
    pthread_mutex_unlock(&io_mutex);
    if (loop_epoll >= 0) {
        /* libuv's pause_reading leaves the socket in its epoll until it next fires there (it removes
         * the registration then): the event loop would wake once for the thread's first read, for
         * nothing. Registered for no event, it is not woken; libuv's resume_reading re-adds the socket
         * either way (ADD, or MOD where the ADD finds it registered), so its state stays its own. */
        struct epoll_event quiet = {.events = 0};
        quiet.data.fd = (int)fd;
        epoll_ctl((int)loop_epoll, EPOLL_CTL_MOD, (int)fd, &quiet); /* (not registered: nothing to quiet) */
    }
    Py_RETURN_TRUE;
}

/* reclaim(): take the connection back from the thread: None if it was not lent, else (unsent,
 * unread): the answers the thread could not write and the bytes it did not answer. */
static PyObject *conn_reclaim(ConnectionBase *self, PyObject *unused) {
    if (!self->lent) Py_RETURN_NONE; /* (only Python lends: no lock needed to see it was not) */
    pthread_mutex_lock(&io_mutex);
    if (self->lent == 1) epoll_ctl(io_epoll, EPOLL_CTL_DEL, self->fd, NULL);
    for (size_t i = 0; i < io_returned_len; i++) {
        if (io_returned[i] == self) {
            io_returned[i] = io_returned[--io_returned_len];
            break;
        }
    }
    io_slots[self->slot].conn = NULL;
    io_slots[self->slot].gen++;
    self->lent = 0;
    int n = self->n_lent;
    StreamBase *streams[LEND_MAX_OPEN];
    memcpy(streams, self->lent_streams, (size_t)n * sizeof streams[0]);
    self->n_lent = 0;
    PyObject *unsent = PyBytes_FromStringAndSize((const char *)self->unsent.data, (Py_ssize_t)self->unsent.len);
    PyObject *unread = PyBytes_FromStringAndSize((const char *)self->in.data, (Py_ssize_t)self->in.len);
    self->unsent.len = 0;
    self->in.len = 0;
    PyObject *owner = self->tls_owner;
    self->tls_owner = NULL;
    self->tls = NULL;
    if (owner != NULL && self->tls_end) ((TlsTransport *)owner)->ended = self->tls_end;
    self->tls_end = 0;
    pthread_mutex_unlock(&io_mutex);
    for (int i = 0; i < n; i++) Py_DECREF(streams[i]);
    Py_XDECREF(owner);
    PyObject *result = NULL;
    if (unsent != NULL && unread != NULL) result = PyTuple_Pack(2, unsent, unread);
    Py_XDECREF(unsent);
    Py_XDECREF(unread);
    Py_DECREF(self); /* the thread's reference (the caller holds another) */
    return result;
}

/* returned(): the connections the thread handed back since the last call (each still to reclaim). */
static PyObject *io_take_returned(PyObject *module, PyObject *unused) {
    if (io_pid != getpid()) return PyList_New(0);
    pthread_mutex_lock(&io_mutex);
    PyObject *list = PyList_New((Py_ssize_t)io_returned_len);
    if (list != NULL) {
        for (size_t i = 0; i < io_returned_len; i++) {
            Py_INCREF(io_returned[i]);
            PyList_SET_ITEM(list, (Py_ssize_t)i, (PyObject *)io_returned[i]);
        }
        io_returned_len = 0;
    }
    pthread_mutex_unlock(&io_mutex);
    return list;
}

/* set_lend_after(n): lend a connection once each open stream has had n chunks (the default 32); the
 * previous value. For tests and measurements. */
static PyObject *io_set_lend_after(PyObject *module, PyObject *arg) {
    long long n = PyLong_AsLongLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    long long previous = lend_after;
    lend_after = n < 1 ? 1 : n;
    return PyLong_FromLongLong(previous);
}

/* set_observe_coalesce(us): how often at most the thread reads connections whose lent streams are all
 * observed (0: at once); the previous value. */
static PyObject *io_set_observe_coalesce(PyObject *module, PyObject *arg) {
    long us = PyLong_AsLong(arg);
    if (us == -1 && PyErr_Occurred()) return NULL;
    long previous = observe_coalesce_us;
    observe_coalesce_us = us < 0 ? 0 : us > 1000000 ? 1000000 : us;
    return PyLong_FromLong(previous);
}

/* event_fd(): the eventfd the thread signals when it hands a connection back (starts the thread). */
static PyObject *io_event_fd(PyObject *module, PyObject *unused) {
    if (io_start() < 0) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(io_event);
}

/* At the end of a read: if the connection may be lent and every open stream echoes, ask Python's
 * _lend (which knows the transport); -1 on error. */
static int maybe_lend(ConnectionBase *self) {
    if (!self->lend_ok || !lendable(self)) return 0;
    PyObject *result = PyObject_CallMethodNoArgs((PyObject *)self, str_lend);
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

/* Write what is in out (one write, or writelines for several pieces), then empty it. */
static PyObject *conn_flush(ConnectionBase *self, PyObject *unused) {
    self->flush_scheduled = 0;
    Py_ssize_t n = PyList_GET_SIZE(self->out);
    if (n == 0) Py_RETURN_NONE;
    if (self->closed || self->transport == Py_None) return PyList_SetSlice(self->out, 0, n, NULL) < 0 ? NULL : (Py_INCREF(Py_None), Py_None);
    PyObject *result;
    if (n == 1) {
        result = PyObject_CallMethodOneArg(self->transport, str_write, PyList_GET_ITEM(self->out, 0));
    } else {
        PyObject *pieces = PyList_GetSlice(self->out, 0, n);
        if (pieces == NULL) return NULL;
        result = PyObject_CallMethodOneArg(self->transport, str_writelines, pieces);
        Py_DECREF(pieces);
    }
    if (PyList_SetSlice(self->out, 0, n, NULL) < 0) {
        Py_XDECREF(result);
        return NULL;
    }
    return result == NULL ? NULL : (Py_DECREF(result), Py_INCREF(Py_None), Py_None);
}

static PyObject *conn_frames(ConnectionBase *self, PyObject *args) {
    PyObject *data;
    Py_ssize_t position;
    if (!PyArg_ParseTuple(args, "O!n", &PyBytes_Type, &data, &position)) return NULL;
    Py_ssize_t next = run_frames(self, data, position);
    if (next < 0) return NULL;
    return PyLong_FromSsize_t(next);
}

static PyObject *conn_data_received(ConnectionBase *self, PyObject *data) {
    if (!self->plain || !PyBytes_Check(data)) return PyObject_CallMethodOneArg((PyObject *)self, str_slow, data);
    self->reading = 1;
    Py_ssize_t next = run_frames(self, data, 0);
    self->reading = 0;
    if (next < 0) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        PyErr_NormalizeException(&type, &value, &traceback);
        if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
        PyObject *result = PyObject_CallMethodOneArg((PyObject *)self, str_error, value ? value : Py_None);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        if (result == NULL) return NULL;
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    if (next < PyBytes_GET_SIZE(data)) {
        PyObject *pos = PyLong_FromSsize_t(next);
        if (pos == NULL) return NULL;
        PyObject *result = PyObject_CallMethodObjArgs((PyObject *)self, str_keep, data, pos, NULL);
        Py_DECREF(pos);
        if (result == NULL) return NULL;
        Py_DECREF(result);
    }
    if (PyList_GET_SIZE(self->out) > 0) {
        PyObject *result = conn_flush(self, NULL);
        if (result == NULL) return NULL;
        Py_DECREF(result);
    }
    if (self->after_pending) { /* what the read's answers did not wait for: now that they are written */
        PyObject *result = PyObject_CallMethodNoArgs((PyObject *)self, str_run_after);
        if (result == NULL) return NULL;
        Py_DECREF(result);
    }
    if (self->lend_ok && maybe_lend(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *conn_check_lend(ConnectionBase *self, PyObject *unused) {
    if (maybe_lend(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef conn_methods[] = {
    {"data_received", (PyCFunction)conn_data_received, METH_O,
     "asyncio.Protocol.data_received: read the frames, answering response body chunks of echoing streams in C."},
    {"_flush", (PyCFunction)conn_flush, METH_NOARGS, "Write what is in out, then empty it."},
    {"lend", (PyCFunction)conn_lend, METH_VARARGS,
     "lend(fd, loop_epoll=-1) -> True if the connection is now the I/O thread's (every open stream echoes); see _fast.c."},
    {"reclaim", (PyCFunction)conn_reclaim, METH_NOARGS,
     "Take a lent connection back: None if it was not lent, else (unsent answers, unread bytes)."},
    {"_check_lend", (PyCFunction)conn_check_lend, METH_NOARGS, "Lend the connection if it may be (calls _lend)."},
    {"frames", (PyCFunction)conn_frames, METH_VARARGS,
     "frames(data, position) -> the position of the first frame not yet whole; the same loop as data_received."},
    {NULL},
};

static PyMemberDef conn_members[] = {
    {"streams", T_OBJECT_EX, offsetof(ConnectionBase, streams), READONLY, "stream id -> Stream"},
    {"out", T_OBJECT_EX, offsetof(ConnectionBase, out), READONLY, "what is written at the end of the read"},
    {"window", T_LONGLONG, offsetof(ConnectionBase, window), 0, "the peer's window for the connection"},
    {"received", T_LONGLONG, offsetof(ConnectionBase, received), 0, "bytes received since our last WINDOW_UPDATE"},
    {"max_frame", T_LONGLONG, offsetof(ConnectionBase, max_frame), 0, "the peer's SETTINGS_MAX_FRAME_SIZE"},
    {"plain", T_INT, offsetof(ConnectionBase, plain), 0, "1: frames are read as they come (see the module)"},
    {"reading", T_INT, offsetof(ConnectionBase, reading), 0, "1: inside a read"},
    {"closed", T_INT, offsetof(ConnectionBase, closed), 0, "1: nothing more is written"},
    {"flush_scheduled", T_INT, offsetof(ConnectionBase, flush_scheduled), 0, "1: a _flush is due soon"},
    {"after_pending", T_INT, offsetof(ConnectionBase, after_pending), 0,
     "1: _run_after is called at the end of this read, after its write"},
    {"transport", T_OBJECT, offsetof(ConnectionBase, transport), 0, "the asyncio transport (None until made)"},
    {"lend_ok", T_INT, offsetof(ConnectionBase, lend_ok), 0, "1: the connection may be lent to the I/O thread"},
    {"lent", T_INT, offsetof(ConnectionBase, lent), READONLY, "0 Python's, 1 the I/O thread's, 2 handed back"},
    {"lends", T_ULONGLONG, offsetof(ConnectionBase, lends), READONLY, "how many times it was lent"},
    {"thread_chunks", T_ULONGLONG, offsetof(ConnectionBase, thread_chunks), READONLY,
     "response body chunks the I/O thread answered"},
    {NULL},
};

static PyTypeObject ConnectionBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "epp.wire._fast.ConnectionBase",
    .tp_basicsize = sizeof(ConnectionBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "The read path of an HTTP/2 connection, with ext_proc response body chunks answered in C.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)conn_init,
    .tp_dealloc = (destructor)conn_dealloc,
    .tp_traverse = (traverseproc)conn_traverse,
    .tp_clear = (inquiry)conn_clear,
    .tp_methods = conn_methods,
    .tp_members = conn_members,
};

/* For tests: the answer C would send for a chunk, without the frame header. */
static PyObject *echo_answer(PyObject *module, PyObject *chunk) {
    if (!PyBytes_Check(chunk)) {
        PyErr_SetString(PyExc_TypeError, "echo_answer() takes bytes");
        return NULL;
    }
    size_t n = (size_t)PyBytes_GET_SIZE(chunk), message;
    size_t size = answer_size(n, &message);
    PyObject *frame = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (frame == NULL) return NULL;
    write_answer((unsigned char *)PyBytes_AS_STRING(frame), 1, (const unsigned char *)PyBytes_AS_STRING(chunk), n, message);
    PyObject *result = PyBytes_FromStringAndSize(PyBytes_AS_STRING(frame) + 14, (Py_ssize_t)message);
    Py_DECREF(frame);
    return result;
}

/* ---- Header maps -------------------------------------------------------------------------------
 *
 * header_map(message, field): the headers of a serialized ProcessingRequest's HttpHeaders at `field`
 * (request_headers 2, response_headers 3) as a dict, as epp.extproc.answers.headers_of makes it from
 * the parsed message: {key: raw_value decoded as UTF-8 with replacement, or value when raw_value is
 * empty}, a later key winning. upb's attribute access cost ~0.3 µs a header. None for what this
 * reads plainly only (each message and field once, as Envoy writes them): anything else (a field
 * repeated, a wire type that is not protobuf's, bad UTF-8 where protobuf wants a string) is left to
 * the parsed message (the caller falls back to headers_of). */

/* The next field of [*p, end): its number, wire type, and for a length-delimited one its bytes;
 * 0 at the end, -1 if malformed. */
static int next_field(const unsigned char **p, const unsigned char *end, uint64_t *number, int *type,
                      const unsigned char **data, size_t *size) {
    if (*p >= end) return 0;
    uint64_t tag, n;
    int k = varint(*p, end, &tag);
    if (!k) return -1;
    *p += k;
    *number = tag >> 3;
    *type = (int)(tag & 7);
    switch (*type) {
    case 0:
        k = 0;
        while (*p + k < end && k < 10 && ((*p)[k] & 0x80)) k++;
        if (*p + k >= end || k == 10) return -1;
        *p += k + 1;
        return 1;
    case 1:
        if (end - *p < 8) return -1;
        *p += 8;
        return 1;
    case 5:
        if (end - *p < 4) return -1;
        *p += 4;
        return 1;
    case 2:
        k = varint(*p, end, &n);
        if (!k || (size_t)(end - (*p + k)) < n) return -1;
        *data = *p + k;
        *size = (size_t)n;
        *p += k + n;
        return 1;
    default:
        return -1;
    }
}

/* The one length-delimited field `wanted` of [p, end): 1 found, 0 absent, -1 repeated or malformed. */
static int only_field(const unsigned char *p, const unsigned char *end, uint64_t wanted, const unsigned char **data,
                      size_t *size) {
    uint64_t number;
    int type, found = 0, r;
    const unsigned char *d = NULL;
    size_t n = 0;
    while ((r = next_field(&p, end, &number, &type, &d, &n)) > 0) {
        if (number != wanted) continue;
        if (type != 2 || found) return -1;
        *data = d;
        *size = n;
        found = 1;
    }
    return r < 0 ? -1 : found;
}

static PyObject *header_map(PyObject *module, PyObject *args) {
    Py_buffer view;
    int field;
    if (!PyArg_ParseTuple(args, "y*i", &view, &field)) return NULL;
    const unsigned char *msg = view.buf, *headers = NULL, *map = NULL;
    size_t headers_size = 0, map_size = 0;
    PyObject *out = PyDict_New();
    if (out == NULL) goto fail;
    int r = only_field(msg, msg + view.len, (uint64_t)field, &headers, &headers_size);
    if (r < 0) goto fallback;
    if (r == 0) goto done;
    r = only_field(headers, headers + headers_size, 1, &map, &map_size); /* HttpHeaders.headers */
    if (r < 0) goto fallback;
    if (r == 0) goto done;
    const unsigned char *p = map, *end = map + map_size, *entry;
    size_t entry_size;
    uint64_t number;
    int type;
    while ((r = next_field(&p, end, &number, &type, &entry, &entry_size)) > 0) {
        if (number != 1) continue; /* HeaderMap.headers: HeaderValue{key 1, value 2, raw_value 3} */
        if (type != 2) goto fallback;
        const unsigned char *q = entry, *q_end = entry + entry_size, *part[4] = {NULL};
        size_t part_size[4] = {0};
        const unsigned char *d;
        size_t n;
        int seen = 0;
        while ((r = next_field(&q, q_end, &number, &type, &d, &n)) > 0) {
            if (number < 1 || number > 3) continue;
            if (type != 2 || (seen & (1 << number))) goto fallback;
            seen |= 1 << number;
            part[number] = d;
            part_size[number] = n;
        }
        if (r < 0) goto fallback;
        PyObject *key = PyUnicode_DecodeUTF8((const char *)(part[1] ? part[1] : (const unsigned char *)""),
                                             (Py_ssize_t)part_size[1], NULL);
        if (key == NULL) goto fallback_error;
        PyObject *value;
        if (part_size[3] > 0)
            value = PyUnicode_DecodeUTF8((const char *)part[3], (Py_ssize_t)part_size[3], "replace");
        else
            value = PyUnicode_DecodeUTF8((const char *)(part[2] ? part[2] : (const unsigned char *)""),
                                         (Py_ssize_t)part_size[2], NULL);
        if (value == NULL) {
            Py_DECREF(key);
            goto fallback_error;
        }
        int set = PyDict_SetItem(out, key, value);
        Py_DECREF(key);
        Py_DECREF(value);
        if (set < 0) goto fail;
    }
    if (r < 0) goto fallback;
done:
    PyBuffer_Release(&view);
    return out;
fallback_error:
    if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) goto fail;
    PyErr_Clear();
fallback:
    Py_DECREF(out);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(out);
    PyBuffer_Release(&view);
    return NULL;
}

static PyMethodDef module_methods[] = {
    {"echo_answer", (PyCFunction)echo_answer, METH_O, "The serialized ProcessingResponse C answers a chunk with."},
    {"header_map", (PyCFunction)header_map, METH_VARARGS,
     "A serialized ProcessingRequest's headers at a field (2 request, 3 response) as a dict; None: parse it."},
    {"tls_usable", (PyCFunction)tls_usable, METH_O, "Whether TlsTransport can serve this ssl.SSLContext (same OpenSSL)."},
    {"returned", (PyCFunction)io_take_returned, METH_NOARGS, "The connections the I/O thread handed back (to reclaim)."},
    {"event_fd", (PyCFunction)io_event_fd, METH_NOARGS, "The eventfd the I/O thread signals when it hands back."},
    {"set_lend_after", (PyCFunction)io_set_lend_after, METH_O,
     "Lend a connection once each open stream has had this many chunks; returns the previous value."},
    {"set_observe_coalesce", (PyCFunction)io_set_observe_coalesce, METH_O,
     "Read connections whose lent streams are all observed at most every this many µs; the previous value."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "epp.wire._fast", "The read path of epp.wire's HTTP/2 connections (see _fast.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__fast(void) {
    if (PyType_Ready(&StreamBaseType) < 0 || PyType_Ready(&ConnectionBaseType) < 0 || PyType_Ready(&TlsTransportType) < 0)
        return NULL;
    str_frame = PyUnicode_InternFromString("_frame");
    str_keep = PyUnicode_InternFromString("_keep");
    str_run_after = PyUnicode_InternFromString("_run_after");
    str_write = PyUnicode_InternFromString("write");
    str_writelines = PyUnicode_InternFromString("writelines");
    str_slow = PyUnicode_InternFromString("_slow");
    str_error = PyUnicode_InternFromString("_error");
    str_lend = PyUnicode_InternFromString("_lend");
    str_connection_made = PyUnicode_InternFromString("connection_made");
    str_connection_lost = PyUnicode_InternFromString("connection_lost");
    str_data_received = PyUnicode_InternFromString("data_received");
    str_close = PyUnicode_InternFromString("close");
    str_abort = PyUnicode_InternFromString("abort");
    str_get_extra_info = PyUnicode_InternFromString("get_extra_info");
    str_pause_writing = PyUnicode_InternFromString("pause_writing");
    str_resume_writing = PyUnicode_InternFromString("resume_writing");
    if (!str_lend || !str_run_after || !str_frame || !str_keep || !str_slow || !str_error || !str_write || !str_writelines ||
        !str_connection_made || !str_connection_lost || !str_data_received || !str_close || !str_abort ||
        !str_get_extra_info || !str_pause_writing || !str_resume_writing)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&StreamBaseType);
    Py_INCREF(&ConnectionBaseType);
    Py_INCREF(&TlsTransportType);
    if (PyModule_AddObject(m, "StreamBase", (PyObject *)&StreamBaseType) < 0 ||
        PyModule_AddObject(m, "ConnectionBase", (PyObject *)&ConnectionBaseType) < 0 ||
        PyModule_AddObject(m, "TlsTransport", (PyObject *)&TlsTransportType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
