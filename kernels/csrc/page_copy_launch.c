// One C call per direct read: page ids into a pinned slot, the copy kernel(s) launched, events
// recorded (kernels/native_launch.py builds and loads this; transfer/direct_copy.py calls it).
//
// Why C: a direct read's host time is on the latency path, and in Python the same steps (id
// conversion, two event calls, Triton's launcher, one more event call) cost 60-150 us on a cold
// core against a 50 us copy of 16 MiB. Here they are one call that holds the GIL throughout, so
// no other thread of the process gets a turn in the middle of a launch.
//
// The CUDA driver is opened with dlopen at first use (no CUDA headers or libraries at build time),
// and the handful of types it needs are declared here as opaque pointers.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef void *CUcontext;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef int CUdevice;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define MAX_PARAMS 32
#define MAX_ITEMS 64  // pool pairs of one read
#define HEAD_PAGES 64  // pages of each pool pair launched before the rest's ids are converted

static CUresult (*cu_launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
static CUresult (*cu_record)(CUevent, CUstream);
static CUresult (*cu_wait)(CUstream, CUevent, unsigned);
static CUresult (*cu_query)(CUevent);
static CUresult (*cu_get_ctx)(CUcontext *);
static CUresult (*cu_set_ctx)(CUcontext);
static CUresult (*cu_device_get)(CUdevice *, int);
static CUresult (*cu_retain)(CUcontext *, CUdevice);

static int driver_loaded(void) {
    if (cu_launch != NULL) return 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_RuntimeError, "cannot open libcuda.so.1: %s", dlerror());
        return 0;
    }
#define LOAD(var, name)                                                               \
    *(void **)(&var) = dlsym(lib, name);                                              \
    if (var == NULL) {                                                                \
        PyErr_Format(PyExc_RuntimeError, "libcuda.so.1 has no %s", name);             \
        return 0;                                                                     \
    }
    LOAD(cu_record, "cuEventRecord");
    LOAD(cu_wait, "cuStreamWaitEvent");
    LOAD(cu_query, "cuEventQuery");
    LOAD(cu_get_ctx, "cuCtxGetCurrent");
    LOAD(cu_set_ctx, "cuCtxSetCurrent");
    LOAD(cu_device_get, "cuDeviceGet");
    LOAD(cu_retain, "cuDevicePrimaryCtxRetain");
    LOAD(cu_launch, "cuLaunchKernel");  // last: it marks the table as complete
#undef LOAD
    return 1;
}

static int cuda_ok(CUresult r, const char *what) {
    if (r == CUDA_SUCCESS) return 1;
    PyErr_Format(PyExc_RuntimeError, "%s failed: CUDA error %d", what, r);
    return 0;
}

// ---- where the last queue call spent its time (scripts/profile_direct_read.py reads it) ----

#define MARKS 6  // entry, ids filled, context, model-stream wait, launches, done recorded
static struct timespec marks[MARKS];
static void mark(int i) { clock_gettime(CLOCK_MONOTONIC, &marks[i]); }

// timings() -> microseconds of each step of the last queue call.
static PyObject *timings(PyObject *self, PyObject *unused) {
    PyObject *out = PyTuple_New(MARKS - 1);
    if (out == NULL) return NULL;
    for (int i = 1; i < MARKS; i++) {
        double us = (marks[i].tv_sec - marks[i - 1].tv_sec) * 1e6 +
                    (marks[i].tv_nsec - marks[i - 1].tv_nsec) / 1e3;
        PyObject *value = PyFloat_FromDouble(us);
        if (value == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i - 1, value);
    }
    return out;
}

// ---- a prepared launch: one compiled kernel with its arguments, bar the two id addresses ----

typedef struct {
    CUfunction function;
    unsigned threads, shared, blocks_per_item;
    int nparams, src_index, dst_index;
    uint64_t values[MAX_PARAMS];  // each argument in 8 bytes (a 4-byte one in the low half)
    void *params[MAX_PARAMS];     // cuLaunchKernel's view: the address of each argument
} Launch;

static const char *LAUNCH = "duet.page_copy_launch";

static void launch_free(PyObject *capsule) { PyMem_Free(PyCapsule_GetPointer(capsule, LAUNCH)); }

// prepare(function, threads, shared, blocks_per_item, values, src_index, dst_index) -> capsule
static PyObject *prepare(PyObject *self, PyObject *args) {
    unsigned long long function;
    unsigned threads, shared, blocks;
    PyObject *values;
    int src_index, dst_index;
    if (!PyArg_ParseTuple(args, "KIIIO!ii", &function, &threads, &shared, &blocks, &PyTuple_Type,
                          &values, &src_index, &dst_index))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(values);
    if (n > MAX_PARAMS || src_index < 0 || src_index >= n || dst_index < 0 || dst_index >= n) {
        PyErr_SetString(PyExc_ValueError, "prepare: bad parameter count or id indices");
        return NULL;
    }
    Launch *l = PyMem_Calloc(1, sizeof(Launch));
    if (l == NULL) return PyErr_NoMemory();
    l->function = (CUfunction)(uintptr_t)function;
    l->threads = threads;
    l->shared = shared;
    l->blocks_per_item = blocks;
    l->nparams = (int)n;
    l->src_index = src_index;
    l->dst_index = dst_index;
    for (Py_ssize_t i = 0; i < n; i++) {
        l->values[i] = PyLong_AsUnsignedLongLongMask(PyTuple_GET_ITEM(values, i));
        if (PyErr_Occurred()) {
            PyMem_Free(l);
            return NULL;
        }
        l->params[i] = &l->values[i];
    }
    PyObject *capsule = PyCapsule_New(l, LAUNCH, launch_free);
    if (capsule == NULL) PyMem_Free(l);
    return capsule;
}

// ---- page ids into pinned memory ----

// Whether a buffer format is a native-order 8-byte signed int ("q" or "l", maybe prefixed by
// "@", "=" or, on this little-endian machine, "<").
static int native_int64(const char *format) {
    if (format == NULL) return 0;
    if (*format == '@' || *format == '=') format++;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    else if (*format == '<') format++;
#endif
    return (format[0] == 'q' || format[0] == 'l') && format[1] == 0;
}

// Page ids are a contiguous 1-D native int64 buffer (numpy), or a list or tuple of ints; anything
// else raises TypeError (and the caller takes the Python path).

// The buffer view of ids when it is one of native int64s (release it), else 0 with no error set.
static int int64_view(PyObject *ids, Py_buffer *view) {
    if (!PyObject_CheckBuffer(ids)) return 0;
    if (PyObject_GetBuffer(ids, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();  // not a contiguous buffer: read it as a sequence
        return 0;
    }
    if (view->ndim == 1 && view->itemsize == 8 && native_int64(view->format)) return 1;
    PyBuffer_Release(view);
    return 0;
}

static int check_sequence(PyObject *ids) {
    if (PyList_Check(ids) || PyTuple_Check(ids)) return 0;  // no dicts, sets or strings
    PyErr_Format(PyExc_TypeError, "page ids must be a list, tuple or int64 array, not %s",
                 Py_TYPE(ids)->tp_name);
    return -1;
}

// *count = len(ids) - skip, nothing converted; 0, or -1 with an exception set.
static int id_count(PyObject *ids, Py_ssize_t skip, Py_ssize_t *count) {
    Py_buffer view;
    if (int64_view(ids, &view)) {
        *count = view.len / 8 - skip;
        PyBuffer_Release(&view);
        return 0;
    }
    if (check_sequence(ids) < 0) return -1;
    *count = PySequence_Fast_GET_SIZE(ids) - skip;  // a list or a tuple
    return 0;
}

// ids[skip + from : skip + to] written as int64 at out[from:to] (the caller checked the count);
// 0, or -1 with an exception set (TypeError or OverflowError for an id that is not an int64).
static int fill_range(int64_t *out, PyObject *ids, Py_ssize_t skip, Py_ssize_t from,
                      Py_ssize_t to) {
    Py_buffer view;
    if (int64_view(ids, &view)) {
        memcpy(out + from, (int64_t *)view.buf + skip + from, (size_t)(to - from) * 8);
        PyBuffer_Release(&view);
        return 0;
    }
    if (check_sequence(ids) < 0) return -1;
    PyObject **items = PySequence_Fast_ITEMS(ids);
    for (Py_ssize_t i = from; i < to; i++) {
        PyObject *item = items[skip + i];
        // An int (or a subclass: its value is read in C) or a C-level integer such as numpy's.
        // A Python class's __index__ would run Python code here: it could change the list under
        // us, or let another thread into this launcher's shared state.
        if (!PyLong_Check(item) && PyType_HasFeature(Py_TYPE(item), Py_TPFLAGS_HEAPTYPE)) {
            PyErr_Format(PyExc_TypeError, "a page id must be an int, not %s",
                         Py_TYPE(item)->tp_name);
            return -1;
        }
        long long v = PyLong_AsLongLong(item);
        if (v == -1 && PyErr_Occurred()) return -1;
        out[i] = v;
    }
    return 0;
}

// ids[skip:] written as int64 at out (room for cap ids); the count, or -1 (exception set), or
// -2 when they do not fit.
static Py_ssize_t fill(int64_t *out, Py_ssize_t cap, PyObject *ids, Py_ssize_t skip) {
    Py_ssize_t count;
    if (id_count(ids, skip, &count) < 0) return -1;
    if (count < 0 || count > cap) return -2;
    return fill_range(out, ids, skip, 0, count) < 0 ? -1 : count;
}

// ---- what the checks want to know of the ids, found while the copy runs ----

static uint8_t *seen;  // a bitmap reused by every call (the GIL is held throughout)
static size_t seen_bytes;

// 1 if some id of ids[0:n] (all within [low, high]) is listed twice, 0 if none is, -1 if the
// range is too wide to tell here.
static int repeats(const int64_t *ids, Py_ssize_t n, int64_t low, int64_t high) {
    if (n < 2) return 0;
    if (n <= 64) {  // fewer steps than clearing a bitmap
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (ids[i] == ids[j]) return 1;
        return 0;
    }
    // Unsigned arithmetic: high - low may not fit an int64 (ids are unchecked here).
    uint64_t range = (uint64_t)high - (uint64_t)low;
    if (range >= ((uint64_t)1 << 27) || range >= (uint64_t)n * 64) return -1;  // too sparse here
    size_t bytes = (size_t)(range / 8 + 1);
    if (bytes > seen_bytes) {
        uint8_t *grown = realloc(seen, bytes);
        if (grown == NULL) return -1;
        seen = grown;
        seen_bytes = bytes;
    }
    memset(seen, 0, bytes);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = (uint64_t)ids[i] - (uint64_t)low;  // <= range: every id is in [low, high]
        if (seen[k >> 3] & (1u << (k & 7))) return 1;
        seen[k >> 3] |= (uint8_t)(1u << (k & 7));
    }
    return 0;
}

// (n, smallest source id, largest, smallest destination id, largest, destination repeats)
static PyObject *id_stats(const int64_t *src, const int64_t *dst, Py_ssize_t n) {
    int64_t s_lo = 0, s_hi = 0, d_lo = 0, d_hi = 0;
    if (n > 0) {
        s_lo = s_hi = src[0];
        d_lo = d_hi = dst[0];
    }
    for (Py_ssize_t i = 1; i < n; i++) {
        s_lo = src[i] < s_lo ? src[i] : s_lo;
        s_hi = src[i] > s_hi ? src[i] : s_hi;
        d_lo = dst[i] < d_lo ? dst[i] : d_lo;
        d_hi = dst[i] > d_hi ? dst[i] : d_hi;
    }
    return Py_BuildValue("nLLLLi", n, (long long)s_lo, (long long)s_hi, (long long)d_lo,
                         (long long)d_hi, repeats(dst, n, d_lo, d_hi));
}

// Launches the kernel of item l for ids [from, to) of its run at `at` in the slot.
static int launch_part(Launch *l, uint64_t slot_src, uint64_t slot_dst, Py_ssize_t at,
                       Py_ssize_t from, Py_ssize_t to, uint64_t stream) {
    if (to <= from) return 1;
    l->values[l->src_index] = slot_src + 8 * (uint64_t)(at + from);
    l->values[l->dst_index] = slot_dst + 8 * (uint64_t)(at + from);
    return cuda_ok(cu_launch(l->function, (unsigned)((to - from) * l->blocks_per_item), 1, 1,
                             l->threads, 1, 1, l->shared, (CUstream)(uintptr_t)stream, l->params,
                             NULL),
                   "cuLaunchKernel");
}

// queue(context, stream, model_stream, mark, done, slot_src, slot_dst, capacity, items)
//   items: tuple of (launch capsule, source ids, destination ids, skip)
// Writes each item's source ids[skip:] and destination ids into the slot (pinned host memory that
// the kernel reads: source ids at slot_src, destination ids at slot_dst, each item's run starting
// at an even index so every run stays 16-byte aligned), and queues on `stream`: a wait for `mark`
// recorded now on `model_stream` (when mark is non-zero), every item's kernel, and `done`.
// A long read is launched in two parts: the first HEAD_PAGES pages of each item as soon as their
// ids are in the slot, the rest once theirs are, so the copy starts while most ids are still
// being converted (8192 ids from Python lists take tens of microseconds).
// Returns, per item, (id count, smallest and largest source id, smallest and largest destination
// id, whether a destination id repeats: 1, 0, or -1 for "not known"), worked out once the copy
// is queued; or None when an item's counts differ or the ids do not fit (nothing is queued
// then). Ids of the first part that are not int64s raise TypeError or OverflowError, before
// anything is queued. Raises RuntimeError when a CUDA call fails, or when an id of a second part
// is not an int64: what was queued before stays queued, and `done` is recorded after it when it
// can be.
static PyObject *queue(PyObject *self, PyObject *args) {
    unsigned long long ctx, stream, model, model_mark, done, slot_src, slot_dst;
    Py_ssize_t cap;
    PyObject *items;
    if (!PyArg_ParseTuple(args, "KKKKKKKnO!", &ctx, &stream, &model, &model_mark, &done, &slot_src,
                          &slot_dst, &cap, &PyTuple_Type, &items))
        return NULL;
    if (!driver_loaded()) return NULL;
    mark(0);
    Py_ssize_t count = PyTuple_GET_SIZE(items), at = 0;
    if (count > MAX_ITEMS) {
        PyErr_SetString(PyExc_ValueError, "queue: too many pool pairs");
        return NULL;
    }
    Launch *launches[MAX_ITEMS];
    PyObject *srcs[MAX_ITEMS], *dsts[MAX_ITEMS];  // borrowed from items
    Py_ssize_t ns[MAX_ITEMS], skips[MAX_ITEMS], runs[MAX_ITEMS], heads[MAX_ITEMS];
    for (Py_ssize_t k = 0; k < count; k++) {  // counts only: nothing converted yet
        PyObject *item = PyTuple_GET_ITEM(items, k), *capsule;
        if (!PyArg_ParseTuple(item, "OOOn", &capsule, &srcs[k], &dsts[k], &skips[k])) return NULL;
        launches[k] = PyCapsule_GetPointer(capsule, LAUNCH);
        if (launches[k] == NULL) return NULL;
        if (skips[k] < 0) Py_RETURN_NONE;
        Py_ssize_t s, d;
        if (id_count(srcs[k], skips[k], &s) < 0 || id_count(dsts[k], 0, &d) < 0) return NULL;
        if (s < 0 || s != d || s > cap - at) Py_RETURN_NONE;
        if ((uint64_t)s * launches[k]->blocks_per_item > 0x7fffffffu) {
            PyErr_SetString(PyExc_ValueError, "queue: the grid would exceed 2^31 - 1 programs");
            return NULL;
        }
        ns[k] = s;
        runs[k] = at;
        heads[k] = s < HEAD_PAGES ? s : HEAD_PAGES;
        at += s + (s & 1);
    }
    int64_t *src_ids = (int64_t *)(uintptr_t)slot_src, *dst_ids = (int64_t *)(uintptr_t)slot_dst;
    for (Py_ssize_t k = 0; k < count; k++) {  // the first part's ids
        if (fill_range(src_ids + runs[k], srcs[k], skips[k], 0, heads[k]) < 0 ||
            fill_range(dst_ids + runs[k], dsts[k], 0, 0, heads[k]) < 0)
            return NULL;
    }
    mark(1);
    CUcontext previous = NULL;
    if (!cuda_ok(cu_get_ctx(&previous), "cuCtxGetCurrent")) return NULL;
    if (previous != (CUcontext)(uintptr_t)ctx &&
        !cuda_ok(cu_set_ctx((CUcontext)(uintptr_t)ctx), "cuCtxSetCurrent"))
        return NULL;
    mark(2);
    int ok = 1;
    if (model_mark != 0) {
        ok = cuda_ok(cu_record((CUevent)(uintptr_t)model_mark, (CUstream)(uintptr_t)model),
                     "cuEventRecord (model stream)") &&
             cuda_ok(cu_wait((CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)model_mark, 0),
                     "cuStreamWaitEvent");
    }
    mark(3);
    for (Py_ssize_t k = 0; ok && k < count; k++)
        ok = launch_part(launches[k], slot_src, slot_dst, runs[k], 0, heads[k], stream);
    int bad_ids = 0;
    for (Py_ssize_t k = 0; ok && k < count; k++) {  // the rest, while the first part copies
        if (ns[k] == heads[k]) continue;
        if (fill_range(src_ids + runs[k], srcs[k], skips[k], heads[k], ns[k]) < 0 ||
            fill_range(dst_ids + runs[k], dsts[k], 0, heads[k], ns[k]) < 0) {
            ok = 0;
            bad_ids = 1;
            break;
        }
        ok = launch_part(launches[k], slot_src, slot_dst, runs[k], heads[k], ns[k], stream);
    }
    mark(4);
    if (bad_ids) {  // the first part is queued: `done` still follows it (the caller fences)
        PyObject *type, *value, *trace;
        PyErr_Fetch(&type, &value, &trace);
        cu_record((CUevent)(uintptr_t)done, (CUstream)(uintptr_t)stream);
        if (previous != (CUcontext)(uintptr_t)ctx) cu_set_ctx(previous);
        PyObject *why = value != NULL ? PyObject_Str(value) : NULL;
        PyErr_Format(PyExc_RuntimeError,
                     "queue: a page id after the first %d of a pool is not an int64 (%S); the "
                     "copy of the first ones stays queued",
                     HEAD_PAGES, why != NULL ? why : Py_None);
        Py_XDECREF(why);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(trace);
        return NULL;
    }
    ok = ok && cuda_ok(cu_record((CUevent)(uintptr_t)done, (CUstream)(uintptr_t)stream),
                       "cuEventRecord (copy stream)");
    mark(5);
    if (previous != (CUcontext)(uintptr_t)ctx) cu_set_ctx(previous);
    if (!ok) return NULL;
    PyObject *out = PyTuple_New(count);
    if (out == NULL) return NULL;
    for (Py_ssize_t k = 0; k < count; k++) {
        PyObject *stats = id_stats(src_ids + runs[k], dst_ids + runs[k], ns[k]);
        if (stats == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, k, stats);
    }
    return out;
}

// query(event) -> bool: whether everything the event waits for has run.
static PyObject *query(PyObject *self, PyObject *arg) {
    unsigned long long event = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred() || !driver_loaded()) return NULL;
    CUresult r = cu_query((CUevent)(uintptr_t)event);
    if (r == CUDA_ERROR_NOT_READY) Py_RETURN_FALSE;
    if (!cuda_ok(r, "cuEventQuery")) return NULL;
    Py_RETURN_TRUE;
}

// primary_context(device) -> the handle of that device's primary context (retained).
static PyObject *primary_context(PyObject *self, PyObject *arg) {
    int ordinal = (int)PyLong_AsLong(arg);
    if (PyErr_Occurred() || !driver_loaded()) return NULL;
    CUdevice device;
    CUcontext ctx;
    if (!cuda_ok(cu_device_get(&device, ordinal), "cuDeviceGet")) return NULL;
    if (!cuda_ok(cu_retain(&ctx, device), "cuDevicePrimaryCtxRetain")) return NULL;
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)ctx);
}

// scan_ids(src_address, dst_address, n) -> the stats `queue` returns for n ids at those
// addresses: `id_stats` alone, for tests on machines without a GPU.
static PyObject *scan_ids(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "KKn", &src, &dst, &n)) return NULL;
    return id_stats((const int64_t *)(uintptr_t)src, (const int64_t *)(uintptr_t)dst, n);
}

// fill_ids(address, capacity, ids, skip) -> count, or None when they do not fit: `fill` alone,
// for tests on machines without a GPU.
static PyObject *fill_ids(PyObject *self, PyObject *args) {
    unsigned long long address;
    Py_ssize_t cap, skip;
    PyObject *ids;
    if (!PyArg_ParseTuple(args, "KnOn", &address, &cap, &ids, &skip)) return NULL;
    if (skip < 0) Py_RETURN_NONE;
    Py_ssize_t n = fill((int64_t *)(uintptr_t)address, cap, ids, skip);
    if (n == -1) return NULL;
    if (n < 0) Py_RETURN_NONE;
    return PyLong_FromSsize_t(n);
}

static PyMethodDef methods[] = {
    {"prepare", prepare, METH_VARARGS, "a prepared launch of one compiled kernel"},
    {"queue", queue, METH_VARARGS, "ids into a slot, then the launches and events"},
    {"query", query, METH_O, "whether an event has completed"},
    {"primary_context", primary_context, METH_O, "a device's primary context handle"},
    {"fill_ids", fill_ids, METH_VARARGS, "page ids into host memory (tests)"},
    {"scan_ids", scan_ids, METH_VARARGS, "the id stats of queue (tests)"},
    {"timings", timings, METH_NOARGS, "microseconds of each step of the last queue call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "duet_page_copy_launch", NULL, -1,
                                    methods};

PyMODINIT_FUNC PyInit_duet_page_copy_launch(void) { return PyModule_Create(&module); }
