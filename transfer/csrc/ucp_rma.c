/* One-sided UCX writes for the KV transceiver (transfer/rma.py): the few UCP calls ucxx's Python
 * API does not expose.
 *
 * D registers its pools (map) and sends the packed remote keys in Hello; P unpacks them on the
 * link's endpoint (unpack) and writes each page run of a pull straight from its pool into D's
 * (put), then flushes the endpoint: the flush completes only when every write is in D's memory.
 * No staging copy on either side, and over TCP a put is one stream write that D's worker reads
 * straight into the destination, where a tag message costs a rendezvous.
 *
 * Threading: ucxx makes its worker with UCS_THREAD_MODE_MULTI, so these calls may run on any
 * thread while ucxx's progress thread progresses the worker. Nothing here progresses it: a batch's
 * end is the flush callback, which runs on the progress thread and writes the batch's eventfd
 * (the caller's event loop watches it). A batch lives until both the caller's capsule and the
 * callback have let go of it, so a caller that gives up waiting never frees what UCX still uses.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <ucp/api/ucp.h>

#define BATCH_CAPSULE "duet_ucp_rma.batch"

typedef struct {
    int refs;                 /* caller's capsule + pending flush callback */
    int efd;                  /* readable once the batch has ended */
    int done;                 /* set (release) after status */
    ucs_status_t status;      /* the flush's status */
    ucs_status_t post_status; /* the first put that could not be posted */
    Py_ssize_t posted;        /* puts handed to UCX */
} batch_t;

static void batch_unref(batch_t *b) {
    if (__atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        close(b->efd);
        free(b);
    }
}

static void batch_end(batch_t *b, ucs_status_t status) {
    uint64_t one = 1;
    b->status = status;
    __atomic_store_n(&b->done, 1, __ATOMIC_RELEASE);
    if (write(b->efd, &one, sizeof(one)) < 0) {
        /* an eventfd write only fails on counter overflow: the fd is readable already */
    }
}

static void flush_done(void *request, ucs_status_t status, void *user_data) {
    batch_t *b = (batch_t *)user_data;
    batch_end(b, status);
    ucp_request_free(request);
    batch_unref(b);
}

static void capsule_free(PyObject *capsule) {
    batch_t *b = (batch_t *)PyCapsule_GetPointer(capsule, BATCH_CAPSULE);
    if (b != NULL) batch_unref(b);
}

static PyObject *ucs_error(const char *what, ucs_status_t status) {
    PyErr_Format(PyExc_RuntimeError, "%s: %s", what, ucs_status_string(status));
    return NULL;
}

/* map(context, address, length) -> (memh, packed remote key) */
static PyObject *rma_map(PyObject *self, PyObject *args) {
    unsigned long long context, address, length;
    if (!PyArg_ParseTuple(args, "KKK", &context, &address, &length)) return NULL;
    ucp_mem_map_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
    params.address = (void *)(uintptr_t)address;
    params.length = (size_t)length;
    ucp_mem_h memh;
    ucs_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = ucp_mem_map((ucp_context_h)(uintptr_t)context, &params, &memh);
    Py_END_ALLOW_THREADS
    if (status != UCS_OK) return ucs_error("ucp_mem_map", status);
    void *packed;
    size_t packed_len;
    status = ucp_rkey_pack((ucp_context_h)(uintptr_t)context, memh, &packed, &packed_len);
    if (status != UCS_OK) {
        ucp_mem_unmap((ucp_context_h)(uintptr_t)context, memh);
        return ucs_error("ucp_rkey_pack", status);
    }
    PyObject *out = Py_BuildValue("Ky#", (unsigned long long)(uintptr_t)memh, (const char *)packed,
                                  (Py_ssize_t)packed_len);
    ucp_rkey_buffer_release(packed);
    if (out == NULL) ucp_mem_unmap((ucp_context_h)(uintptr_t)context, memh);
    return out;
}

/* unmap(context, memh) */
static PyObject *rma_unmap(PyObject *self, PyObject *args) {
    unsigned long long context, memh;
    if (!PyArg_ParseTuple(args, "KK", &context, &memh)) return NULL;
    ucs_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = ucp_mem_unmap((ucp_context_h)(uintptr_t)context, (ucp_mem_h)(uintptr_t)memh);
    Py_END_ALLOW_THREADS
    if (status != UCS_OK) return ucs_error("ucp_mem_unmap", status);
    Py_RETURN_NONE;
}

/* unpack(endpoint, packed remote key) -> rkey */
static PyObject *rma_unpack(PyObject *self, PyObject *args) {
    unsigned long long ep;
    Py_buffer packed;
    if (!PyArg_ParseTuple(args, "Ky*", &ep, &packed)) return NULL;
    ucp_rkey_h rkey;
    ucs_status_t status;
    Py_BEGIN_ALLOW_THREADS
    status = ucp_ep_rkey_unpack((ucp_ep_h)(uintptr_t)ep, packed.buf, &rkey);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&packed);
    if (status != UCS_OK) return ucs_error("ucp_ep_rkey_unpack", status);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)rkey);
}

/* destroy(rkey) */
static PyObject *rma_destroy(PyObject *self, PyObject *args) {
    unsigned long long rkey;
    if (!PyArg_ParseTuple(args, "K", &rkey)) return NULL;
    ucp_rkey_destroy((ucp_rkey_h)(uintptr_t)rkey);
    Py_RETURN_NONE;
}

/* put(worker, endpoint, ops) -> batch. ``ops``: a C-contiguous buffer of uint64 quadruples
 * (local address, remote address, bytes, rkey), one per page run. Posts every put, then the
 * endpoint's flush; the batch ends when the flush does (or at once, if nothing is in flight). */
static PyObject *rma_put(PyObject *self, PyObject *args) {
    unsigned long long worker, ep;
    Py_buffer ops;
    if (!PyArg_ParseTuple(args, "KKy*", &worker, &ep, &ops)) return NULL;
    if (ops.len % (4 * sizeof(uint64_t)) != 0) {
        PyBuffer_Release(&ops);
        PyErr_SetString(PyExc_ValueError, "ops must be uint64 quadruples");
        return NULL;
    }
    batch_t *b = (batch_t *)calloc(1, sizeof(batch_t));
    if (b == NULL) {
        PyBuffer_Release(&ops);
        return PyErr_NoMemory();
    }
    b->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (b->efd < 0) {
        free(b);
        PyBuffer_Release(&ops);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    b->refs = 1;
    PyObject *capsule = PyCapsule_New(b, BATCH_CAPSULE, capsule_free);
    if (capsule == NULL) {
        close(b->efd);
        free(b);
        PyBuffer_Release(&ops);
        return NULL;
    }
    const uint64_t *op = (const uint64_t *)ops.buf;
    Py_ssize_t n = ops.len / (Py_ssize_t)(4 * sizeof(uint64_t));
    ucp_ep_h endpoint = (ucp_ep_h)(uintptr_t)ep;
    Py_BEGIN_ALLOW_THREADS
    ucp_request_param_t none;
    memset(&none, 0, sizeof(none));
    b->post_status = UCS_OK;
    for (Py_ssize_t i = 0; i < n; i++, op += 4) {
        if (op[2] == 0) continue;
        ucs_status_ptr_t r = ucp_put_nbx(endpoint, (const void *)(uintptr_t)op[0], (size_t)op[2],
                                         op[1], (ucp_rkey_h)(uintptr_t)op[3], &none);
        if (UCS_PTR_IS_ERR(r)) {
            b->post_status = UCS_PTR_STATUS(r);
            break;
        }
        if (r != NULL) ucp_request_free(r); /* the put goes on; the flush tells its end */
        b->posted++;
    }
    /* Flushed even after a failed post: the puts posted before it may still be reading. */
    ucp_request_param_t param;
    memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send = flush_done;
    param.user_data = b;
    __atomic_add_fetch(&b->refs, 1, __ATOMIC_ACQ_REL); /* the callback's */
    ucs_status_ptr_t r = ucp_ep_flush_nbx(endpoint, &param);
    if (!UCS_PTR_IS_PTR(r)) { /* done already, or failed: no callback will come */
        batch_end(b, UCS_PTR_STATUS(r));
        batch_unref(b);
    } else {
        /* ucxx's progress thread may be asleep in epoll: wake it for the pending writes. */
        ucp_worker_signal((ucp_worker_h)(uintptr_t)worker);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&ops);
    return capsule;
}

static batch_t *batch_of(PyObject *capsule) {
    return (batch_t *)PyCapsule_GetPointer(capsule, BATCH_CAPSULE);
}

/* fileno(batch) -> the eventfd that becomes readable when the batch ends */
static PyObject *rma_fileno(PyObject *self, PyObject *capsule) {
    batch_t *b = batch_of(capsule);
    return b == NULL ? NULL : PyLong_FromLong(b->efd);
}

/* status(batch) -> None while in flight, else (ok, message, puts posted) */
static PyObject *rma_status(PyObject *self, PyObject *capsule) {
    batch_t *b = batch_of(capsule);
    if (b == NULL) return NULL;
    if (!__atomic_load_n(&b->done, __ATOMIC_ACQUIRE)) Py_RETURN_NONE;
    ucs_status_t s = b->post_status != UCS_OK ? b->post_status : b->status;
    const char *what = b->post_status != UCS_OK ? "posting a put failed: " : "";
    PyObject *message = s == UCS_OK ? PyUnicode_FromString("")
                                    : PyUnicode_FromFormat("%s%s", what, ucs_status_string(s));
    if (message == NULL) return NULL;
    return Py_BuildValue("ONn", s == UCS_OK ? Py_True : Py_False, message, b->posted);
}

static PyMethodDef methods[] = {
    {"map", rma_map, METH_VARARGS, "map(context, address, length) -> (memh, packed rkey)"},
    {"unmap", rma_unmap, METH_VARARGS, "unmap(context, memh)"},
    {"unpack", rma_unpack, METH_VARARGS, "unpack(endpoint, packed rkey) -> rkey"},
    {"destroy", rma_destroy, METH_VARARGS, "destroy(rkey)"},
    {"put", rma_put, METH_VARARGS, "put(worker, endpoint, ops) -> batch"},
    {"fileno", rma_fileno, METH_O, "fileno(batch) -> eventfd, readable once the batch ended"},
    {"status", rma_status, METH_O, "status(batch) -> None or (ok, message, puts posted)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "duet_ucp_rma", "One-sided UCX writes (transfer/rma.py).", -1, methods,
};

PyMODINIT_FUNC PyInit_duet_ucp_rma(void) { return PyModule_Create(&module_def); }
