/* gateway.kv._native: the KV indexer's per-block work in C (issue 29: Python decoded and applied
 * 64,000-160,000 blocks/s on one core; vLLM batches carry hundreds of thousands of blocks a second).
 *
 * Three types, each the C form of what kv/index.py and kv/shared_index.py describe:
 *
 * - Table: the shared table's writer side (SharedWriter's holds and releases): open addressing with
 *   linear probing in the shared memory file, every change between two increments of the seqlock
 *   counter, deletion by shifting the probe run back.
 * - View: one data-parallel rank's view of a replica: vLLM's block hash -> kvgate's 16-byte key, oldest
 *   first (a doubly linked list over an entry array), and how many of vLLM's blocks carry each key; the
 *   first block carrying a key holds it in the table, the last one to go releases it.
 * - Events: one batch, parsed from its msgpack bytes without a Python object per event or token, or
 *   None from parse() when the batch is anything but the plain case (a malformed or unknown event,
 *   extra keys other than strings, a non-ASCII string, an ext type): kv/events.py decodes those, with
 *   its errors. What parse() accepts, Python accepts alike (tests/kv/test_native_index.py compares the
 *   two on generated batches).
 *
 * Keys are index.block_keys': blake3(previous key || the block's token ids as int64 LE), 16 bytes,
 * seeded by index.seed(namespace). Memory ordering of the table leans on x86-64 (TSO), as the Python
 * writer did: the compiler is kept from reordering by volatile accesses and fences.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "blake3/blake3.h"

#define KEY_BYTES 16
#define MAX_BLOCKS 2048 /* index.MAX_BLOCKS */
#define MAX_PAYLOAD (64u << 20) /* events._MAX_PAYLOAD */
#define MAX_DEPTH 64
#define NIL UINT32_MAX
#define MIN_SLOTS 64u
#define TOKEN_RUN 256 /* token ids hashed at a time: a block of any size needs no buffer of its size */

static const char SEED[] = "kvgate-precise"; /* index._SEED without its trailing NUL (added below) */

enum { K_STORED = 1, K_REMOVED = 2, K_CLEARED = 3 };

/* ------------------------------------------------------------------ helpers */

static inline uint64_t mix64(uint64_t x) { /* splitmix64's finalizer: vLLM's hashes may be small ints */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* Linear probing's deletion, for every table here: slot i was emptied and j is the next full slot of its
 * run; the entry at j (home slot `home`) stays where it is when its home lies cyclically in (i, j],
 * else it moves back into i (no tombstones: probes stay short). */
static inline int stays(uint64_t i, uint64_t j, uint64_t home) {
    return i <= j ? (i < home && home <= j) : (home > i || home <= j);
}

static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v; /* x86-64 and aarch64 Linux: little-endian */
}

static uint64_t bytes_id(const uint8_t *data, size_t len) { /* a bytes block hash as a 64-bit id */
    uint8_t out[8];
    blake3_hasher h;
    blake3_hasher_init(&h);
    blake3_hasher_update(&h, data, len);
    blake3_hasher_finalize(&h, out, 8);
    return load_le64(out);
}

static void namespace_seed(const uint8_t *name, size_t name_len, int has_name, const uint8_t *salt,
                           size_t salt_len, int has_salt, uint8_t out[KEY_BYTES]) {
    blake3_hasher h;
    blake3_hasher_init(&h);
    blake3_hasher_update(&h, SEED, sizeof(SEED)); /* with its NUL: b"kvgate-precise\0" */
    if (has_name) {
        blake3_hasher_update(&h, "n", 1);
        blake3_hasher_update(&h, name, name_len);
    } else {
        blake3_hasher_update(&h, "-", 1);
    }
    blake3_hasher_update(&h, "\0", 1);
    if (has_salt) {
        blake3_hasher_update(&h, "s", 1);
        blake3_hasher_update(&h, salt, salt_len);
    } else {
        blake3_hasher_update(&h, "-", 1);
    }
    blake3_hasher_finalize(&h, out, KEY_BYTES);
}


/* ------------------------------------------------------------------ Table */

typedef struct {
    PyObject_HEAD
    Py_buffer buf;
    int open;
    volatile uint64_t *w;
    uint64_t mask, width;
    Py_ssize_t keys_at, masks_at, seq_at, entries_at;
} Table;

static inline void table_begin(Table *t) {
    t->w[t->seq_at] = t->w[t->seq_at] + 1;
    __atomic_thread_fence(__ATOMIC_RELEASE);
}

static inline void table_end(Table *t) {
    __atomic_thread_fence(__ATOMIC_RELEASE);
    t->w[t->seq_at] = t->w[t->seq_at] + 1;
}

static void table_hold(Table *t, uint64_t key, uint64_t column) {
    volatile uint64_t *w = t->w;
    uint64_t i = key & t->mask, found = 0, probes = 0;
    for (;;) {
        found = w[t->keys_at + i];
        if (found == key || found == 0) break;
        i = (i + 1) & t->mask;
        if (++probes > t->mask) return; /* full: never the case at a load of one half; claim nothing */
    }
    table_begin(t);
    w[t->masks_at + i * t->width + (column >> 6)] |= (uint64_t)1 << (column & 63);
    if (found == 0) {
        w[t->keys_at + i] = key;
        w[t->entries_at] = w[t->entries_at] + 1;
    }
    table_end(t);
}

static void table_delete(Table *t, uint64_t i) { /* inside the seqlock */
    volatile uint64_t *w = t->w;
    uint64_t mask = t->mask, width = t->width, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint64_t key = w[t->keys_at + j];
        if (key == 0) break;
        uint64_t home = key & mask;
        if (stays(i, j, home)) continue;
        w[t->keys_at + i] = key;
        for (uint64_t k = 0; k < width; k++) w[t->masks_at + i * width + k] = w[t->masks_at + j * width + k];
        i = j;
    }
    w[t->keys_at + i] = 0;
    for (uint64_t k = 0; k < width; k++) w[t->masks_at + i * width + k] = 0;
    w[t->entries_at] = w[t->entries_at] - 1;
}

static void table_release(Table *t, uint64_t key, uint64_t column) {
    volatile uint64_t *w = t->w;
    uint64_t i = key & t->mask, probes = 0;
    for (;;) {
        uint64_t found = w[t->keys_at + i];
        if (found == 0) return;
        if (found == key) break;
        i = (i + 1) & t->mask;
        if (++probes > t->mask) return;
    }
    table_begin(t);
    uint64_t base = t->masks_at + i * t->width, any = 0;
    w[base + (column >> 6)] &= ~((uint64_t)1 << (column & 63));
    for (uint64_t k = 0; k < t->width; k++) any |= w[base + k];
    if (!any) table_delete(t, i);
    table_end(t);
}

static int Table_init(Table *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"buffer", "capacity", "words", "keys_at", "masks_at", "seq_at", "entries_at", NULL};
    PyObject *buffer;
    unsigned long long capacity, words;
    Py_ssize_t keys_at, masks_at, seq_at, entries_at;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKKnnnn", names, &buffer, &capacity, &words, &keys_at,
                                     &masks_at, &seq_at, &entries_at))
        return -1;
    if (capacity == 0 || (capacity & (capacity - 1)) || words == 0) {
        PyErr_SetString(PyExc_ValueError, "capacity is a power of two, words at least one");
        return -1;
    }
    if (self->open) {
        PyBuffer_Release(&self->buf);
        self->open = 0;
    }
    if (PyObject_GetBuffer(buffer, &self->buf, PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t need = 8 * (masks_at + (Py_ssize_t)(capacity * words));
    if (keys_at < 0 || masks_at < keys_at + (Py_ssize_t)capacity || seq_at < 0 || entries_at < 0 ||
        seq_at >= keys_at || entries_at >= keys_at || self->buf.len < need) {
        PyBuffer_Release(&self->buf);
        PyErr_SetString(PyExc_ValueError, "the table's layout does not fit its buffer");
        return -1;
    }
    self->open = 1;
    self->w = (volatile uint64_t *)self->buf.buf;
    self->mask = capacity - 1;
    self->width = words;
    self->keys_at = keys_at;
    self->masks_at = masks_at;
    self->seq_at = seq_at;
    self->entries_at = entries_at;
    return 0;
}

static int table_ready(Table *t) {
    if (!t->open) PyErr_SetString(PyExc_ValueError, "the table is closed");
    return t->open;
}

static int column_arg(Table *t, unsigned long long column) {
    if (column >= 64 * t->width) {
        PyErr_SetString(PyExc_ValueError, "no such column");
        return 0;
    }
    return 1;
}

static PyObject *Table_hold(Table *self, PyObject *args) {
    unsigned long long key, column;
    if (!PyArg_ParseTuple(args, "KK", &key, &column) || !table_ready(self) || !column_arg(self, column)) return NULL;
    table_hold(self, key, column);
    Py_RETURN_NONE;
}

static PyObject *Table_release(Table *self, PyObject *args) {
    unsigned long long key, column;
    if (!PyArg_ParseTuple(args, "KK", &key, &column) || !table_ready(self) || !column_arg(self, column)) return NULL;
    table_release(self, key, column);
    Py_RETURN_NONE;
}

static PyObject *Table_close(Table *self, PyObject *Py_UNUSED(ignored)) {
    if (self->open) {
        PyBuffer_Release(&self->buf);
        self->open = 0;
        self->w = NULL;
    }
    Py_RETURN_NONE;
}

static void Table_dealloc(Table *self) {
    if (self->open) PyBuffer_Release(&self->buf);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Table_methods[] = {
    {"hold", (PyCFunction)Table_hold, METH_VARARGS, "hold(key, column): column's view holds key"},
    {"release", (PyCFunction)Table_release, METH_VARARGS, "release(key, column): it no longer does"},
    {"close", (PyCFunction)Table_close, METH_NOARGS, "release the buffer (the mapping can then close)"},
    {NULL},
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gateway.kv._native.Table",
    .tp_doc = "Table(buffer, capacity, words, keys_at, masks_at, seq_at, entries_at): the shared table's "
              "writer (word offsets into buffer)",
    .tp_basicsize = sizeof(Table),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Table_init,
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_methods = Table_methods,
};

/* ------------------------------------------------------------------ msgpack, read at the boundary */

enum { T_NIL, T_BOOL, T_INT, T_FLOAT, T_STR, T_BIN, T_ARRAY, T_MAP };

typedef struct {
    const uint8_t *p, *end;
} Reader;

typedef struct {
    int type;
    int negative;     /* T_INT: the value is i (< 0), else u */
    uint64_t u;
    int64_t i;
    double f;
    const uint8_t *s; /* T_STR, T_BIN: the bytes */
    uint32_t len;     /* T_STR, T_BIN: bytes; T_ARRAY: items; T_MAP: pairs */
} Item;

static inline int need(Reader *r, size_t n) { return (size_t)(r->end - r->p) >= n; }

static inline uint64_t be(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int k = 0; k < n; k++) v = (v << 8) | p[k];
    return v;
}

/* One item's header (a string's or bin's bytes read too): 0, or -1 where Python's msgpack would refuse
 * the bytes or decode something this reader leaves to it (ext types, non-ASCII strings). */
static int next_item(Reader *r, Item *it) {
    if (!need(r, 1)) return -1;
    uint8_t c = *r->p++;
    int n = 0;
    it->negative = 0;
    if (c <= 0x7f) {
        it->type = T_INT, it->u = c;
        return 0;
    }
    if (c >= 0xe0) {
        it->type = T_INT, it->negative = 1, it->i = (int8_t)c;
        return 0;
    }
    if ((c & 0xf0) == 0x80) {
        it->type = T_MAP, it->len = c & 0x0f;
        return 0;
    }
    if ((c & 0xf0) == 0x90) {
        it->type = T_ARRAY, it->len = c & 0x0f;
        return 0;
    }
    if ((c & 0xe0) == 0xa0) {
        it->type = T_STR, it->len = c & 0x1f;
        goto bytes;
    }
    switch (c) {
    case 0xc0: it->type = T_NIL; return 0;
    case 0xc2: case 0xc3: it->type = T_BOOL, it->u = c & 1; return 0;
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        n = 1 << (c - 0xcc);
        if (!need(r, n)) return -1;
        it->type = T_INT, it->u = be(r->p, n), r->p += n;
        return 0;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        n = 1 << (c - 0xd0);
        if (!need(r, n)) return -1;
        uint64_t raw = be(r->p, n);
        r->p += n;
        int64_t v = n == 1 ? (int8_t)raw : n == 2 ? (int16_t)raw : n == 4 ? (int32_t)raw : (int64_t)raw;
        it->type = T_INT;
        if (v < 0) it->negative = 1, it->i = v;
        else it->u = (uint64_t)v;
        return 0;
    }
    case 0xca: {
        if (!need(r, 4)) return -1;
        uint32_t raw = (uint32_t)be(r->p, 4);
        float f;
        memcpy(&f, &raw, 4);
        it->type = T_FLOAT, it->f = f, r->p += 4;
        return 0;
    }
    case 0xcb: {
        if (!need(r, 8)) return -1;
        uint64_t raw = be(r->p, 8);
        memcpy(&it->f, &raw, 8);
        it->type = T_FLOAT, r->p += 8;
        return 0;
    }
    case 0xd9: case 0xda: case 0xdb:
        n = 1 << (c - 0xd9);
        if (!need(r, n)) return -1;
        it->type = T_STR, it->len = (uint32_t)be(r->p, n), r->p += n;
        goto bytes;
    case 0xc4: case 0xc5: case 0xc6:
        n = 1 << (c - 0xc4);
        if (!need(r, n)) return -1;
        it->type = T_BIN, it->len = (uint32_t)be(r->p, n), r->p += n;
        goto bytes;
    case 0xdc: case 0xdd:
        n = c == 0xdc ? 2 : 4;
        if (!need(r, n)) return -1;
        it->type = T_ARRAY, it->len = (uint32_t)be(r->p, n), r->p += n;
        return 0;
    case 0xde: case 0xdf:
        n = c == 0xde ? 2 : 4;
        if (!need(r, n)) return -1;
        it->type = T_MAP, it->len = (uint32_t)be(r->p, n), r->p += n;
        return 0;
    default: return -1; /* 0xc1, ext types */
    }
bytes:
    if (!need(r, it->len)) return -1;
    it->s = r->p;
    r->p += it->len;
    if (it->type == T_STR)
        for (uint32_t k = 0; k < it->len; k++)
            if (it->s[k] & 0x80) return -1; /* Python checks UTF-8 and raises: it decides */
    return 0;
}

/* Past one whole item (maps' keys must be scalars: Python's dict would refuse an array or map key). */
static int skip_item(Reader *r, int depth) {
    Item it;
    if (depth > MAX_DEPTH || next_item(r, &it) < 0) return -1;
    if (it.type == T_ARRAY) {
        for (uint32_t k = 0; k < it.len; k++)
            if (skip_item(r, depth + 1) < 0) return -1;
    } else if (it.type == T_MAP) {
        for (uint32_t k = 0; k < it.len; k++) {
            Item key;
            if (next_item(r, &key) < 0 || key.type == T_ARRAY || key.type == T_MAP) return -1;
            if (skip_item(r, depth + 1) < 0) return -1;
        }
    }
    return 0;
}

static inline int str_is(const Item *it, const char *name) {
    size_t n = strlen(name);
    return it->type == T_STR && it->len == n && memcmp(it->s, name, n) == 0;
}

/* ------------------------------------------------------------------ Events */

typedef struct {
    uint8_t kind;
    uint8_t has_parent;
    uint8_t keyed;        /* a chain start whose namespace kvgate can key (index.stored_namespace) */
    uint32_t block_size;
    uint32_t n;           /* blocks */
    uint32_t keyable;     /* index._keyable_blocks */
    size_t ids_at;        /* into Events.ids */
    const uint8_t *tokens; /* the first token id's bytes in the payload */
    uint64_t parent;
    uint8_t seed[KEY_BYTES];
} Ev;

typedef struct {
    PyObject_HEAD
    PyObject *payload; /* bytes: Ev.tokens points into it */
    Ev *ev;
    size_t n_ev, cap_ev;
    uint64_t *ids;
    size_t n_ids, cap_ids;
    double ts;
    PyObject *rank; /* int or None */
    Py_ssize_t stored, removed, cleared;
} Events;

static void Events_dealloc(Events *self) {
    Py_XDECREF(self->payload);
    Py_XDECREF(self->rank);
    PyMem_Free(self->ev);
    PyMem_Free(self->ids);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Events_counts(Events *self, void *Py_UNUSED(closure)) {
    return Py_BuildValue("{s:n,s:n,s:n}", "BlockStored", self->stored, "BlockRemoved", self->removed,
                         "AllBlocksCleared", self->cleared);
}

static PyObject *Events_ts(Events *self, void *Py_UNUSED(closure)) { return PyFloat_FromDouble(self->ts); }

static PyObject *Events_rank(Events *self, void *Py_UNUSED(closure)) {
    Py_INCREF(self->rank);
    return self->rank;
}

static PyGetSetDef Events_getset[] = {
    {"ts", (getter)Events_ts, NULL, "the batch's time", NULL},
    {"rank", (getter)Events_rank, NULL, "its data-parallel rank, or None", NULL},
    {"counts", (getter)Events_counts, NULL, "events by type", NULL},
    {NULL},
};

static PyTypeObject EventsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gateway.kv._native.Events",
    .tp_doc = "One batch of vLLM's KV events as parse() read it (View.apply applies it)",
    .tp_basicsize = sizeof(Events),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Events_dealloc,
    .tp_getset = Events_getset,
};

static int grow(void **array, size_t *cap, size_t need_n, size_t item) {
    if (need_n <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need_n) cap2 *= 2;
    void *p = PyMem_Realloc(*array, cap2 * item);
    if (!p) return -1;
    *array = p;
    *cap = cap2;
    return 0;
}

/* The fields read, by name (map-encoded events) ... */
enum { F_HASHES, F_PARENT, F_TOKENS, F_SIZE, F_LORA, F_MEDIUM, F_EXTRA, F_GROUP, N_USED };
static const char *USED_FIELDS[N_USED] = {"block_hashes", "parent_block_hash", "token_ids", "block_size",
                                          "lora_name", "medium", "extra_keys", "group_idx"};
/* ... and by position (positional events), in vLLM's field order (events.STORED_FIELDS, REMOVED_FIELDS):
 * each position's field, or -1 for one kvgate does not read (lora_id, kv_cache_spec_kind, ...). */
#define N_STORED 14
#define N_REMOVED 5
static const int8_t STORED_AT[N_STORED] = {F_HASHES, F_PARENT, F_TOKENS, F_SIZE, -1, F_MEDIUM, F_LORA, F_EXTRA,
                                           F_GROUP, -1, -1, -1, -1, -1};
static const int8_t REMOVED_AT[N_REMOVED] = {F_HASHES, F_MEDIUM, F_GROUP, -1, -1};

static int used_field(const Item *key) {
    if (key->type != T_STR) return -1;
    for (int f = 0; f < N_USED; f++)
        if (str_is(key, USED_FIELDS[f])) return f;
    return -1;
}

static int read_hash(Reader *r, uint64_t *id) {
    Item it;
    if (next_item(r, &it) < 0) return -1;
    if (it.type == T_INT) *id = it.negative ? (uint64_t)it.i : it.u;
    else if (it.type == T_BIN) *id = bytes_id(it.s, it.len);
    else return -1;
    return 0;
}

static int read_hashes(Events *b, const uint8_t *at, const uint8_t *end, uint32_t *n) {
    Reader r = {at, end};
    Item it;
    if (!at || next_item(&r, &it) < 0 || it.type != T_ARRAY) return -1;
    if (it.len > (size_t)(r.end - r.p)) return -1; /* a count the bytes cannot hold: never allocated */
    if (grow((void **)&b->ids, &b->cap_ids, b->n_ids + it.len, sizeof(uint64_t)) < 0) return -2;
    for (uint32_t k = 0; k < it.len; k++)
        if (read_hash(&r, &b->ids[b->n_ids + k]) < 0) return -1;
    *n = it.len;
    return 0;
}

static int opt_str(const uint8_t *at, const uint8_t *end, Item *out) { /* -1: present and not a string */
    out->type = T_NIL;
    if (!at) return 0;
    Reader r = {at, end};
    if (next_item(&r, out) < 0) return -1;
    return out->type == T_NIL || out->type == T_STR ? 0 : -1;
}

static int opt_int(const uint8_t *at, const uint8_t *end) {
    if (!at) return 0;
    Reader r = {at, end};
    Item it;
    if (next_item(&r, &it) < 0) return -1;
    return it.type == T_NIL || it.type == T_INT ? 0 : -1;
}

static inline int same_str(const Item *a, const Item *b) {
    return a->len == b->len && memcmp(a->s, b->s, a->len) == 0;
}

/* The extra keys: one entry per block, each nil or an array of ASCII strings (else Python decides).
 * Sets the namespace of a chain start (index.stored_namespace) and the keyable blocks. */
static int read_extra(Ev *ev, const uint8_t *at, const uint8_t *end, const Item *lora) {
    int has_lora = lora->type == T_STR;
    ev->keyable = ev->n;
    ev->keyed = 1;
    Item salt = {0};
    int has_salt = 0;
    if (at) {
        Reader r = {at, end};
        Item it;
        if (next_item(&r, &it) < 0) return -1;
        if (it.type != T_NIL) {
            if (it.type != T_ARRAY || it.len != ev->n) return -1;
            int cut = 0;
            for (uint32_t b = 0; b < it.len; b++) {
                Item entry;
                if (next_item(&r, &entry) < 0) return -1;
                if (entry.type == T_NIL) continue;
                if (entry.type != T_ARRAY) return -1;
                Item first = {0}, second = {0};
                for (uint32_t k = 0; k < entry.len; k++) {
                    Item v;
                    if (next_item(&r, &v) < 0 || v.type != T_STR) return -1;
                    if (k == 0) first = v;
                    else if (k == 1) second = v;
                }
                if (b == 0) { /* the namespace: the LoRA name first when there is one, then the salt */
                    uint32_t k = 0, rest = entry.len;
                    if (has_lora && rest && same_str(&first, lora)) k = 1, rest--;
                    if (rest == 1) has_salt = 1, salt = k ? second : first;
                    else if (rest > 1) ev->keyed = 0;
                } else if (!cut && entry.len && (entry.len > 1 || !has_lora || !same_str(&first, lora))) {
                    ev->keyable = b, cut = 1;
                }
            }
        }
    }
    if (ev->keyed && !ev->has_parent)
        namespace_seed(lora->s, has_lora ? lora->len : 0, has_lora, salt.s, has_salt ? salt.len : 0, has_salt,
                       ev->seed);
    return 0;
}

static int read_tokens(Ev *ev, const uint8_t *at, const uint8_t *end) {
    Reader r = {at, end};
    Item it;
    if (!at || next_item(&r, &it) < 0 || it.type != T_ARRAY) return -1;
    if ((uint64_t)ev->block_size * ev->n != it.len) return -1; /* vLLM publishes full blocks only */
    ev->tokens = r.p;
    for (uint32_t k = 0; k < it.len; k++) {
        Item t;
        if (next_item(&r, &t) < 0 || t.type != T_INT || t.negative || t.u >> 63) return -1;
    }
    return 0;
}

/* One event into b: 0, -1 where Python decides, -2 out of memory. */
static int parse_event(Events *b, Reader *r) {
    const uint8_t *field[N_USED] = {0};
    Item head, tag = {0};
    if (next_item(r, &head) < 0) return -1;
    if (head.type == T_MAP) {
        int tagged = 0;
        for (uint32_t k = 0; k < head.len; k++) {
            Item key;
            if (next_item(r, &key) < 0 || key.type == T_ARRAY || key.type == T_MAP) return -1;
            const uint8_t *value = r->p;
            if (str_is(&key, "type")) {
                if (next_item(r, &tag) < 0 || tag.type != T_STR) return -1;
                r->p = value;
                tagged = 1;
            }
            int f = used_field(&key);
            if (f >= 0) field[f] = value;
            if (skip_item(r, 1) < 0) return -1;
        }
        if (!tagged) return -1;
    } else if (head.type == T_ARRAY && head.len > 0) {
        if (next_item(r, &tag) < 0 || tag.type != T_STR) return -1;
        const int8_t *at = NULL;
        uint32_t known = 0;
        if (str_is(&tag, "BlockStored")) at = STORED_AT, known = N_STORED;
        else if (str_is(&tag, "BlockRemoved")) at = REMOVED_AT, known = N_REMOVED;
        if (at && head.len - 1 > known) return -1;
        for (uint32_t k = 1; k < head.len; k++) {
            if (at && at[k - 1] >= 0) field[at[k - 1]] = r->p;
            if (skip_item(r, 1) < 0) return -1;
        }
    } else {
        return -1;
    }
    const uint8_t *end = r->p;
    if (grow((void **)&b->ev, &b->cap_ev, b->n_ev + 1, sizeof(Ev)) < 0) return -2;
    Ev *ev = &b->ev[b->n_ev];
    memset(ev, 0, sizeof(Ev));
    ev->ids_at = b->n_ids;
    if (str_is(&tag, "AllBlocksCleared")) {
        ev->kind = K_CLEARED;
        b->n_ev++, b->cleared++;
        return 0;
    }
    Item medium;
    if (opt_str(field[F_MEDIUM], end, &medium) < 0 || opt_int(field[F_GROUP], end) < 0) return -1;
    int got;
    if (str_is(&tag, "BlockRemoved")) {
        ev->kind = K_REMOVED;
        if ((got = read_hashes(b, field[F_HASHES], end, &ev->n)) < 0) return got;
        b->n_ids += ev->n;
        b->n_ev++, b->removed++;
        return 0;
    }
    if (!str_is(&tag, "BlockStored")) return -1; /* a type Python counts as unknown */
    ev->kind = K_STORED;
    if ((got = read_hashes(b, field[F_HASHES], end, &ev->n)) < 0) return got;
    if (field[F_PARENT]) {
        Reader pr = {field[F_PARENT], end};
        Item peek;
        const uint8_t *at = pr.p;
        if (next_item(&pr, &peek) < 0) return -1;
        if (peek.type != T_NIL) {
            pr.p = at;
            if (read_hash(&pr, &ev->parent) < 0) return -1;
            ev->has_parent = 1;
        }
    }
    Reader sr = {field[F_SIZE], end};
    Item size;
    if (!field[F_SIZE] || next_item(&sr, &size) < 0 || size.type != T_INT || size.negative || size.u == 0 ||
        size.u > UINT32_MAX)
        return -1; /* (Python allows larger sizes; no batch under 64 MB holds such a block) */
    ev->block_size = (uint32_t)size.u;
    if (read_tokens(ev, field[F_TOKENS], end) < 0) return -1;
    Item lora;
    if (opt_str(field[F_LORA], end, &lora) < 0) return -1;
    if (read_extra(ev, field[F_EXTRA], end, &lora) < 0) return -1;
    b->n_ids += ev->n;
    b->n_ev++, b->stored++;
    return 0;
}

static PyObject *parse(PyObject *Py_UNUSED(module), PyObject *payload) {
    if (!PyBytes_Check(payload)) {
        PyErr_SetString(PyExc_TypeError, "parse() takes bytes");
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(payload);
    if ((size_t)size > MAX_PAYLOAD) Py_RETURN_NONE;
    Reader r = {(const uint8_t *)PyBytes_AS_STRING(payload), (const uint8_t *)PyBytes_AS_STRING(payload) + size};
    Item batch, ts, events;
    if (next_item(&r, &batch) < 0 || batch.type != T_ARRAY || batch.len < 2 || batch.len > 3) Py_RETURN_NONE;
    if (next_item(&r, &ts) < 0 || (ts.type != T_INT && ts.type != T_FLOAT)) Py_RETURN_NONE;
    if (next_item(&r, &events) < 0 || events.type != T_ARRAY) Py_RETURN_NONE;
    Events *b = PyObject_New(Events, &EventsType);
    if (!b) return NULL;
    b->payload = NULL, b->rank = NULL, b->ev = NULL, b->ids = NULL;
    b->n_ev = b->cap_ev = b->n_ids = b->cap_ids = 0;
    b->stored = b->removed = b->cleared = 0;
    b->ts = ts.type == T_FLOAT ? ts.f : ts.negative ? (double)ts.i : (double)ts.u;
    for (uint32_t k = 0; k < events.len; k++) {
        int got = parse_event(b, &r);
        if (got == -2) {
            Py_DECREF(b);
            return PyErr_NoMemory();
        }
        if (got < 0) goto decline;
    }
    if (batch.len == 3) {
        Item rank;
        if (next_item(&r, &rank) < 0) goto decline;
        if (rank.type == T_NIL) b->rank = Py_NewRef(Py_None);
        else if (rank.type == T_INT)
            b->rank = rank.negative ? PyLong_FromLongLong(rank.i) : PyLong_FromUnsignedLongLong(rank.u);
        else goto decline;
        if (!b->rank) {
            Py_DECREF(b);
            return NULL;
        }
    } else {
        b->rank = Py_NewRef(Py_None);
    }
    if (r.p != r.end) goto decline; /* extra bytes: Python refuses the batch */
    b->payload = Py_NewRef(payload);
    return (PyObject *)b;
decline:
    Py_DECREF(b);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------ View */

typedef struct {
    uint64_t hash;
    uint64_t k0, k1; /* kvgate's key: its 16 bytes as two little-endian words */
    uint32_t prev, next;
} Entry;

typedef struct {
    uint64_t k0, k1;
    uint32_t count; /* 0: an empty slot */
    uint32_t pad;
} Hold;

typedef struct {
    PyObject_HEAD
    Entry *entries;
    uint32_t entries_cap, free_head, used, head, tail;
    uint32_t *by_hash; /* an entry's index + 1; 0: empty */
    uint32_t by_hash_cap;
    Hold *holds;
    uint32_t holds_cap, holds_used;
    Table *table; /* NULL: not mirrored */
    uint64_t column;
    long block_size; /* 0: none seen */
} View;

static int view_reset(View *v) {
    PyMem_Free(v->entries);
    PyMem_Free(v->by_hash);
    PyMem_Free(v->holds);
    v->entries = PyMem_Calloc(MIN_SLOTS, sizeof(Entry));
    v->by_hash = PyMem_Calloc(MIN_SLOTS * 2, sizeof(uint32_t));
    v->holds = PyMem_Calloc(MIN_SLOTS * 2, sizeof(Hold));
    if (!v->entries || !v->by_hash || !v->holds) {
        PyErr_NoMemory();
        return -1;
    }
    v->entries_cap = MIN_SLOTS, v->by_hash_cap = MIN_SLOTS * 2, v->holds_cap = MIN_SLOTS * 2;
    for (uint32_t k = 0; k < MIN_SLOTS; k++) v->entries[k].next = k + 1 < MIN_SLOTS ? k + 1 : NIL;
    v->free_head = 0, v->used = 0, v->head = v->tail = NIL, v->holds_used = 0;
    return 0;
}

static uint32_t find_entry(View *v, uint64_t hash, uint32_t *slot) {
    uint32_t mask = v->by_hash_cap - 1, i = (uint32_t)mix64(hash) & mask;
    for (;;) {
        uint32_t e = v->by_hash[i];
        if (e == 0 || v->entries[e - 1].hash == hash) {
            if (slot) *slot = i;
            return e ? e - 1 : NIL;
        }
        i = (i + 1) & mask;
    }
}

static void by_hash_delete(View *v, uint32_t i) {
    uint32_t mask = v->by_hash_cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        uint32_t e = v->by_hash[j];
        if (e == 0) break;
        uint32_t home = (uint32_t)mix64(v->entries[e - 1].hash) & mask;
        if (stays(i, j, home)) continue;
        v->by_hash[i] = e;
        i = j;
    }
    v->by_hash[i] = 0;
}

static int by_hash_grow(View *v) {
    uint32_t cap = v->by_hash_cap * 2;
    uint32_t *table = PyMem_Calloc(cap, sizeof(uint32_t));
    if (!table) return -1;
    for (uint32_t k = 0; k < v->by_hash_cap; k++) {
        uint32_t e = v->by_hash[k];
        if (!e) continue;
        uint32_t i = (uint32_t)mix64(v->entries[e - 1].hash) & (cap - 1);
        while (table[i]) i = (i + 1) & (cap - 1);
        table[i] = e;
    }
    PyMem_Free(v->by_hash);
    v->by_hash = table, v->by_hash_cap = cap;
    return 0;
}

static Hold *find_hold(View *v, uint64_t k0, uint64_t k1, uint32_t *slot) {
    uint32_t mask = v->holds_cap - 1, i = (uint32_t)mix64(k0) & mask;
    for (;;) {
        Hold *h = &v->holds[i];
        if (h->count == 0 || (h->k0 == k0 && h->k1 == k1)) {
            *slot = i;
            return h->count ? h : NULL;
        }
        i = (i + 1) & mask;
    }
}

static int holds_grow(View *v) {
    uint32_t cap = v->holds_cap * 2;
    Hold *table = PyMem_Calloc(cap, sizeof(Hold));
    if (!table) return -1;
    for (uint32_t k = 0; k < v->holds_cap; k++) {
        Hold *h = &v->holds[k];
        if (!h->count) continue;
        uint32_t i = (uint32_t)mix64(h->k0) & (cap - 1);
        while (table[i].count) i = (i + 1) & (cap - 1);
        table[i] = *h;
    }
    PyMem_Free(v->holds);
    v->holds = table, v->holds_cap = cap;
    return 0;
}

static inline uint64_t table_key(uint64_t k0) { return k0 ? k0 : 1; } /* index.table_key */

static int hold_key(View *v, uint64_t k0, uint64_t k1) {
    uint32_t slot;
    Hold *h = find_hold(v, k0, k1, &slot);
    if (h) {
        h->count++;
        return 0;
    }
    v->holds[slot] = (Hold){k0, k1, 1, 0};
    v->holds_used++;
    if (v->table) table_hold(v->table, table_key(k0), v->column);
    if (2 * v->holds_used > v->holds_cap && holds_grow(v) < 0) return -1;
    return 0;
}

static void release_key(View *v, uint64_t k0, uint64_t k1) {
    uint32_t slot;
    Hold *h = find_hold(v, k0, k1, &slot);
    if (!h) return;
    if (--h->count) return;
    uint32_t mask = v->holds_cap - 1, i = slot, j = slot;
    for (;;) { /* the slot emptied: shift its probe run back */
        j = (j + 1) & mask;
        if (!v->holds[j].count) break;
        uint32_t home = (uint32_t)mix64(v->holds[j].k0) & mask;
        if (stays(i, j, home)) continue;
        v->holds[i] = v->holds[j];
        i = j;
    }
    v->holds[i].count = 0;
    v->holds_used--;
    if (v->table) table_release(v->table, table_key(k0), v->column);
}

static void unlink_entry(View *v, uint32_t e) {
    Entry *x = &v->entries[e];
    if (x->prev != NIL) v->entries[x->prev].next = x->next;
    else v->head = x->next;
    if (x->next != NIL) v->entries[x->next].prev = x->prev;
    else v->tail = x->prev;
}

static void append_entry(View *v, uint32_t e) {
    Entry *x = &v->entries[e];
    x->prev = v->tail, x->next = NIL;
    if (v->tail != NIL) v->entries[v->tail].next = e;
    else v->head = e;
    v->tail = e;
}

/* vLLM's block `hash` carries kvgate's key (k0, k1): 1 when new, 0 when it was there, -1 out of memory. */
static int view_add(View *v, uint64_t hash, uint64_t k0, uint64_t k1) {
    uint32_t slot;
    uint32_t e = find_entry(v, hash, &slot);
    if (e != NIL) {
        unlink_entry(v, e);
        append_entry(v, e);
        Entry *x = &v->entries[e];
        if (x->k0 == k0 && x->k1 == k1) return 0;
        uint64_t o0 = x->k0, o1 = x->k1;
        x->k0 = k0, x->k1 = k1;
        release_key(v, o0, o1);
        return hold_key(v, k0, k1) < 0 ? -1 : 0;
    }
    if (v->free_head == NIL) {
        uint32_t cap = v->entries_cap * 2;
        Entry *grown = PyMem_Realloc(v->entries, (size_t)cap * sizeof(Entry));
        if (!grown) return -1;
        v->entries = grown;
        for (uint32_t k = v->entries_cap; k < cap; k++) grown[k].next = k + 1 < cap ? k + 1 : NIL;
        v->free_head = v->entries_cap;
        v->entries_cap = cap;
    }
    e = v->free_head;
    v->free_head = v->entries[e].next;
    Entry *x = &v->entries[e];
    x->hash = hash, x->k0 = k0, x->k1 = k1;
    append_entry(v, e);
    v->by_hash[slot] = e + 1;
    v->used++;
    if (2 * v->used > v->by_hash_cap && by_hash_grow(v) < 0) return -1;
    return hold_key(v, k0, k1) < 0 ? -1 : 1;
}

static void drop_entry(View *v, uint32_t e, uint32_t slot) {
    Entry *x = &v->entries[e];
    uint64_t k0 = x->k0, k1 = x->k1;
    by_hash_delete(v, slot);
    unlink_entry(v, e);
    x->next = v->free_head;
    v->free_head = e;
    v->used--;
    release_key(v, k0, k1);
}

static int view_remove(View *v, uint64_t hash) {
    uint32_t slot;
    uint32_t e = find_entry(v, hash, &slot);
    if (e == NIL) return 0;
    drop_entry(v, e, slot);
    return 1;
}

static int view_empty(View *v) {
    if (v->table)
        for (uint32_t k = 0; k < v->holds_cap; k++)
            if (v->holds[k].count) table_release(v->table, table_key(v->holds[k].k0), v->column);
    return view_reset(v);
}

static int hash_arg(PyObject *obj, uint64_t *id) { /* an int (64 bits, either sign) or bytes */
    if (PyBytes_Check(obj)) {
        *id = bytes_id((const uint8_t *)PyBytes_AS_STRING(obj), (size_t)PyBytes_GET_SIZE(obj));
        return 0;
    }
    if (!PyLong_Check(obj) || PyBool_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "a block hash is an int or bytes");
        return -1;
    }
    int overflow = 0;
    long long s = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow == 0) {
        if (s == -1 && PyErr_Occurred()) return -1;
        *id = (uint64_t)s;
        return 0;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(obj);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *id = u;
    return 0;
}

static int key_arg(PyObject *obj, uint64_t *k0, uint64_t *k1) {
    if (!PyBytes_Check(obj) || PyBytes_GET_SIZE(obj) != KEY_BYTES) {
        PyErr_SetString(PyExc_TypeError, "a key is 16 bytes");
        return -1;
    }
    const uint8_t *p = (const uint8_t *)PyBytes_AS_STRING(obj);
    *k0 = load_le64(p), *k1 = load_le64(p + 8);
    return 0;
}

static PyObject *key_bytes(uint64_t k0, uint64_t k1) {
    uint8_t out[KEY_BYTES];
    memcpy(out, &k0, 8);
    memcpy(out + 8, &k1, 8);
    return PyBytes_FromStringAndSize((const char *)out, KEY_BYTES);
}

static int View_init(View *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"table", "column", NULL};
    PyObject *table = Py_None;
    unsigned long long column = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OK", names, &table, &column)) return -1;
    if (table != Py_None && !PyObject_TypeCheck(table, &TableType)) {
        PyErr_SetString(PyExc_TypeError, "table is a Table or None");
        return -1;
    }
    if (table != Py_None && !column_arg((Table *)table, column)) return -1;
    Py_XSETREF(self->table, table == Py_None ? NULL : (Table *)Py_NewRef(table));
    self->column = column;
    self->block_size = 0;
    return view_reset(self);
}

static void View_dealloc(View *self) {
    PyMem_Free(self->entries);
    PyMem_Free(self->by_hash);
    PyMem_Free(self->holds);
    Py_XDECREF(self->table);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int view_ready(View *v) {
    if (!v->entries) PyErr_SetString(PyExc_ValueError, "View.__init__ was not called");
    else if (v->table && !table_ready(v->table)) return 0;
    return v->entries != NULL;
}

static Py_ssize_t View_len(View *self) { return self->used; }

static PyObject *View_add(View *self, PyObject *args) {
    PyObject *hash, *key;
    uint64_t id, k0, k1;
    if (!PyArg_ParseTuple(args, "OO", &hash, &key) || hash_arg(hash, &id) < 0 || key_arg(key, &k0, &k1) < 0 ||
        !view_ready(self))
        return NULL;
    int got = view_add(self, id, k0, k1);
    if (got < 0) return PyErr_NoMemory();
    return PyBool_FromLong(got);
}

static PyObject *View_get(View *self, PyObject *hash) {
    uint64_t id;
    if (hash_arg(hash, &id) < 0 || !view_ready(self)) return NULL;
    uint32_t e = find_entry(self, id, NULL);
    if (e == NIL) Py_RETURN_NONE;
    return key_bytes(self->entries[e].k0, self->entries[e].k1);
}

static PyObject *View_remove(View *self, PyObject *hash) {
    uint64_t id;
    if (hash_arg(hash, &id) < 0 || !view_ready(self)) return NULL;
    return PyBool_FromLong(view_remove(self, id));
}

static PyObject *View_holds(View *self, PyObject *key) {
    uint64_t k0, k1;
    uint32_t slot;
    if (key_arg(key, &k0, &k1) < 0 || !view_ready(self)) return NULL;
    return PyBool_FromLong(find_hold(self, k0, k1, &slot) != NULL);
}

static PyObject *View_pop_oldest(View *self, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg), done = 0;
    if ((n == -1 && PyErr_Occurred()) || !view_ready(self)) return NULL;
    while (done < n && self->head != NIL) {
        uint32_t slot, e = self->head;
        find_entry(self, self->entries[e].hash, &slot);
        drop_entry(self, e, slot);
        done++;
    }
    return PyLong_FromSsize_t(done);
}

static PyObject *View_empty(View *self, PyObject *Py_UNUSED(ignored)) {
    if (!view_ready(self) || view_empty(self) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *View_items(View *self, PyObject *Py_UNUSED(ignored)) {
    if (!view_ready(self)) return NULL;
    PyObject *out = PyList_New(0);
    for (uint32_t e = self->head; out && e != NIL; e = self->entries[e].next) {
        PyObject *item = Py_BuildValue("(KN)", (unsigned long long)self->entries[e].hash,
                                       key_bytes(self->entries[e].k0, self->entries[e].k1));
        if (!item || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

/* One stored event's blocks: keys chained from its parent's key or its namespace's seed (as
 * index.block_keys chains them). */
static int apply_stored(View *v, Events *b, Ev *ev, Py_ssize_t *stored, Py_ssize_t *skipped) {
    uint8_t prev[KEY_BYTES];
    v->block_size = ev->block_size;
    if (!ev->has_parent) {
        if (!ev->keyed) {
            *skipped += ev->n;
            return 0;
        }
        memcpy(prev, ev->seed, KEY_BYTES);
    } else {
        uint32_t e = find_entry(v, ev->parent, NULL);
        if (e == NIL) { /* its chain's start was never seen (or was dropped): not keyable */
            *skipped += ev->n;
            return 0;
        }
        memcpy(prev, &v->entries[e].k0, 8);
        memcpy(prev + 8, &v->entries[e].k1, 8);
    }
    uint32_t count = ev->keyable < MAX_BLOCKS ? ev->keyable : MAX_BLOCKS;
    Reader r = {ev->tokens, (const uint8_t *)PyBytes_AS_STRING(b->payload) + PyBytes_GET_SIZE(b->payload)};
    int64_t tokens[TOKEN_RUN];
    for (uint32_t k = 0; k < count; k++) {
        /* blake3(previous key || the block's token ids as int64 LE), fed a run of tokens at a time */
        uint8_t key[KEY_BYTES];
        blake3_hasher h;
        blake3_hasher_init(&h);
        blake3_hasher_update(&h, prev, KEY_BYTES);
        for (uint32_t left = ev->block_size; left;) {
            uint32_t run = left < TOKEN_RUN ? left : TOKEN_RUN;
            for (uint32_t t = 0; t < run; t++) {
                Item it;
                next_item(&r, &it); /* checked by parse() */
                tokens[t] = (int64_t)it.u;
            }
            blake3_hasher_update(&h, tokens, (size_t)run * 8);
            left -= run;
        }
        blake3_hasher_finalize(&h, key, KEY_BYTES);
        memcpy(prev, key, KEY_BYTES);
        if (view_add(v, b->ids[ev->ids_at + k], load_le64(key), load_le64(key + 8)) < 0) return -1;
        (*stored)++;
    }
    *skipped += ev->n - count;
    return 0;
}

static PyObject *View_apply(View *self, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &EventsType)) {
        PyErr_SetString(PyExc_TypeError, "apply() takes parse()'s Events");
        return NULL;
    }
    if (!view_ready(self)) return NULL;
    Events *b = (Events *)arg;
    Py_ssize_t stored = 0, removed = 0, cleared = 0, skipped = 0;
    for (size_t k = 0; k < b->n_ev; k++) {
        Ev *ev = &b->ev[k];
        if (ev->kind == K_STORED) {
            if (apply_stored(self, b, ev, &stored, &skipped) < 0) return PyErr_NoMemory();
        } else if (ev->kind == K_REMOVED) {
            for (uint32_t i = 0; i < ev->n; i++) removed += view_remove(self, b->ids[ev->ids_at + i]);
        } else {
            if (view_empty(self) < 0) return NULL;
            cleared++;
        }
    }
    return Py_BuildValue("(nnnn)", stored, removed, cleared, skipped);
}

static PyObject *View_get_block_size(View *self, void *Py_UNUSED(closure)) {
    if (!self->block_size) Py_RETURN_NONE;
    return PyLong_FromLong(self->block_size);
}

static int View_set_block_size(View *self, PyObject *value, void *Py_UNUSED(closure)) {
    long size = value == NULL || value == Py_None ? 0 : PyLong_AsLong(value);
    if (size == -1 && PyErr_Occurred()) return -1;
    if (size < 0) {
        PyErr_SetString(PyExc_ValueError, "a block size is positive");
        return -1;
    }
    self->block_size = size;
    return 0;
}

static PyObject *View_get_column(View *self, void *Py_UNUSED(closure)) {
    if (!self->table) Py_RETURN_NONE;
    return PyLong_FromUnsignedLongLong(self->column);
}

static PyObject *View_get_keys(View *self, void *Py_UNUSED(closure)) { return PyLong_FromLong(self->holds_used); }

static PyGetSetDef View_getset[] = {
    {"block_size", (getter)View_get_block_size, (setter)View_set_block_size, "its block size (None: none yet)",
     NULL},
    {"column", (getter)View_get_column, NULL, "its column in the table (None: not mirrored)", NULL},
    {"keys", (getter)View_get_keys, NULL, "distinct keys it holds", NULL},
    {NULL},
};

static PyMethodDef View_methods[] = {
    {"add", (PyCFunction)View_add, METH_VARARGS, "add(hash, key) -> bool: True when the hash is new here"},
    {"get", (PyCFunction)View_get, METH_O, "get(hash) -> key or None"},
    {"remove", (PyCFunction)View_remove, METH_O, "remove(hash) -> bool: whether it was here"},
    {"holds", (PyCFunction)View_holds, METH_O, "holds(key) -> bool"},
    {"pop_oldest", (PyCFunction)View_pop_oldest, METH_O, "pop_oldest(n) -> how many were popped"},
    {"empty", (PyCFunction)View_empty, METH_NOARGS, "empty the view, releasing every key it held"},
    {"items", (PyCFunction)View_items, METH_NOARGS, "[(hash as u64, key)], oldest first"},
    {"apply", (PyCFunction)View_apply, METH_O, "apply(events) -> (stored, removed, cleared, skipped)"},
    {NULL},
};

static PySequenceMethods View_as_sequence = {.sq_length = (lenfunc)View_len};

static PyTypeObject ViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gateway.kv._native.View",
    .tp_doc = "View(table=None, column=0): one rank's view of a replica (kv/index.py)",
    .tp_basicsize = sizeof(View),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)View_init,
    .tp_dealloc = (destructor)View_dealloc,
    .tp_methods = View_methods,
    .tp_getset = View_getset,
    .tp_as_sequence = &View_as_sequence,
};

/* ------------------------------------------------------------------ the module */

/* chain(first, data, ends): the chained keys of data's blocks (block i ends at ends[i]): key[i] =
 * blake3(key[i-1] || block i), key[-1] = first, each as long as first (index.block_keys). */
static PyObject *chain(PyObject *Py_UNUSED(module), PyObject *args) {
    Py_buffer first, data;
    PyObject *ends_arg, *ends = NULL, *keys = NULL;
    if (!PyArg_ParseTuple(args, "y*y*O:chain", &first, &data, &ends_arg)) return NULL;
    uint8_t previous[64];
    size_t key_len = (size_t)first.len;
    if (first.len < 1 || first.len > (Py_ssize_t)sizeof(previous)) {
        PyErr_SetString(PyExc_ValueError, "chain(): the first key is 1 to 64 bytes");
        goto done;
    }
    memcpy(previous, first.buf, key_len);
    ends = PySequence_Fast(ends_arg, "chain(): ends is a sequence of offsets");
    if (!ends) goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(ends), at = 0;
    keys = PyList_New(count);
    if (!keys) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t end = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ends, i));
        if (end == -1 && PyErr_Occurred()) goto fail;
        if (end < at || end > data.len) {
            PyErr_SetString(PyExc_ValueError, "chain(): ends rise within the data");
            goto fail;
        }
        blake3_hasher h;
        blake3_hasher_init(&h);
        blake3_hasher_update(&h, previous, key_len);
        blake3_hasher_update(&h, (const uint8_t *)data.buf + at, (size_t)(end - at));
        blake3_hasher_finalize(&h, previous, key_len);
        PyObject *key = PyBytes_FromStringAndSize((const char *)previous, (Py_ssize_t)key_len);
        if (!key) goto fail;
        PyList_SET_ITEM(keys, i, key);
        at = end;
    }
    goto done;
fail:
    Py_CLEAR(keys);
done:
    Py_XDECREF(ends);
    PyBuffer_Release(&first);
    PyBuffer_Release(&data);
    return keys;
}

static PyMethodDef module_methods[] = {
    {"parse", (PyCFunction)parse, METH_O,
     "parse(payload: bytes) -> Events | None: a batch read in C, or None where kv/events.py decides"},
    {"chain", (PyCFunction)chain, METH_VARARGS,
     "chain(first: bytes, data: bytes, ends: Sequence[int]) -> list[bytes]: chained block keys"},
    {NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.kv._native",
    .m_doc = "The KV indexer's per-block work in C (gateway/kv/native/index.c).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&TableType) < 0 || PyType_Ready(&EventsType) < 0 || PyType_Ready(&ViewType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "Table", (PyObject *)&TableType) < 0 ||
        PyModule_AddObjectRef(m, "Events", (PyObject *)&EventsType) < 0 ||
        PyModule_AddObjectRef(m, "View", (PyObject *)&ViewType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
