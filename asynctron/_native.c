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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "xxhash.h"
#ifdef ASYNCTRON_XXH_X86_DISPATCH
#include "xxh_x86dispatch.h" /* XXH3_64bits picks SSE2, AVX2 or AVX-512 at run time */
#endif

/* A 1-D C-contiguous buffer of uint64 (`writable` if asked), or an error naming it. */
static int get_u64_array(PyObject *obj, Py_buffer *view, const char *name, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *format = view->format == NULL ? "B" : view->format;
    if (*format == '<' || *format == '=' || *format == '@') {
        format++;
    }
    if (view->ndim != 1 || view->itemsize != 8 || (strcmp(format, "Q") && strcmp(format, "L"))) {
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D array of uint64, found format %s "
                     "with %zd dimensions", name, view->format, (Py_ssize_t)view->ndim);
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
        if (get_u64_array(args[i], &views[i], names[i], last_writable && i == 2) < 0) {
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

static PyMethodDef methods[] = {
    {"copy_ranges", (PyCFunction)(void (*)(void))copy_ranges, METH_FASTCALL, copy_ranges_doc},
    {"hash_ranges", (PyCFunction)(void (*)(void))hash_ranges, METH_FASTCALL, hash_ranges_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asynctron._native",
    .m_doc = "Copies and digests that release the GIL once per call, not once per piece.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    return PyModuleDef_Init(&module);
}
