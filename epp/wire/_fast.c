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
 *   goes to _keep(data, position). What is in out is written once at the end (_flush).
 *   ConnectionBase.frames(data, position) is the same loop, for the Python side's reads (after the
 *   preface, or a buffered partial frame).
 *
 * What a stream's echo does not take (the first body chunk: its response-start signal; the last:
 * end_of_stream and the usage; an empty chunk; anything with other fields; a message split over
 * frames, and every frame of that stream until the message is whole, since one of them could read
 * as a message of its own; a frame over our 1 MiB maximum, which Python refuses; an answer the
 * peer's windows or frame size cannot take now) goes to Python, which answers it the same way. The
 * answer's bytes are exactly what upb serializes for the same message (tests/wire/test_fast.py).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include "structmember.h"

#define MAX_TAIL 16
#define HALF_WINDOW (((int64_t)1 << 30) - 1) /* (2^31 - 1) / 2: top a receive window up past this */

/* ---- StreamBase: one stream's windows and its response tally ------------------------------------ */

typedef struct {
    PyObject_HEAD
    long long window;         /* what we may still send (the peer's window for this stream) */
    long long received;       /* bytes received since our last WINDOW_UPDATE for it */
    long long response_bytes; /* response body bytes seen, by C and Python alike */
    long long chunks;         /* response body chunks seen */
    int echo;                 /* 1: non-empty response body chunks are answered in C */
    int tail_cap, tail_start, tail_len;
    PyObject *tail[MAX_TAIL]; /* the last chunks, oldest first from tail_start (a ring) */
} StreamBase;

static void tail_push(StreamBase *self, PyObject *chunk) {
    if (self->tail_cap <= 0) return;
    Py_INCREF(chunk);
    if (self->tail_len < self->tail_cap) {
        self->tail[(self->tail_start + self->tail_len) % self->tail_cap] = chunk;
        self->tail_len++;
    } else {
        PyObject *old = self->tail[self->tail_start];
        self->tail[self->tail_start] = chunk;
        self->tail_start = (self->tail_start + 1) % self->tail_cap;
        Py_DECREF(old);
    }
}

static int stream_traverse(StreamBase *self, visitproc visit, void *arg) {
    for (int i = 0; i < self->tail_len; i++) Py_VISIT(self->tail[(self->tail_start + i) % self->tail_cap]);
    return 0;
}

static int stream_clear(StreamBase *self) {
    for (int i = 0; i < self->tail_len; i++) Py_CLEAR(self->tail[(self->tail_start + i) % self->tail_cap]);
    self->tail_len = 0;
    self->tail_start = 0;
    return 0;
}

static void stream_dealloc(StreamBase *self) {
    PyObject_GC_UnTrack(self);
    stream_clear(self);
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
        self->response_bytes += size;
        self->chunks++;
        tail_push(self, chunk);
    }
    Py_RETURN_NONE;
}

static PyObject *stream_get_tail(StreamBase *self, PyObject *unused) {
    PyObject *list = PyList_New(self->tail_len);
    if (list == NULL) return NULL;
    for (int i = 0; i < self->tail_len; i++) {
        PyObject *chunk = self->tail[(self->tail_start + i) % self->tail_cap];
        Py_INCREF(chunk);
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
    stream_clear(self);
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
    {"echo", T_INT, offsetof(StreamBase, echo), 0, "1: answer non-empty response body chunks in C"},
    {NULL},
};

static PyTypeObject StreamBaseType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "epp.wire._fast.StreamBase",
    .tp_basicsize = sizeof(StreamBase),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One HTTP/2 stream's flow-control windows and its response body tally.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)stream_init,
    .tp_dealloc = (destructor)stream_dealloc,
    .tp_traverse = (traverseproc)stream_traverse,
    .tp_clear = (inquiry)stream_clear,
    .tp_methods = stream_methods,
    .tp_members = stream_members,
};

/* ---- ConnectionBase ----------------------------------------------------------------------------- */

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
} ConnectionBase;

static PyObject *str_frame, *str_keep, *str_slow, *str_error, *str_write, *str_writelines;

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
 * (Envoy sends an empty metadata_context with every body chunk); any other field is Python's. */
static int response_chunk(const unsigned char *msg, size_t size, size_t *offset, size_t *length) {
    const unsigned char *end = msg + size, *p = msg;
    int found = 0;
    while (p < end) {
        unsigned char tag = *p++;
        uint64_t n;
        int k = varint(p, end, &n);
        if (!k || (size_t)(end - (p + k)) < n) return 0;
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
    return found;
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

static int append_window_update(PyObject *out, uint32_t stream_id, long long increment) {
    unsigned char frame[13] = {0, 0, 4, 8, 0,
                               (unsigned char)(stream_id >> 24), (unsigned char)(stream_id >> 16),
                               (unsigned char)(stream_id >> 8), (unsigned char)stream_id,
                               (unsigned char)(increment >> 24), (unsigned char)(increment >> 16),
                               (unsigned char)(increment >> 8), (unsigned char)increment};
    PyObject *bytes = PyBytes_FromStringAndSize((const char *)frame, 13);
    if (bytes == NULL) return -1;
    int rc = PyList_Append(out, bytes);
    Py_DECREF(bytes);
    return rc;
}

/* Try to answer the DATA frame at p (payload of `length` bytes) in C: 1 done, 0 not for C, -1 error. */
static int echo_frame(ConnectionBase *self, PyObject *data, const unsigned char *frame, size_t length) {
    uint8_t flags = frame[4];
    uint32_t stream_id = be32(frame + 5) & 0x7FFFFFFF;
    const unsigned char *payload = frame + 9;
    if (flags & 0x09) return 0; /* END_STREAM or PADDED: Python's */
    if (length < 5 || payload[0] != 0 || be32(payload + 1) != length - 5) return 0;
    PyObject *key = PyLong_FromUnsignedLong(stream_id);
    if (key == NULL) return -1;
    PyObject *item = PyDict_GetItemWithError(self->streams, key); /* borrowed */
    Py_DECREF(key);
    if (item == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyObject_TypeCheck(item, &StreamBaseType)) return 0;
    StreamBase *stream = (StreamBase *)item;
    if (!stream->echo || stream->response_bytes == 0) return 0;
    size_t offset, n;
    if (!response_chunk(payload + 5, length - 5, &offset, &n)) return 0;
    size_t message;
    size_t size = answer_size(n, &message);
    long long sent = (long long)(5 + message);
    if (sent > self->max_frame || sent > stream->window || sent > self->window) return 0;
    const unsigned char *body = payload + 5 + offset;

    PyObject *chunk = PyBytes_FromStringAndSize((const char *)body, (Py_ssize_t)n);
    if (chunk == NULL) return -1;
    PyObject *answer = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)size);
    if (answer == NULL) {
        Py_DECREF(chunk);
        return -1;
    }
    write_answer((unsigned char *)PyBytes_AS_STRING(answer), stream_id, body, n, message);
    int rc = PyList_Append(self->out, answer);
    Py_DECREF(answer);
    if (rc < 0) {
        Py_DECREF(chunk);
        return -1;
    }
    stream->response_bytes += (long long)n;
    stream->chunks++;
    tail_push(stream, chunk);
    Py_DECREF(chunk);
    stream->window -= sent;
    self->window -= sent;
    /* The frame counts against our receive windows; top them up past half. */
    self->received += (long long)length;
    if (self->received > HALF_WINDOW) {
        if (append_window_update(self->out, 0, self->received) < 0) return -1;
        self->received = 0;
    }
    stream->received += (long long)length;
    if (stream->received > HALF_WINDOW) {
        if (append_window_update(self->out, stream_id, stream->received) < 0) return -1;
        stream->received = 0;
    }
    return 1;
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
    if (PyList_GET_SIZE(self->out) > 0) return conn_flush(self, NULL);
    Py_RETURN_NONE;
}

static PyMethodDef conn_methods[] = {
    {"data_received", (PyCFunction)conn_data_received, METH_O,
     "asyncio.Protocol.data_received: read the frames, answering response body chunks of echoing streams in C."},
    {"_flush", (PyCFunction)conn_flush, METH_NOARGS, "Write what is in out, then empty it."},
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
    {"transport", T_OBJECT, offsetof(ConnectionBase, transport), 0, "the asyncio transport (None until made)"},
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

static PyMethodDef module_methods[] = {
    {"echo_answer", (PyCFunction)echo_answer, METH_O, "The serialized ProcessingResponse C answers a chunk with."},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "epp.wire._fast", "The read path of epp.wire's HTTP/2 connections (see _fast.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__fast(void) {
    if (PyType_Ready(&StreamBaseType) < 0 || PyType_Ready(&ConnectionBaseType) < 0) return NULL;
    str_frame = PyUnicode_InternFromString("_frame");
    str_keep = PyUnicode_InternFromString("_keep");
    str_write = PyUnicode_InternFromString("write");
    str_writelines = PyUnicode_InternFromString("writelines");
    str_slow = PyUnicode_InternFromString("_slow");
    str_error = PyUnicode_InternFromString("_error");
    if (!str_frame || !str_keep || !str_slow || !str_error || !str_write || !str_writelines) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&StreamBaseType);
    Py_INCREF(&ConnectionBaseType);
    if (PyModule_AddObject(m, "StreamBase", (PyObject *)&StreamBaseType) < 0 ||
        PyModule_AddObject(m, "ConnectionBase", (PyObject *)&ConnectionBaseType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
