/*
 * asynctron.storage._pickle_costs: what unpickling a pickle would cost, bounded before a byte of
 * it is unpickled.
 *
 * CPython's unpickler does work no `find_class` can refuse: a PUT naming memo index 2**31 grows
 * its memo table to 32 GiB (a 10-byte pickle); a nest of shared tuples used as a dict key is
 * hashed in time exponential in its depth (60 levels: forever); an object BUILT from one big
 * memoised state dict copies it again for each object. `check` runs the pickle machine without
 * making objects: for each value on the stack it keeps the size of its tree with shared parts
 * counted as often as they are reached (`deep`: what hashing or comparing it may walk) and the
 * elements a constructor or `__setstate__` would copy (`copy`), and it adds up the bytes the
 * unpickler would allocate (an upper bound: freed objects count too) and the elements it would
 * hash, compare or copy. The first opcode past either budget is refused, naming its byte.
 *
 * Also refused, since no pickler writes them and each lets the costs above escape the count: a
 * PUT naming an index beyond the number of memo writes before it (a pickler numbers them from
 * 0); a change (APPEND, SETITEMS, ADDITEMS, BUILD) to an object after it was placed in another
 * (a pickler finishes an object before it refers to it; only recursive objects do otherwise);
 * out-of-band buffers and extension codes, which neither a DCP `.metadata` nor a `torch.save`
 * blob holds. A persistent id (a tensor's storage in a `torch.save` blob) counts as a call.
 * The scan takes a few nanoseconds a byte and memory below what it counts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SATURATED ((uint64_t)1 << 62)
#define MAX_STACK ((size_t)1 << 20) /* a pickler's stack: its nesting times 1000-item batches */
#define MAX_MARKS ((size_t)1 << 16)

/* Bytes the unpickler allocates: upper bounds measured with tracemalloc on 64-bit CPython 3.11
 * (str and bytes add their length; dicts and sets include the old table while they grow). A call
 * counts as a copy of its arguments, as torch.Size, DCP's metadata classes and torch's tensor
 * rebuilders make; `set(list)` and `OrderedDict(pairs)`, which torch.load's unpickler admits,
 * build a table and may take up to 9 times that. */
enum {
    INT_BYTES = 32, /* floats too (24) */
    STR_BYTES = 56, WIDE_STR_BYTES = 80, BYTES_BYTES = 40, BYTEARRAY_BYTES = 64,
    LIST_BYTES = 72, LIST_ITEM_BYTES = 9, TUPLE_BYTES = 56, TUPLE_ITEM_BYTES = 8,
    DICT_BYTES = 80, DICT_ITEM_BYTES = 64, MAPPING_ITEM_BYTES = 128,
    SET_BYTES = 232, SET_ITEM_BYTES = 144,
    CALL_BYTES = 80, CALL_ITEM_BYTES = 16, BUILD_BYTES = 128, BUILD_ITEM_BYTES = 56,
    MEMO_SLOT_BYTES = 16, STACK_SLOT_BYTES = 8,
};

enum { ATOM, STR, TUPLE, LIST, DICT, SET, OBJECT };

/* A value's costs; `node` values are shared by every stack entry and memo slot holding it. */
typedef struct {
    uint64_t deep;     /* nodes of its tree, shared parts counted each time reached */
    uint64_t copy;     /* elements a constructor or __setstate__ given it copies */
    uint8_t kind;
    uint8_t str_keys;  /* a dict (or a tuple of dicts) whose keys are all str */
    uint8_t referenced;
} Cost;

typedef struct {
    Cost inline_cost;
    int64_t node; /* index into `nodes`, or -1 */
} Entry;

typedef struct {
    const unsigned char *data;
    size_t size, at, op_at;
    Entry *stack;
    size_t depth, stack_cap;
    size_t *marks;
    size_t num_marks, marks_cap;
    Cost *nodes;
    size_t num_nodes, nodes_cap;
    int64_t *memo;
    size_t memo_len, memo_cap, memo_filled, memo_writes;
    uint64_t memory, work, max_memory, max_work;
    uint64_t scan_bytes; /* this scan's own memory, also kept below `max_memory` */
    int failed, out_of_memory; /* the scan runs without the GIL: errors are raised after */
    char error[256];
} Machine;

static uint64_t sat_add(uint64_t a, uint64_t b) {
    return a >= SATURATED - b || b >= SATURATED ? SATURATED : a + b;
}

static uint64_t sat_mul(uint64_t a, uint64_t b) {
    return b != 0 && a > SATURATED / b ? SATURATED : a * b;
}

static int refuse(Machine *m, const char *format, ...) {
    if (!m->failed) {
        int prefix = snprintf(m->error, sizeof(m->error), "byte %zu: ", m->op_at);
        va_list args;
        va_start(args, format);
        vsnprintf(m->error + prefix, sizeof(m->error) - (size_t)prefix, format, args);
        va_end(args);
        m->failed = 1;
    }
    return -1;
}

static int grow(Machine *m, void **array, size_t *cap, size_t need, size_t item) {
    if (need <= *cap) {
        return 0;
    }
    size_t wanted = *cap ? *cap : 64;
    while (wanted < need) {
        wanted *= 2;
    }
    m->scan_bytes += (wanted - *cap) * item;
    if (m->scan_bytes > m->max_memory) {
        return refuse(m, "scanning it would take more than %llu bytes",
                      (unsigned long long)m->max_memory);
    }
    void *grown = realloc(*array, wanted * item);
    if (grown == NULL) {
        m->failed = m->out_of_memory = 1;
        return -1;
    }
    *array = grown;
    *cap = wanted;
    return 0;
}

static int charge(Machine *m, uint64_t memory, uint64_t work) {
    m->memory = sat_add(m->memory, memory);
    m->work = sat_add(m->work, work);
    if (m->memory > m->max_memory) {
        return refuse(m, "unpickling would allocate more than %llu bytes",
                      (unsigned long long)m->max_memory);
    }
    if (m->work > m->max_work) {
        return refuse(m, "unpickling would hash, compare or copy more than %llu elements (a "
                      "nest of shared objects?)", (unsigned long long)m->max_work);
    }
    return 0;
}

static Cost *cost_of(Machine *m, Entry *e) {
    return e->node >= 0 ? &m->nodes[e->node] : &e->inline_cost;
}

static int push(Machine *m, uint8_t kind, uint64_t memory) {
    if (m->depth >= MAX_STACK) {
        return refuse(m, "more than %zu values on the stack", MAX_STACK);
    }
    if (grow(m, (void **)&m->stack, &m->stack_cap, m->depth + 1, sizeof(Entry)) < 0 ||
        charge(m, sat_add(memory, STACK_SLOT_BYTES), 1) < 0) {
        return -1;
    }
    Entry *e = &m->stack[m->depth++];
    e->inline_cost = (Cost){.deep = 1, .copy = 0, .kind = kind, .str_keys = 1, .referenced = 0};
    e->node = -1;
    return 0;
}

/* The stack position of the newest mark (its slice starts there). */
static int mark_base(Machine *m, const char *opname, size_t *base) {
    if (m->num_marks == 0) {
        return refuse(m, "%s without a MARK", opname);
    }
    *base = m->marks[--m->num_marks];
    return 0;
}

static size_t floor_of_stack(Machine *m) {
    return m->num_marks ? m->marks[m->num_marks - 1] : 0;
}

static int need(Machine *m, size_t n, const char *opname) {
    if (m->depth < floor_of_stack(m) + n) {
        return refuse(m, "%s needs %zu values on the stack", opname, n);
    }
    return 0;
}

/* The entry at `i` becomes part of another value. */
static void consume(Machine *m, size_t i) {
    cost_of(m, &m->stack[i])->referenced = 1;
}

/* The entry at `i`, about to be changed, must not be part of another value yet. */
static Cost *changeable(Machine *m, size_t i, const char *opname) {
    Cost *c = cost_of(m, &m->stack[i]);
    if (c->referenced) {
        refuse(m, "%s changes an object already placed in another (a recursive object?)",
               opname);
        return NULL;
    }
    return c;
}

/* Replaces stack[from:] with one new value of `kind` made of them. */
static int combine(Machine *m, size_t from, uint8_t kind, uint64_t memory, uint64_t work,
                   uint64_t deep, uint64_t copy, uint8_t str_keys) {
    m->depth = from;
    if (push(m, kind, memory) < 0 || charge(m, 0, work) < 0) {
        return -1;
    }
    Cost *c = &m->stack[m->depth - 1].inline_cost;
    c->deep = sat_add(deep, 1);
    c->copy = copy;
    c->str_keys = str_keys;
    return 0;
}

/* A tuple, list, dict, set or frozenset made of stack[from:]. */
static int collection(Machine *m, size_t from, uint8_t kind) {
    size_t n = m->depth - from;
    uint64_t deep = 0, copy = n, hashed = 0, memory;
    uint8_t str_keys = 1;
    if (kind == DICT && n % 2) {
        return refuse(m, "DICT of an odd number of values");
    }
    for (size_t i = from; i < m->depth; i++) {
        Cost *c = cost_of(m, &m->stack[i]);
        consume(m, i);
        deep = sat_add(deep, c->deep);
        if (kind == TUPLE && c->kind != OBJECT) { /* a state (dict, slots) copies its dicts */
            copy = sat_add(copy, c->copy);
            str_keys &= c->kind != DICT || c->str_keys;
        }
        if ((kind == DICT && (i - from) % 2 == 0) || kind == SET) {
            hashed = sat_add(hashed, sat_mul(c->deep, 2)); /* hash, and compare on collision */
            str_keys &= c->kind == STR;
        }
    }
    switch (kind) {
    case TUPLE: memory = TUPLE_BYTES + TUPLE_ITEM_BYTES * (uint64_t)n; break;
    case LIST: memory = LIST_BYTES + LIST_ITEM_BYTES * (uint64_t)n; break;
    case DICT: memory = DICT_BYTES + DICT_ITEM_BYTES * (uint64_t)(n / 2); copy = n / 2; break;
    default: memory = SET_BYTES + SET_ITEM_BYTES * (uint64_t)n; break;
    }
    return combine(m, from, kind, memory, hashed, deep, copy, str_keys);
}

/* APPEND(S), SETITEM(S), ADDITEMS: stack[from:] go into the value below them. */
static int add_items(Machine *m, size_t from, uint8_t kind, const char *opname) {
    if (from == 0 || from <= floor_of_stack(m)) {
        return refuse(m, "%s without a value to add to", opname);
    }
    size_t n = m->depth - from;
    if (n == 0) {
        return 0;
    }
    if (kind == DICT && n % 2) {
        return refuse(m, "%s of an odd number of values", opname);
    }
    Cost *target = changeable(m, from - 1, opname);
    if (target == NULL) {
        return -1;
    }
    /* an OrderedDict (or another mapping a call made) takes more an item than a dict */
    uint64_t per_item = kind == LIST ? LIST_ITEM_BYTES
                        : kind == SET ? SET_ITEM_BYTES
                        : target->kind == DICT ? DICT_ITEM_BYTES / 2 : MAPPING_ITEM_BYTES / 2;
    uint64_t hashed = 0;
    for (size_t i = from; i < m->depth; i++) {
        Cost *c = cost_of(m, &m->stack[i]);
        consume(m, i);
        target->deep = sat_add(target->deep, c->deep);
        if ((kind == DICT && (i - from) % 2 == 0) || kind == SET) {
            hashed = sat_add(hashed, sat_mul(c->deep, 2));
            target->str_keys &= c->kind == STR;
        }
    }
    target->copy = sat_add(target->copy, kind == DICT ? n / 2 : n);
    m->depth = from;
    return charge(m, per_item * n, hashed);
}

/* REDUCE, NEWOBJ(_EX), OBJ, INST: a call of stack[from] (or a GLOBAL) with the rest. */
static int call(Machine *m, size_t from) {
    uint64_t deep = 0, copy = 0;
    for (size_t i = from; i < m->depth; i++) {
        Cost *c = cost_of(m, &m->stack[i]);
        consume(m, i);
        deep = sat_add(deep, c->deep);
        copy = sat_add(copy, sat_add(c->copy, 1));
    }
    return combine(m, from, OBJECT, sat_add(CALL_BYTES, sat_mul(copy, CALL_ITEM_BYTES)),
                   sat_add(deep, copy), deep, copy, 1);
}

static int build(Machine *m) {
    if (need(m, 2, "BUILD") < 0) {
        return -1;
    }
    size_t at = m->depth - 1;
    Cost *state = cost_of(m, &m->stack[at]);
    consume(m, at);
    Cost *target = changeable(m, at - 1, "BUILD");
    if (target == NULL) {
        return -1;
    }
    /* str keys hash once (cached); others again, as they go into the object's __dict__ */
    uint64_t work = sat_add(state->copy, state->str_keys ? 0 : state->deep);
    target->deep = sat_add(target->deep, state->deep);
    target->copy = sat_add(target->copy, state->copy);
    m->depth = at;
    return charge(m, sat_add(BUILD_BYTES, sat_mul(state->copy, BUILD_ITEM_BYTES)), work);
}

/* The top entry's costs move to a node, shared by every later copy of it. */
static int share_top(Machine *m) {
    Entry *top = &m->stack[m->depth - 1];
    if (top->node >= 0) {
        return 0;
    }
    if (grow(m, (void **)&m->nodes, &m->nodes_cap, m->num_nodes + 1, sizeof(Cost)) < 0) {
        return -1;
    }
    m->nodes[m->num_nodes] = top->inline_cost;
    top->node = (int64_t)m->num_nodes++;
    return 0;
}

static int memo_put(Machine *m, uint64_t index) {
    if (need(m, 1, "PUT") < 0) {
        return -1;
    }
    if (index > m->memo_writes) {
        return refuse(m, "memo index %llu after %zu memo writes (a pickler numbers them from 0)",
                      (unsigned long long)index, m->memo_writes);
    }
    m->memo_writes++;
    if (share_top(m) < 0 ||
        grow(m, (void **)&m->memo, &m->memo_cap, (size_t)index + 1, sizeof(int64_t)) < 0) {
        return -1;
    }
    while (m->memo_len <= index) {
        m->memo[m->memo_len++] = -1;
    }
    m->memo_filled += m->memo[index] < 0;
    m->memo[index] = m->stack[m->depth - 1].node;
    return charge(m, MEMO_SLOT_BYTES, 0); /* the unpickler's table: up to twice the index */
}

static int memo_get(Machine *m, uint64_t index) {
    if (index >= m->memo_len || m->memo[index] < 0) {
        return refuse(m, "memo index %llu was never written", (unsigned long long)index);
    }
    int64_t node = m->memo[index];
    if (push(m, m->nodes[node].kind, 0) < 0) {
        return -1;
    }
    m->stack[m->depth - 1].node = node;
    return 0;
}

/* The argument of an opcode: `n` bytes, or the bytes up to a newline (`n` < 0). */
static const unsigned char *arg(Machine *m, Py_ssize_t n, size_t *length) {
    if (n < 0) {
        const unsigned char *line = m->data + m->at;
        const unsigned char *end = memchr(line, '\n', m->size - m->at);
        if (end == NULL) {
            refuse(m, "a line argument without its newline");
            return NULL;
        }
        *length = (size_t)(end - line);
        m->at += *length + 1;
        return line;
    }
    if ((size_t)n > m->size - m->at) {
        refuse(m, "an argument of %zd bytes past the end", n);
        return NULL;
    }
    *length = (size_t)n;
    m->at += (size_t)n;
    return m->data + m->at - n;
}

static uint64_t little_endian(const unsigned char *p, size_t n) {
    uint64_t value = 0;
    for (size_t i = n; i-- > 0;) {
        value = (value << 8) | p[i];
    }
    return value;
}

/* An opcode argument of `width` bytes giving the length of the bytes that follow it (a signed
 * one for LONG4 and BINSTRING). */
static const unsigned char *counted(Machine *m, size_t width, int is_signed, size_t *length) {
    size_t n;
    const unsigned char *p = arg(m, (Py_ssize_t)width, &n);
    if (p == NULL) {
        return NULL;
    }
    uint64_t count = little_endian(p, width);
    if (is_signed && count >= ((uint64_t)1 << 31)) {
        refuse(m, "a negative length");
        return NULL;
    }
    if (count > m->size - m->at) {
        refuse(m, "a length of %llu bytes past the end", (unsigned long long)count);
        return NULL;
    }
    return arg(m, (Py_ssize_t)count, length);
}

static int decimal_index(Machine *m, uint64_t *index) {
    size_t n;
    const unsigned char *p = arg(m, -1, &n);
    if (p == NULL) {
        return -1;
    }
    if (n == 0 || n > 18) {
        return refuse(m, "a memo index of %zu digits", n);
    }
    *index = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') {
            return refuse(m, "a memo index that is not a decimal number");
        }
        *index = *index * 10 + (uint64_t)(p[i] - '0');
    }
    return 0;
}

/* The bytes a str of `n` UTF-8 bytes takes: 1 a character if ASCII, else up to 4. */
static uint64_t str_bytes(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (p[i] & 0x80) {
            return WIDE_STR_BYTES + 4 * (uint64_t)n;
        }
    }
    return STR_BYTES + n;
}

static int step(Machine *m) {
    m->op_at = m->at;
    unsigned char op = m->data[m->at++];
    size_t n, base;
    const unsigned char *p;
    uint64_t index;
    switch (op) {
    case 'I': case 'F': /* INT, FLOAT */
        return arg(m, -1, &n) ? push(m, ATOM, INT_BYTES + n) : -1;
    case 'L': /* LONG */
        return arg(m, -1, &n) ? push(m, ATOM, INT_BYTES + n) : -1;
    case 'J': case 'K': case 'M': case 'G': /* BININT, BININT1, BININT2, BINFLOAT */
        return arg(m, op == 'J' ? 4 : op == 'K' ? 1 : op == 'M' ? 2 : 8, &n)
                   ? push(m, ATOM, INT_BYTES) : -1;
    case 0x8a: case 0x8b: /* LONG1, LONG4 */
        return counted(m, op == 0x8a ? 1 : 4, op == 0x8b, &n) ? push(m, ATOM, INT_BYTES + n) : -1;
    case 'S': case 'V': /* STRING, UNICODE */
        return arg(m, -1, &n) ? push(m, STR, WIDE_STR_BYTES + 4 * (uint64_t)n) : -1;
    case 'T': case 'U': case 'X': case 0x8c: case 0x8d:
        /* BINSTRING, SHORT_BINSTRING, BINUNICODE, SHORT_BINUNICODE, BINUNICODE8 */
        p = counted(m, op == 'U' || op == 0x8c ? 1 : op == 0x8d ? 8 : 4, op == 'T', &n);
        return p ? push(m, STR, str_bytes(p, n)) : -1;
    case 'B': case 'C': case 0x8e: case 0x96: /* BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8 */
        if (!counted(m, op == 'C' ? 1 : op == 'B' ? 4 : 8, 0, &n)) {
            return -1;
        }
        return push(m, ATOM, (op == 0x96 ? BYTEARRAY_BYTES : BYTES_BYTES) + n);
    case 'N': case 0x88: case 0x89: /* NONE, NEWTRUE, NEWFALSE: singletons */
        return push(m, ATOM, 0);
    case ')': /* EMPTY_TUPLE: a singleton */
        return push(m, TUPLE, 0);
    case ']':
        return push(m, LIST, LIST_BYTES);
    case '}':
        return push(m, DICT, DICT_BYTES);
    case 0x8f: /* EMPTY_SET */
        return push(m, SET, SET_BYTES);
    case 't': case 'l': case 'd': case 0x91: /* TUPLE, LIST, DICT, FROZENSET */
        if (mark_base(m, "TUPLE, LIST, DICT or FROZENSET", &base) < 0) {
            return -1;
        }
        return collection(m, base, op == 't' ? TUPLE : op == 'l' ? LIST : op == 'd' ? DICT : SET);
    case 0x85: case 0x86: case 0x87: /* TUPLE1, TUPLE2, TUPLE3 */
        n = (size_t)(op - 0x84);
        return need(m, n, "TUPLEn") < 0 ? -1 : collection(m, m->depth - n, TUPLE);
    case 'a': /* APPEND */
        return need(m, 2, "APPEND") < 0 ? -1 : add_items(m, m->depth - 1, LIST, "APPEND");
    case 's': /* SETITEM */
        return need(m, 3, "SETITEM") < 0 ? -1 : add_items(m, m->depth - 2, DICT, "SETITEM");
    case 'e': case 'u': case 0x90: /* APPENDS, SETITEMS, ADDITEMS */
        if (mark_base(m, "APPENDS, SETITEMS or ADDITEMS", &base) < 0) {
            return -1;
        }
        return add_items(m, base, op == 'e' ? LIST : op == 'u' ? DICT : SET,
                         op == 'e' ? "APPENDS" : op == 'u' ? "SETITEMS" : "ADDITEMS");
    case '0': /* POP: a value, or the newest mark if nothing is above it */
        if (m->num_marks && m->depth == m->marks[m->num_marks - 1]) {
            m->num_marks--;
            return 0;
        }
        if (need(m, 1, "POP") < 0) {
            return -1;
        }
        m->depth--;
        return 0;
    case '1': /* POP_MARK */
        if (mark_base(m, "POP_MARK", &base) < 0) {
            return -1;
        }
        m->depth = base;
        return 0;
    case '2': /* DUP: one object twice, so its costs are shared from now on */
        if (need(m, 1, "DUP") < 0) {
            return -1;
        }
        if (share_top(m) < 0 || push(m, ATOM, 0) < 0) {
            return -1;
        }
        m->stack[m->depth - 1] = m->stack[m->depth - 2];
        return 0;
    case '(': /* MARK */
        if (m->num_marks >= MAX_MARKS) {
            return refuse(m, "more than %zu open MARKs", MAX_MARKS);
        }
        if (grow(m, (void **)&m->marks, &m->marks_cap, m->num_marks + 1, sizeof(size_t)) < 0 ||
            charge(m, sizeof(size_t), 0) < 0) {
            return -1;
        }
        m->marks[m->num_marks++] = m->depth;
        return 0;
    case 'g': /* GET */
        return decimal_index(m, &index) < 0 ? -1 : memo_get(m, index);
    case 'h': case 'j': /* BINGET, LONG_BINGET */
        return (p = arg(m, op == 'h' ? 1 : 4, &n)) ? memo_get(m, little_endian(p, n)) : -1;
    case 'p': /* PUT */
        return decimal_index(m, &index) < 0 ? -1 : memo_put(m, index);
    case 'q': case 'r': /* BINPUT, LONG_BINPUT */
        return (p = arg(m, op == 'q' ? 1 : 4, &n)) ? memo_put(m, little_endian(p, n)) : -1;
    case 0x94: /* MEMOIZE: at the count of filled slots, as CPython's unpickler does */
        return memo_put(m, m->memo_filled);
    case 'c': /* GLOBAL: module and name, each on its line */
        return arg(m, -1, &n) && arg(m, -1, &n) ? push(m, OBJECT, 0) : -1;
    case 0x93: /* STACK_GLOBAL */
        if (need(m, 2, "STACK_GLOBAL") < 0) {
            return -1;
        }
        m->depth -= 2;
        return push(m, OBJECT, 0);
    case 'R': case 0x81: /* REDUCE, NEWOBJ */
        return need(m, 2, "REDUCE or NEWOBJ") < 0 ? -1 : call(m, m->depth - 2);
    case 0x92: /* NEWOBJ_EX */
        return need(m, 3, "NEWOBJ_EX") < 0 ? -1 : call(m, m->depth - 3);
    case 'o': /* OBJ: a class and its arguments, above a mark */
        if (mark_base(m, "OBJ", &base) < 0) {
            return -1;
        }
        return m->depth == base ? refuse(m, "OBJ without a class") : call(m, base);
    case 'i': /* INST: module and name lines, arguments above a mark */
        if (!arg(m, -1, &n) || !arg(m, -1, &n) || mark_base(m, "INST", &base) < 0) {
            return -1;
        }
        return call(m, base);
    case 'b':
        return build(m);
    case 0x80: /* PROTO */
        return arg(m, 1, &n) ? 0 : -1;
    case 0x95: /* FRAME */
        return arg(m, 8, &n) ? 0 : -1;
    case 'P': /* PERSID: an id on its line */
        return arg(m, -1, &n) ? push(m, OBJECT, CALL_BYTES + n) : -1;
    case 'Q': /* BINPERSID */
        return need(m, 1, "BINPERSID") < 0 ? -1 : call(m, m->depth - 1);
    case 0x82: case 0x83: case 0x84:
        return refuse(m, "an extension code");
    case 0x97: case 0x98:
        return refuse(m, "an out-of-band buffer");
    default:
        return refuse(m, "opcode 0x%02x, which no pickle protocol has", op);
    }
}

PyDoc_STRVAR(check_doc,
"check(data, max_memory, max_work) -> (memory, work)\n"
"\n"
"Runs the pickle machine over `data` without making objects, up to its STOP: what unpickling\n"
"it would allocate (bytes, an upper bound) and the elements it would hash, compare or copy.\n"
"Raises ValueError('byte N: ...') at the first opcode past `max_memory` or `max_work`, a PUT\n"
"beyond the memo writes before it, a change to an object already placed in another, an\n"
"extension code or out-of-band buffer, or a malformed pickle.");

static PyObject *check(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "check: expected 3 arguments (data, max_memory, "
                     "max_work), found %zd", nargs);
        return NULL;
    }
    unsigned long long max_memory = PyLong_AsUnsignedLongLong(args[1]);
    unsigned long long max_work = PyLong_AsUnsignedLongLong(args[2]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Machine m = {.data = view.buf, .size = (size_t)view.len, .max_memory = max_memory,
                 .max_work = max_work};
    int stopped = 0;
    Py_BEGIN_ALLOW_THREADS
    while (!m.failed && m.at < m.size) {
        if (m.data[m.at] == '.') { /* STOP */
            m.op_at = m.at;
            if (m.depth == 0) {
                refuse(&m, "STOP with nothing on the stack");
            }
            stopped = 1;
            break;
        }
        step(&m);
    }
    Py_END_ALLOW_THREADS
    if (!m.failed && !stopped) {
        m.op_at = m.size;
        refuse(&m, "the pickle ends without STOP");
    }
    if (m.out_of_memory) {
        PyErr_NoMemory();
    } else if (m.failed) {
        PyErr_SetString(PyExc_ValueError, m.error);
    }
    free(m.stack);
    free(m.marks);
    free(m.nodes);
    free(m.memo);
    PyBuffer_Release(&view);
    if (m.failed) {
        return NULL;
    }
    return Py_BuildValue("(KK)", (unsigned long long)m.memory, (unsigned long long)m.work);
}

static PyMethodDef methods[] = {
    {"check", (PyCFunction)(void (*)(void))check, METH_FASTCALL, check_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asynctron.storage._pickle_costs",
    .m_doc = "What unpickling a pickle would cost, bounded before it is unpickled.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__pickle_costs(void) {
    return PyModuleDef_Init(&module);
}
