/*
 * asynctron._native: copies and digests that release the GIL once per call, not once per
 * piece.
 *
 * Staging a checkpoint copies many pieces (tensor bytes, padding) into a slab. numpy's copyto
 * releases and re-takes the GIL for every piece, and each re-take waits up to the
 * interpreter's switch interval (5 ms) when a trainer thread is busy in Python; torch's
 * copy_ runs large copies on its intra-op thread pool, which stalls on a core the trainer
 * holds. `copy_ranges` does all the pieces of a batch in one plain, single-threaded loop with
 * the GIL released (`asynctron bench train` shows the difference). Writing, `hash_ranges`
 * digests every whole item of a batch the same way (xxh3-64, vendored from xxHash: the same
 * digests as the `xxhash` package's, which releases the GIL per item).
 *
 * The data loader hears from its worker processes through a pipe. `os.read` releases the GIL
 * for every read, so a loop thread draining a few bytes would wait a switch interval to get
 * it back from a busy trainer; `read_nowait` reads what the pipe holds with the GIL kept.
 * Its workers cut samples out of a token file: `gather_tokens` widens many runs of tokens of
 * any of megatron's token dtypes to int64 in one call (numpy costs ~2 us per run).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <errno.h>
#include <string.h>
#include <unistd.h>

#include "xxhash.h"
#ifdef ASYNCTRON_XXH_X86_DISPATCH
#include "xxh_x86dispatch.h" /* XXH3_64bits picks SSE2, AVX2 or AVX-512 at run time */
#endif

/* A C-contiguous buffer of 8-byte integers, int64 if `is_signed` else uint64, 1-D if `one_d`,
 * writable if asked; or an error naming it. */
static int get_8byte_array(PyObject *obj, Py_buffer *view, const char *name, int is_signed,
                           int one_d, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *format = view->format == NULL ? "B" : view->format;
    if (*format == '<' || *format == '=' || *format == '@') {
        format++;
    }
    if ((one_d && view->ndim != 1) || view->itemsize != 8 ||
        (strcmp(format, is_signed ? "q" : "Q") && strcmp(format, is_signed ? "l" : "L"))) {
        PyErr_Format(PyExc_TypeError, "%s: expected a %sarray of %s, found format %s with %zd "
                     "dimensions", name, one_d ? "1-D " : "", is_signed ? "int64" : "uint64",
                     view->format, (Py_ssize_t)view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_three(Py_buffer views[3]) {
    for (int i = 0; i < 3; i++) {
        PyBuffer_Release(&views[i]);
    }
}

/* `function`'s three arguments as uint64 arrays of one length (the last writable if asked);
 * on failure, an error naming the argument, and nothing held. */
static int get_three_arrays(const char *function, PyObject *const *args, Py_ssize_t nargs,
                            const char *const names[3], int last_writable, Py_buffer views[3]) {
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "%s: expected 3 arguments, found %zd", function, nargs);
        return -1;
    }
    for (int i = 0; i < 3; i++) {
        if (get_8byte_array(args[i], &views[i], names[i], 0, 1, last_writable && i == 2) < 0) {
            for (int j = 0; j < i; j++) {
                PyBuffer_Release(&views[j]);
            }
            return -1;
        }
    }
    if (views[1].shape[0] != views[0].shape[0] || views[2].shape[0] != views[0].shape[0]) {
        PyErr_Format(PyExc_ValueError, "%s: expected arrays of one length, found %zd, %zd and "
                     "%zd", function, views[0].shape[0], views[1].shape[0], views[2].shape[0]);
        release_three(views);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_ranges_doc,
"copy_ranges(destinations, sources, nbytes, /)\n--\n\n"
"For each i, copy nbytes[i] bytes from address sources[i] to address destinations[i], or\n"
"write nbytes[i] zero bytes there when sources[i] is 0. All three are 1-D uint64 arrays\n"
"of one length. The GIL is released once for all the copies.\n\n"
"The caller guarantees that every range is valid memory it owns for the whole call\n"
"(addresses of live tensors and slabs); nothing is checked.");

static PyObject *copy_ranges(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    static const char *const names[3] = {"destinations", "sources", "nbytes"};
    Py_buffer views[3];
    if (get_three_arrays("copy_ranges", args, nargs, names, 0, views) < 0) {
        return NULL;
    }
    Py_ssize_t count = views[0].shape[0];
    const uint64_t *destinations = views[0].buf;
    const uint64_t *sources = views[1].buf;
    const uint64_t *nbytes = views[2].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        void *destination = (void *)(uintptr_t)destinations[i];
        if (sources[i] == 0) {
            memset(destination, 0, (size_t)nbytes[i]);
        } else {
            memcpy(destination, (const void *)(uintptr_t)sources[i], (size_t)nbytes[i]);
        }
    }
    Py_END_ALLOW_THREADS
    release_three(views);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(hash_ranges_doc,
"hash_ranges(addresses, nbytes, digests, /)\n--\n\n"
"For each i, set digests[i] to the xxh3-64 digest of the nbytes[i] bytes at address\n"
"addresses[i]. All three are 1-D uint64 arrays of one length (digests writable). The GIL is\n"
"released once for all of them.\n\n"
"The caller guarantees that every range is valid memory it owns for the whole call.");

static PyObject *hash_ranges(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    static const char *const names[3] = {"addresses", "nbytes", "digests"};
    Py_buffer views[3];
    if (get_three_arrays("hash_ranges", args, nargs, names, 1, views) < 0) {
        return NULL;
    }
    Py_ssize_t count = views[0].shape[0];
    const uint64_t *addresses = views[0].buf;
    const uint64_t *nbytes = views[1].buf;
    uint64_t *digests = views[2].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        digests[i] = XXH3_64bits((const void *)(uintptr_t)addresses[i], (size_t)nbytes[i]);
    }
    Py_END_ALLOW_THREADS
    release_three(views);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(gather_tokens_doc,
"gather_tokens(tokens, starts, counts, out, destinations, /)\n--\n\n"
"For each i, write tokens[starts[i] : starts[i] + counts[i]] as int64 to out, from element\n"
"destinations[i] on. tokens is a 1-D array of uint8, int8, int16, uint16, int32, int64,\n"
"float32 or float64 (floats are truncated, as numpy's astype); out a C-contiguous int64\n"
"array; starts, counts and destinations 1-D int64 arrays of one length. Every run must lie\n"
"inside both arrays (checked).");

#define GATHER_RUN(type)                                                            \
    do {                                                                            \
        const type *from = (const type *)source.buf + starts[i];                    \
        for (int64_t j = 0; j < counts[i]; j++) {                                   \
            to[j] = (int64_t)from[j];                                               \
        }                                                                           \
    } while (0)

static PyObject *gather_tokens(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "gather_tokens: expected 5 arguments, found %zd", nargs);
        return NULL;
    }
    Py_buffer source;
    if (PyObject_GetBuffer(args[0], &source, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return NULL;
    }
    Py_buffer views[4]; /* starts, counts, out (any shape), destinations */
    static const char *const names[4] = {"starts", "counts", "out", "destinations"};
    int got = 0;
    while (got < 4 &&
           get_8byte_array(args[got + 1], &views[got], names[got], 1, got != 2, got == 2) == 0) {
        got++;
    }
    PyObject *result = NULL;
    if (got == 4) {
        const int64_t *starts = views[0].buf;
        const int64_t *counts = views[1].buf;
        int64_t *out = views[2].buf;
        const int64_t *destinations = views[3].buf;
        Py_ssize_t runs = views[0].len / 8;
        int64_t source_length = source.len / source.itemsize;
        int64_t out_length = views[2].len / 8;
        const char *format = source.format == NULL ? "B" : source.format;
        char code = format[0] == '<' || format[0] == '=' ? format[1] : format[0];
        int ok = views[1].len / 8 == runs && views[3].len / 8 == runs;
        for (Py_ssize_t i = 0; ok && i < runs; i++) {
            ok = counts[i] >= 0 && starts[i] >= 0 && destinations[i] >= 0 &&
                 starts[i] <= source_length - counts[i] &&
                 destinations[i] <= out_length - counts[i];
        }
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "gather_tokens: expected runs inside tokens and "
                            "out, and arrays of one length");
        } else if (strchr("bBhHiIlLqQfd", code) == NULL ||
                   (source.itemsize != 1 && source.itemsize != 2 && source.itemsize != 4 &&
                    source.itemsize != 8)) {
            PyErr_Format(PyExc_TypeError, "gather_tokens: unsupported token format '%s'", format);
        } else {
            Py_BEGIN_ALLOW_THREADS
            for (Py_ssize_t i = 0; i < runs; i++) {
                int64_t *to = out + destinations[i];
                switch (code) {
                case 'b': GATHER_RUN(int8_t); break;
                case 'B': GATHER_RUN(uint8_t); break;
                case 'h': GATHER_RUN(int16_t); break;
                case 'H': GATHER_RUN(uint16_t); break;
                case 'f': GATHER_RUN(float); break;
                case 'd': GATHER_RUN(double); break;
                case 'I': GATHER_RUN(uint32_t); break;
                default:
                    if (source.itemsize == 4) {
                        GATHER_RUN(int32_t);
                    } else if (code == 'L' || code == 'Q') {
                        GATHER_RUN(uint64_t);
                    } else {
                        GATHER_RUN(int64_t);
                    }
                }
            }
            Py_END_ALLOW_THREADS
            result = Py_None;
            Py_INCREF(result);
        }
    }
    for (int j = 0; j < got; j++) {
        PyBuffer_Release(&views[j]);
    }
    PyBuffer_Release(&source);
    return result;
}

PyDoc_STRVAR(read_nowait_doc,
"read_nowait(fd, limit, /)\n--\n\n"
"Up to limit bytes read from the non-blocking file descriptor fd, without releasing the GIL:\n"
"b'' when nothing is there, None at the end of the file. For pipes whose writers write\n"
"small records; a read that could block must not come here.");

static PyObject *read_nowait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "read_nowait: expected 2 arguments (fd, limit), found %zd",
                     nargs);
        return NULL;
    }
    long fd = PyLong_AsLong(args[0]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "read_nowait: expected a file descriptor, found %ld", fd);
        return NULL;
    }
    if (limit < 0) {
        PyErr_Format(PyExc_ValueError, "read_nowait: expected limit >= 0, found %zd", limit);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, limit);
    if (out == NULL) {
        return NULL;
    }
    ssize_t done;
    do {
        done = read((int)fd, PyBytes_AS_STRING(out), (size_t)limit);
    } while (done < 0 && errno == EINTR);
    if (done < 0) {
        Py_DECREF(out);
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return PyBytes_FromStringAndSize(NULL, 0);
        }
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (done == 0 && limit > 0) {
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    if (_PyBytes_Resize(&out, done) < 0) {
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"gather_tokens", (PyCFunction)(void (*)(void))gather_tokens, METH_FASTCALL,
     gather_tokens_doc},
    {"read_nowait", (PyCFunction)(void (*)(void))read_nowait, METH_FASTCALL, read_nowait_doc},
    {"copy_ranges", (PyCFunction)(void (*)(void))copy_ranges, METH_FASTCALL, copy_ranges_doc},
    {"hash_ranges", (PyCFunction)(void (*)(void))hash_ranges, METH_FASTCALL, hash_ranges_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asynctron._native",
    .m_doc = "Copies and digests that release the GIL once per call, and a pipe read that keeps it.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    return PyModuleDef_Init(&module);
}
