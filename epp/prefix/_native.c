/* The prefix-cache index's two hot loops, in C: hashing a prompt's blocks and looking block
 * hashes up in the slot table. Private to epp.prefix.hashing and epp.prefix.table, which own the
 * formats (see their docstrings); each function here does exactly what the numpy expression in
 * its docstring does, and tests/prefix/ holds both to a plain Python reference. _native.pyi gives
 * mypy their signatures. A third, kv_chain, keys the blocks of KV-cache events (epp.prefix.kvindex):
 * XXH64 chained per block, held to the xxhash package by tests/prefix/test_native.py. KeyMasks is
 * epp.prefix.kvindex's map from a block key to the pods holding it, and its lookup walk; held to a
 * dict by tests/prefix/test_native.py.
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


/* ---- KV-event block keys (epp.prefix.kvindex) --------------------------------------------------
 * XXH64, written from its published specification (github.com/Cyan4973/xxHash, doc/xxhash_spec.md),
 * so that tests can hold it to the xxhash package's xxh64. */

#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t load64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint64_t xxh64_round(uint64_t acc, uint64_t lane) {
    acc += lane * P64_2;
    return rotl64(acc, 31) * P64_1;
}

static inline uint64_t xxh64_merge(uint64_t acc, uint64_t lane) {
    acc ^= xxh64_round(0, lane);
    return acc * P64_1 + P64_4;
}

static uint64_t xxh64(const unsigned char *p, size_t len, uint64_t seed) {
    const unsigned char *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P64_1 + P64_2, v2 = seed + P64_2, v3 = seed, v4 = seed - P64_1;
        const unsigned char *limit = end - 32;
        do {
            v1 = xxh64_round(v1, load64(p));
            v2 = xxh64_round(v2, load64(p + 8));
            v3 = xxh64_round(v3, load64(p + 16));
            v4 = xxh64_round(v4, load64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xxh64_merge(h, v1);
        h = xxh64_merge(h, v2);
        h = xxh64_merge(h, v3);
        h = xxh64_merge(h, v4);
    } else {
        h = seed + P64_5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= xxh64_round(0, load64(p));
        h = rotl64(h, 27) * P64_1 + P64_4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)load32(p) * P64_1;
        h = rotl64(h, 23) * P64_2 + P64_3;
        p += 4;
    }
    while (p < end) {
        h ^= (uint64_t)(*p) * P64_5;
        h = rotl64(h, 11) * P64_1;
        p++;
    }
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    h ^= h >> 32;
    return h;
}

static inline void store32(unsigned char *p, uint32_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

static inline void store64(unsigned char *p, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

PyDoc_STRVAR(kv_chain_doc,
"kv_chain(tokens, block_size, count, parent, seed, suffix)\n\n"
"The chained keys of the first ``count`` blocks of ``block_size`` token ids, as a list of ints:\n"
"``key[i] = xxh64(le64(key[i-1]) + le32(tokens of block i)... + suffix, seed)`` with ``key[-1] =\n"
"parent``, a key of 0 replaced by 1. ``tokens`` is a list of ints in 0..2**32-1 or a buffer of\n"
"little-endian uint32; ``suffix`` bytes (may be empty) end every block's input.");

static PyObject *kv_chain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "kv_chain(tokens, block_size, count, parent, seed, suffix)");
        return NULL;
    }
    Py_ssize_t block_size, count;
    if (get_size(args[1], &block_size, "block_size") < 0 || get_size(args[2], &count, "count") < 0)
        return NULL;
    if (block_size == 0 || block_size > (1 << 20)) {
        PyErr_SetString(PyExc_ValueError, "block_size must be in 1..2**20");
        return NULL;
    }
    uint64_t parent = PyLong_AsUnsignedLongLong(args[3]);
    if (parent == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    uint64_t seed = PyLong_AsUnsignedLongLong(args[4]);
    if (seed == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_buffer suffix;
    if (get_buffer(args[5], &suffix, 0, "suffix") < 0)
        return NULL;
    PyObject *tokens = args[0];
    const int is_list = PyList_CheckExact(tokens);
    Py_buffer data;
    int have_data = 0;
    PyObject *result = NULL;
    unsigned char *buf = NULL;
    if (is_list) {
        if (count > PyList_GET_SIZE(tokens) / block_size) {
            PyErr_SetString(PyExc_ValueError, "kv_chain: fewer tokens than count blocks");
            goto done;
        }
    } else {
        if (get_buffer(tokens, &data, 0, "tokens") < 0)
            goto done;
        have_data = 1;
        if (count > data.len / 4 / block_size) {
            PyErr_SetString(PyExc_ValueError, "kv_chain: fewer tokens than count blocks");
            goto done;
        }
    }
    {
        const size_t block_bytes = 4 * (size_t)block_size;
        const size_t len = 8 + block_bytes + (size_t)suffix.len;
        buf = PyMem_Malloc(len);
        result = PyList_New(count);
        if (buf == NULL || result == NULL) {
            Py_CLEAR(result);
            if (buf == NULL)
                PyErr_NoMemory();
            goto done;
        }
        memcpy(buf + 8 + block_bytes, suffix.buf, (size_t)suffix.len);
        uint64_t key = parent;
        for (Py_ssize_t b = 0; b < count; b++) {
            store64(buf, key);
            if (is_list) {
                PyObject **items = PySequence_Fast_ITEMS(tokens) + b * block_size;
                for (Py_ssize_t t = 0; t < block_size; t++) {
                    PyObject *item = items[t];
                    if (!PyLong_Check(item)) {
                        PyErr_Format(PyExc_TypeError, "token ids must be integers, got %.50s", Py_TYPE(item)->tp_name);
                        Py_CLEAR(result);
                        goto done;
                    }
                    unsigned long long v = PyLong_AsUnsignedLongLong(item);
                    if ((v == (unsigned long long)-1 && PyErr_Occurred()) || v > 0xFFFFFFFFULL) {
                        PyErr_Clear();
                        PyErr_SetString(PyExc_ValueError, "token ids must be in 0..2**32-1");
                        Py_CLEAR(result);
                        goto done;
                    }
                    store32(buf + 8 + 4 * t, (uint32_t)v);
                }
            } else {
                memcpy(buf + 8, (const unsigned char *)data.buf + b * block_bytes, block_bytes);
            }
            key = xxh64(buf, len, seed);
            if (key == 0)
                key = 1; /* 0 is the root's parent */
            PyObject *value = PyLong_FromUnsignedLongLong(key);
            if (value == NULL) {
                Py_CLEAR(result);
                goto done;
            }
            PyList_SET_ITEM(result, b, value);
        }
    }
done:
    PyMem_Free(buf);
    if (have_data)
        PyBuffer_Release(&data);
    PyBuffer_Release(&suffix);
    return result;
}

/* --- KeyMasks: the precise index's map from a block key to the mask of the pods holding it ------- */

PyDoc_STRVAR(KeyMasks_doc,
"KeyMasks()\n\n"
"A map from a block key (a non-zero uint64) to a non-zero uint64 mask, pod slot s being bit s:\n"
"open addressing in two flat arrays, linear probing, deletion by backward shift (no tombstones),\n"
"grown at half load; epp.prefix.kvindex keeps one per 64 pod slots. A Python dict of ints\n"
"costs a lookup three cache misses (its index, its entry, the key object); here one, and match\n"
"fetches the slots of the keys ahead while it walks.");

typedef struct {
    PyObject_HEAD
    uint64_t *keys; /* 0: an empty slot */
    uint64_t *masks;
    size_t cap; /* a power of two */
    unsigned shift; /* 64 - log2(cap) */
    size_t count;
} KeyMasks;

static inline size_t km_home(const KeyMasks *t, uint64_t key) {
    return (size_t)((key * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

static inline size_t km_find(const KeyMasks *t, uint64_t key) { /* its slot, or the empty slot that ends its run */
    const size_t m = t->cap - 1;
    size_t i = km_home(t, key);
    while (t->keys[i] != 0 && t->keys[i] != key)
        i = (i + 1) & m;
    return i;
}

static int km_alloc(KeyMasks *t, size_t cap) {
    uint64_t *keys = PyMem_Calloc(cap, sizeof(uint64_t));
    uint64_t *masks = PyMem_Calloc(cap, sizeof(uint64_t));
    if (keys == NULL || masks == NULL) {
        PyMem_Free(keys);
        PyMem_Free(masks);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *old_keys = t->keys, *old_masks = t->masks;
    const size_t old_cap = t->cap;
    t->keys = keys;
    t->masks = masks;
    t->cap = cap;
    t->shift = 64 - (unsigned)__builtin_ctzll((unsigned long long)cap);
    for (size_t i = 0; i < old_cap; i++) {
        if (old_keys[i] != 0) {
            const size_t j = km_find(t, old_keys[i]);
            t->keys[j] = old_keys[i];
            t->masks[j] = old_masks[i];
        }
    }
    PyMem_Free(old_keys);
    PyMem_Free(old_masks);
    return 0;
}

static void km_delete(KeyMasks *t, size_t i) {
    const size_t m = t->cap - 1;
    size_t j = i;
    for (;;) {
        j = (j + 1) & m;
        if (t->keys[j] == 0)
            break;
        const size_t k = km_home(t, t->keys[j]);
        /* The entry at j may move to the hole at i when its home is not in (i, j] (cyclically). */
        const int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            t->keys[i] = t->keys[j];
            t->masks[i] = t->masks[j];
            i = j;
        }
    }
    t->keys[i] = 0;
    t->masks[i] = 0;
    t->count--;
}

static PyObject *KeyMasks_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "KeyMasks() takes no arguments");
        return NULL;
    }
    KeyMasks *t = (KeyMasks *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    if (km_alloc(t, 64) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    return (PyObject *)t;
}

static void KeyMasks_dealloc(KeyMasks *t) {
    PyMem_Free(t->keys);
    PyMem_Free(t->masks);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static int km_key(PyObject *obj, uint64_t *key) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "keys must be integers, got %.50s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    *key = PyLong_AsUnsignedLongLong(obj);
    if (*key == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

static PyObject *KeyMasks_get(KeyMasks *t, PyObject *arg) {
    uint64_t key;
    if (km_key(arg, &key) < 0)
        return NULL;
    if (key == 0)
        return PyLong_FromLong(0);
    return PyLong_FromUnsignedLongLong(t->masks[km_find(t, key)]);
}

static int km_key_and_bits(PyObject *const *args, Py_ssize_t nargs, const char *usage, uint64_t *key, uint64_t *bits) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (km_key(args[0], key) < 0 || km_key(args[1], bits) < 0)
        return -1;
    if (*key == 0) {
        PyErr_SetString(PyExc_ValueError, "key 0 is reserved (an empty slot)");
        return -1;
    }
    return 0;
}

static PyObject *KeyMasks_add(KeyMasks *t, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t key, bits;
    if (km_key_and_bits(args, nargs, "add(key, bits)", &key, &bits) < 0)
        return NULL;
    size_t i = km_find(t, key);
    const uint64_t before = t->masks[i];
    if (bits & ~before) {
        if (t->keys[i] == 0) {
            if (2 * (t->count + 1) > t->cap) {
                if (km_alloc(t, 2 * t->cap) < 0)
                    return NULL;
                i = km_find(t, key);
            }
            t->keys[i] = key;
            t->count++;
        }
        t->masks[i] = before | bits;
    }
    return PyLong_FromUnsignedLongLong(before);
}

static PyObject *KeyMasks_discard(KeyMasks *t, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t key, bits;
    if (km_key_and_bits(args, nargs, "discard(key, bits)", &key, &bits) < 0)
        return NULL;
    const size_t i = km_find(t, key);
    if (t->keys[i] != 0) {
        t->masks[i] &= ~bits;
        if (t->masks[i] == 0)
            km_delete(t, i);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(KeyMasks_match_doc,
"match(keys) -> list[tuple[int, int]]\n\n"
"For each pod slot s set in the mask of ``keys[0]``: (s, how many keys from the first its bit is\n"
"set in, consecutively). ``keys`` is a list of ints.");

#define KM_AHEAD 8 /* keys whose slots are fetched ahead of the one looked up */

static PyObject *KeyMasks_match(KeyMasks *t, PyObject *arg) {
    if (!PyList_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "match(keys): keys must be a list");
        return NULL;
    }
    const Py_ssize_t n = PyList_GET_SIZE(arg);
    if (n == 0)
        return PyList_New(0);
    uint64_t head;
    if (km_key(PyList_GET_ITEM(arg, 0), &head) < 0)
        return NULL;
    if (head == 0 || t->masks[km_find(t, head)] == 0)
        return PyList_New(0); /* nobody holds the first block: no key past it is read */
    uint64_t *keys = PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (keys == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        if (km_key(PyList_GET_ITEM(arg, i), &keys[i]) < 0) {
            PyMem_Free(keys);
            return NULL;
        }
    }
    Py_ssize_t runs[64];
    for (int b = 0; b < 64; b++)
        runs[b] = -1;
    uint64_t alive = keys[0] ? t->masks[km_find(t, keys[0])] : 0;
    const uint64_t first = alive;
    for (Py_ssize_t i = 0; i < KM_AHEAD && i < n; i++)
        __builtin_prefetch(&t->keys[km_home(t, keys[i])]);
    Py_ssize_t i = 0;
    for (; i < n && alive; i++) {
        if (i + KM_AHEAD < n) {
            const size_t h = km_home(t, keys[i + KM_AHEAD]);
            __builtin_prefetch(&t->keys[h]);
            __builtin_prefetch(&t->masks[h]);
        }
        const uint64_t mask = keys[i] ? t->masks[km_find(t, keys[i])] : 0;
        uint64_t gone = alive & ~mask;
        while (gone) {
            runs[__builtin_ctzll(gone)] = i;
            gone &= gone - 1;
        }
        alive &= mask;
    }
    PyMem_Free(keys);
    while (alive) {
        runs[__builtin_ctzll(alive)] = n;
        alive &= alive - 1;
    }
    PyObject *result = PyList_New(0);
    if (result == NULL)
        return NULL;
    for (int b = 0; b < 64; b++) {
        if (!(first >> b & 1))
            continue;
        PyObject *pair = Py_BuildValue("(in)", b, runs[b]);
        if (pair == NULL || PyList_Append(result, pair) < 0) {
            Py_XDECREF(pair);
            Py_DECREF(result);
            return NULL;
        }
        Py_DECREF(pair);
    }
    return result;
}

static Py_ssize_t KeyMasks_len(KeyMasks *t) { return (Py_ssize_t)t->count; }

static PyObject *KeyMasks_nbytes(KeyMasks *t, void *closure) {
    (void)closure;
    return PyLong_FromSize_t(2 * t->cap * sizeof(uint64_t));
}

static PyMethodDef KeyMasks_methods[] = {
    {"get", (PyCFunction)KeyMasks_get, METH_O, "get(key) -> the key's mask, 0 when absent"},
    {"add", (PyCFunction)(void (*)(void))KeyMasks_add, METH_FASTCALL, "add(key, bits) -> the key's mask before: sets its bits"},
    {"discard", (PyCFunction)(void (*)(void))KeyMasks_discard, METH_FASTCALL,
     "discard(key, bits): clears its bits, removing the key once none is left"},
    {"match", (PyCFunction)KeyMasks_match, METH_O, KeyMasks_match_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef KeyMasks_getset[] = {
    {"nbytes", (getter)KeyMasks_nbytes, NULL, "the bytes of its two arrays", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods KeyMasks_sequence = {.sq_length = (lenfunc)KeyMasks_len};

static PyTypeObject KeyMasksType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "epp.prefix._native.KeyMasks",
    .tp_basicsize = sizeof(KeyMasks),
    .tp_dealloc = (destructor)KeyMasks_dealloc,
    .tp_as_sequence = &KeyMasks_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = KeyMasks_doc,
    .tp_methods = KeyMasks_methods,
    .tp_getset = KeyMasks_getset,
    .tp_new = KeyMasks_new,
};

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL, lookup_doc},
    {"kv_chain", (PyCFunction)(void (*)(void))kv_chain, METH_FASTCALL, kv_chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "epp.prefix._native", "The prefix-cache index's hot loops (see epp/prefix/_native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&KeyMasksType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&KeyMasksType);
    if (PyModule_AddObject(m, "KeyMasks", (PyObject *)&KeyMasksType) < 0) {
        Py_DECREF(&KeyMasksType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
