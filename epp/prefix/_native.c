/* The prefix-cache index's two hot loops, in C: hashing a prompt's blocks and looking block
 * hashes up in the slot table. Private to epp.prefix.hashing and epp.prefix.table, which own the
 * formats (see their docstrings); each function here does exactly what the numpy expression in
 * its docstring does, and tests/prefix/ holds both to a plain Python reference. _native.pyi gives
 * mypy their signatures.
 *
 * Why C and not numpy: with numpy, hashing an 8k-token prompt was six array passes (~14 µs) and a
 * lookup of 25 sampled keys eight array calls (~8 µs), nearly all of it per-call overhead; here
 * they are one pass each (~4 µs and ~1.5 µs). Numba gave the same speed but adds ~120 MB of
 * resident LLVM and a JIT compile at start-up; this is one small extension with no dependency.
 *
 * Arguments are buffers (numpy arrays, bytes), checked for size before any access. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__GNUC__) && !defined(__clang__)
#define __builtin_prefetch(address) ((void)(address)) /* a hint only: without it, just slower */
#endif

static inline uint32_t load32(const unsigned char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v); /* the words are little-endian, whatever the machine */
#endif
    return v;
}

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous%s buffer", what, writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static int get_size(PyObject *obj, Py_ssize_t *out, const char *what) {
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0", what);
        return -1;
    }
    *out = v;
    return 0;
}

PyDoc_STRVAR(chain_doc,
"chain(data, block_chars, count, keys, base, out)\n\n"
"The chained NH hashes of the first ``count`` blocks of ``data`` (bytes, ``block_chars`` a\n"
"multiple of 4), written to ``out`` (uint64, at least ``count``): with ``a`` the little-endian\n"
"32-bit words (a block of an odd number of words padded with a zero word) and ``keys`` the uint32\n"
"key per padded word position, ``out[i] = base + sum over pairs p of blocks 0..i of\n"
"((a[2p] + keys[2p]) mod 2**32) * ((a[2p+1] + keys[2p+1]) mod 2**32)``, all mod 2**64, and a\n"
"result of 0 replaced by 1.");

static PyObject *chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "chain(data, block_chars, count, keys, base, out)");
        return NULL;
    }
    Py_ssize_t block_chars, count;
    if (get_size(args[1], &block_chars, "block_chars") < 0 || get_size(args[2], &count, "count") < 0)
        return NULL;
    if (block_chars == 0 || block_chars % 4) {
        PyErr_SetString(PyExc_ValueError, "block_chars must be a positive multiple of 4");
        return NULL;
    }
    uint64_t base = PyLong_AsUnsignedLongLong(args[4]);
    if (base == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer data, keys, out;
    if (get_buffer(args[0], &data, 0, "data") < 0)
        return NULL;
    if (get_buffer(args[3], &keys, 0, "keys") < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (get_buffer(args[5], &out, 1, "out") < 0) {
        PyBuffer_Release(&data);
        PyBuffer_Release(&keys);
        return NULL;
    }
    const Py_ssize_t words = block_chars / 4;
    const Py_ssize_t padded = words + (words & 1); /* key positions per block */
    PyObject *result = NULL;
    if (count > data.len / block_chars || count > keys.len / 4 / padded || count > out.len / 8) {
        PyErr_SetString(PyExc_ValueError, "chain: a buffer is too small for count blocks");
        goto done;
    }
    {
        const unsigned char *d = data.buf;
        const unsigned char *k = keys.buf;
        unsigned char *o = out.buf;
        uint64_t acc = base;
        for (Py_ssize_t b = 0; b < count; b++) {
            const unsigned char *block = d + b * block_chars;
            const unsigned char *key = k + 4 * b * padded;
            uint64_t sum = 0;
            Py_ssize_t j = 0;
            for (; j + 1 < words; j += 2) {
                uint32_t x = load32(block + 4 * j) + load32(key + 4 * j);
                uint32_t y = load32(block + 4 * j + 4) + load32(key + 4 * j + 4);
                sum += (uint64_t)x * y;
            }
            if (j < words) { /* an odd word count: the last word pairs with a zero word */
                uint32_t x = load32(block + 4 * j) + load32(key + 4 * j);
                uint32_t y = load32(key + 4 * j + 4);
                sum += (uint64_t)x * y;
            }
            acc += sum;
            uint64_t v = acc ? acc : 1; /* 0 marks an empty slot in the index */
            memcpy(o + 8 * b, &v, 8);
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return result;
}

PyDoc_STRVAR(lookup_doc,
"lookup(rows, buckets, slots, width, shift, spill, keys, out)\n\n"
"Each key's slot in a table of ``buckets`` hashed buckets then ``spill`` spill buckets (a power\n"
"of two, or 0 to skip them), each of ``slots`` slots of ``width`` uint64 (the key first), as\n"
"``rows`` (C order): the key's buckets are the top bits of its low and of its high 32-bit half\n"
"(``half >> shift``) and its spill bucket ``buckets + (low half & (spill - 1))``; the first slot\n"
"in that order whose first word equals the key is copied to ``out[i]`` (``width`` uint64 per key),\n"
"or zeros when there is none.");

static PyObject *lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "lookup(rows, buckets, slots, width, shift, spill, keys, out)");
        return NULL;
    }
    Py_ssize_t buckets, slots, width, shift, spill;
    if (get_size(args[1], &buckets, "buckets") < 0 || get_size(args[2], &slots, "slots") < 0
        || get_size(args[3], &width, "width") < 0 || get_size(args[4], &shift, "shift") < 0
        || get_size(args[5], &spill, "spill") < 0)
        return NULL;
    if (shift > 31 || width == 0 || (spill & (spill - 1)) || buckets == 0 || ((Py_ssize_t)1 << (32 - shift)) > buckets) {
        PyErr_SetString(PyExc_ValueError, "lookup: bad table geometry");
        return NULL;
    }
    Py_buffer rows, keys, out;
    if (get_buffer(args[0], &rows, 0, "rows") < 0)
        return NULL;
    if (get_buffer(args[6], &keys, 0, "keys") < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    if (get_buffer(args[7], &out, 1, "out") < 0) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&keys);
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = keys.len / 8;
    const Py_ssize_t bucket_words = slots * width;
    if (rows.len / 8 / bucket_words < buckets + spill || out.len / 8 / width < n) {
        PyErr_SetString(PyExc_ValueError, "lookup: a buffer is too small");
        goto done;
    }
    {
        const uint64_t *table = rows.buf;
        const unsigned char *k = keys.buf;
        uint64_t *o = out.buf;
        /* Buckets are scattered over a table of tens of megabytes: nearly every probe misses the
         * caches. So the buckets of the key AHEAD keys on are fetched while this key's are
         * searched, and the memory latencies overlap instead of adding up. */
        enum { AHEAD = 8 };
        const Py_ssize_t bucket_bytes = bucket_words * 8;
        for (Py_ssize_t i = -AHEAD; i < n; i++) {
            const Py_ssize_t next = i + AHEAD;
            if (next < n) {
                uint64_t key;
                memcpy(&key, k + 8 * next, 8);
                const char *b0 = (const char *)(table + ((uint32_t)key >> shift) * bucket_words);
                const char *b1 = (const char *)(table + ((uint32_t)(key >> 32) >> shift) * bucket_words);
                for (Py_ssize_t line = 0; line < bucket_bytes; line += 64) {
                    __builtin_prefetch(b0 + line);
                    __builtin_prefetch(b1 + line);
                }
            }
            if (i < 0)
                continue;
            uint64_t key;
            memcpy(&key, k + 8 * i, 8);
            const uint32_t low = (uint32_t)key, high = (uint32_t)(key >> 32);
            Py_ssize_t probe[3] = {low >> shift, high >> shift, spill ? buckets + (low & (spill - 1)) : -1};
            const uint64_t *hit = NULL;
            for (int p = 0; p < 3 && !hit && probe[p] >= 0; p++) {
                const uint64_t *slot = table + probe[p] * bucket_words;
                for (Py_ssize_t s = 0; s < slots; s++, slot += width)
                    if (slot[0] == key) {
                        hit = slot;
                        break;
                    }
            }
            if (hit)
                memcpy(o + i * width, hit, 8 * width);
            else
                memset(o + i * width, 0, 8 * width);
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&keys);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL, lookup_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "epp.prefix._native", "The prefix-cache index's hot loops (see epp/prefix/_native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
