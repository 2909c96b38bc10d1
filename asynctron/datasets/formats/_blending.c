/*
 * asynctron.datasets.formats._blending_native: megatron-core's greedy blending loops, filling arrays the
 * caller allocated (see _blending.py, which allocates them and documents the guarantees).
 *
 * The arithmetic is megatron-core's (`helpers.cpp`, 0.16) term for term, in double precision:
 * at step n the error of dataset d is `weight[d] * max(n, 1) - taken[d]`, and the first dataset
 * with the largest error wins (strict '>'). Built with -ffp-contract=off so that no compiler
 * fuses the multiply and the subtract into one differently rounded FMA.
 *
 * Each function checks its buffers (format, one dimension, lengths) and its inputs before it
 * writes a byte, and runs the loop without the GIL; it holds nothing but the buffers and one
 * count per dataset.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DATASETS 32766 /* the dataset index is int16 */

/* A 1-D C-contiguous buffer of `itemsize`-byte items whose struct format is one of `formats`. */
static int get_array(PyObject *obj, Py_buffer *view, int writable, const char *formats,
                     Py_ssize_t itemsize, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *format = view->format ? view->format : "B";
    if (format[0] == '@' || format[0] == '=') {
        format++;
    }
    if (view->ndim != 1 || view->itemsize != itemsize || strlen(format) != 1 ||
        strchr(formats, format[0]) == NULL) {
        PyErr_Format(PyExc_ValueError, "blend: expected %s as a 1-D array of %zd-byte items "
                     "(format '%s'), found %d-D of %zd-byte items (format '%s')", name, itemsize,
                     formats, view->ndim, view->itemsize, view->format ? view->format : "B");
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The two output buffers, of one length; `*size` is that length. */
static int get_outputs(PyObject *const *args, Py_buffer *dataset_index,
                       Py_buffer *sample_index, Py_ssize_t *size) {
    if (get_array(args[0], dataset_index, 1, "h", 2, "dataset_index (int16)") < 0) {
        return -1;
    }
    if (get_array(args[1], sample_index, 1, "lq", 8, "dataset_sample_index (int64)") < 0) {
        PyBuffer_Release(dataset_index);
        return -1;
    }
    *size = dataset_index->shape[0];
    if (sample_index->shape[0] != *size) {
        PyErr_Format(PyExc_ValueError, "blend: expected dataset_sample_index as long as "
                     "dataset_index (%zd), found %zd", *size, sample_index->shape[0]);
        PyBuffer_Release(dataset_index);
        PyBuffer_Release(sample_index);
        return -1;
    }
    return 0;
}

static int check_num_datasets(Py_ssize_t num_datasets) {
    if (num_datasets < 1 || num_datasets > MAX_DATASETS) {
        PyErr_Format(PyExc_ValueError, "blend: expected 1 to %d datasets, found %zd; the "
                     "dataset index is int16", MAX_DATASETS, num_datasets);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(blend_doc,
"blend(dataset_index, dataset_sample_index, weights)\n--\n\n"
"Fill int16 `dataset_index` and int64 `dataset_sample_index` (one length) with megatron's\n"
"greedy blend of float64 `weights` (finite, >= 0).");

static PyObject *blend(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "blend: expected 3 arguments (dataset_index, "
                     "dataset_sample_index, weights), found %zd", nargs);
        return NULL;
    }
    Py_buffer out_dataset, out_sample, in_weights;
    Py_ssize_t size;
    if (get_outputs(args, &out_dataset, &out_sample, &size) < 0) {
        return NULL;
    }
    if (get_array(args[2], &in_weights, 0, "d", 8, "weights (float64)") < 0) {
        goto fail_outputs;
    }
    const Py_ssize_t num_datasets = in_weights.shape[0];
    const double *weight = in_weights.buf;
    if (check_num_datasets(num_datasets) < 0) {
        goto fail;
    }
    for (Py_ssize_t d = 0; d < num_datasets; d++) {
        if (!isfinite(weight[d]) || weight[d] < 0) {
            PyObject *value = PyFloat_FromDouble(weight[d]);
            if (value != NULL) {
                PyErr_Format(PyExc_ValueError, "blend weights: expected finite weights >= 0, "
                             "found %R for dataset %zd", value, d);
                Py_DECREF(value);
            }
            goto fail;
        }
    }
    int64_t *taken = calloc((size_t)num_datasets, sizeof(int64_t));
    if (taken == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    int16_t *dataset_index = out_dataset.buf;
    int64_t *sample_index = out_sample.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t n = 0; n < size; n++) {
        const double steps = n > 1 ? (double)n : 1.0;
        Py_ssize_t best = 0;
        double best_error = weight[0] * steps - (double)taken[0];
        for (Py_ssize_t d = 1; d < num_datasets; d++) {
            const double error = weight[d] * steps - (double)taken[d];
            if (error > best_error) {
                best_error = error;
                best = d;
            }
        }
        dataset_index[n] = (int16_t)best;
        sample_index[n] = taken[best]++;
    }
    Py_END_ALLOW_THREADS
    free(taken);
    PyBuffer_Release(&in_weights);
    PyBuffer_Release(&out_dataset);
    PyBuffer_Release(&out_sample);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&in_weights);
fail_outputs:
    PyBuffer_Release(&out_dataset);
    PyBuffer_Release(&out_sample);
    return NULL;
}

PyDoc_STRVAR(blend_exhaustive_doc,
"blend_exhaustive(dataset_index, dataset_sample_index, sizes)\n--\n\n"
"Fill int16 `dataset_index` and int64 `dataset_sample_index`, as long as the sum of int64\n"
"`sizes` (each >= 1), taking exactly `sizes[d]` samples from dataset d in megatron's greedy\n"
"order.");

static PyObject *blend_exhaustive(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "blend_exhaustive: expected 3 arguments (dataset_index, "
                     "dataset_sample_index, sizes), found %zd", nargs);
        return NULL;
    }
    Py_buffer out_dataset, out_sample, in_sizes;
    Py_ssize_t size;
    if (get_outputs(args, &out_dataset, &out_sample, &size) < 0) {
        return NULL;
    }
    if (get_array(args[2], &in_sizes, 0, "lq", 8, "sizes (int64)") < 0) {
        goto fail_outputs;
    }
    const Py_ssize_t num_datasets = in_sizes.shape[0];
    const int64_t *sizes = in_sizes.buf;
    if (check_num_datasets(num_datasets) < 0) {
        goto fail;
    }
    int64_t total = 0;
    for (Py_ssize_t d = 0; d < num_datasets; d++) {
        if (sizes[d] < 1) {
            PyErr_Format(PyExc_ValueError, "blend sizes: expected every size >= 1, found %lld "
                         "for dataset %zd; drop the empty datasets from the blend",
                         (long long)sizes[d], d);
            goto fail;
        }
        if (sizes[d] > INT64_MAX - total) {
            PyErr_Format(PyExc_ValueError, "blend sizes: expected a total below 2**63, found "
                         "it past that at dataset %zd (size %lld)", d, (long long)sizes[d]);
            goto fail;
        }
        total += sizes[d];
    }
    if (total != (int64_t)size) {
        PyErr_Format(PyExc_ValueError, "blend sizes: expected them to sum to the output length "
                     "%zd, found %lld", size, (long long)total);
        goto fail;
    }
    /* Private copies of the sizes (the caller's buffers may share memory), the weights they
     * make, and `live`: the datasets not yet exhausted, ascending (megatron's std::set). */
    int64_t *taken = calloc((size_t)num_datasets, sizeof(int64_t));
    int64_t *limit = malloc((size_t)num_datasets * sizeof(int64_t));
    double *weight = malloc((size_t)num_datasets * sizeof(double));
    Py_ssize_t *live = malloc((size_t)num_datasets * sizeof(Py_ssize_t));
    if (taken == NULL || limit == NULL || weight == NULL || live == NULL) {
        free(taken);
        free(limit);
        free(weight);
        free(live);
        PyErr_NoMemory();
        goto fail;
    }
    for (Py_ssize_t d = 0; d < num_datasets; d++) {
        limit[d] = sizes[d];
        weight[d] = (double)sizes[d] / (double)total;
        live[d] = d;
    }
    Py_ssize_t num_live = num_datasets;
    int16_t *dataset_index = out_dataset.buf;
    int64_t *sample_index = out_sample.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t n = 0; n < size; n++) {
        const double steps = n > 1 ? (double)n : 1.0;
        Py_ssize_t best_at = -1;
        double best_error = -DBL_MAX;
        for (Py_ssize_t i = 0; i < num_live; i++) {
            const Py_ssize_t d = live[i];
            const double error = weight[d] * steps - (double)taken[d];
            if (error > best_error) {
                best_error = error;
                best_at = i;
            }
        }
        const Py_ssize_t best = live[best_at];
        dataset_index[n] = (int16_t)best;
        sample_index[n] = taken[best]++;
        if (taken[best] == limit[best]) {
            num_live--;
            memmove(live + best_at, live + best_at + 1,
                    (size_t)(num_live - best_at) * sizeof(Py_ssize_t));
        }
    }
    Py_END_ALLOW_THREADS
    free(taken);
    free(limit);
    free(weight);
    free(live);
    PyBuffer_Release(&in_sizes);
    PyBuffer_Release(&out_dataset);
    PyBuffer_Release(&out_sample);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&in_sizes);
fail_outputs:
    PyBuffer_Release(&out_dataset);
    PyBuffer_Release(&out_sample);
    return NULL;
}

static PyMethodDef methods[] = {
    {"blend", (PyCFunction)(void (*)(void))blend, METH_FASTCALL, blend_doc},
    {"blend_exhaustive", (PyCFunction)(void (*)(void))blend_exhaustive, METH_FASTCALL,
     blend_exhaustive_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "asynctron.datasets.formats._blending_native",
    .m_doc = "megatron-core's greedy blending loops, filling caller-allocated arrays.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__blending_native(void) {
    return PyModuleDef_Init(&module);
}
