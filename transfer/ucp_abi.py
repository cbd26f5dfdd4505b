"""The few pieces of UCP's C API that transfer/ucp_iov.py calls through ctypes (UCX 1.21's ucp.h:
structure layouts checked against the header by tests/transfer/test_ucp_abi.py where a compiler
is at hand), and the completion callbacks of csrc/ucp_done.c, built on first use."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CALLBACKS_SOURCE = Path(__file__).parent / "csrc" / "ucp_done.c"
UCS_STATUS = ctypes.c_int8  # ucs_status_t: a packed enum, one byte (ucs/type/status.h)
UCS_OK, UCS_INPROGRESS = 0, 1
UCS_ERR_LAST = -100  # a returned "request" at or above 2**64 + this is an error status
UCS_THREAD_MODE_MULTI = 2
UCP_DATATYPE_IOV = 2
UCP_OP_ATTR_FIELD_CALLBACK = 1 << 1
UCP_OP_ATTR_FIELD_USER_DATA = 1 << 2
UCP_OP_ATTR_FIELD_DATATYPE = 1 << 3
UCP_WORKER_ATTR_FIELD_THREAD_MODE = 1 << 0
FULL_TAG_MASK = (1 << 64) - 1


class UcpRequestParam(ctypes.Structure):
    """``ucp_request_param_t`` (ucp.h, UCX 1.21); UCP reads the fields ``op_attr_mask`` names."""

    _fields_ = [
        ("op_attr_mask", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("request", ctypes.c_void_p),
        ("cb", ctypes.c_void_p),
        ("datatype", ctypes.c_uint64),
        ("user_data", ctypes.c_void_p),
        ("reply_buffer", ctypes.c_void_p),
        ("memory_type", ctypes.c_int),
        ("recv_info", ctypes.c_void_p),
        ("memh", ctypes.c_void_p),
    ]


class UcpDtIov(ctypes.Structure):
    """``ucp_dt_iov_t``: one piece."""

    _fields_ = [("buffer", ctypes.c_void_p), ("length", ctypes.c_size_t)]


class UcpWorkerAttr(ctypes.Structure):
    """The head of ``ucp_worker_attr_t``; UCP reads and writes only the fields its mask names."""

    _fields_ = [
        ("field_mask", ctypes.c_uint64),
        ("thread_mode", ctypes.c_int),
        ("_rest", ctypes.c_uint8 * 256),
    ]


class UcpIovError(RuntimeError):
    """A UCP call or message with an IOV datatype failed; the text names UCP's status."""


_P, _U64, _PARAM = ctypes.c_void_p, ctypes.c_uint64, ctypes.POINTER(UcpRequestParam)
# name -> (result, arguments), as in ucp.h; ucs_status_t is one byte
_SIGNATURES = {
    "ucp_tag_send_nbx": (_P, [_P, _P, ctypes.c_size_t, _U64, _PARAM]),
    "ucp_tag_recv_nbx": (_P, [_P, _P, ctypes.c_size_t, _U64, _U64, _PARAM]),
    "ucp_request_check_status": (UCS_STATUS, [_P]),
    "ucp_request_cancel": (None, [_P, _P]),
    "ucp_request_free": (None, [_P]),
    "ucp_worker_query": (UCS_STATUS, [_P, ctypes.POINTER(UcpWorkerAttr)]),
    "ucp_worker_signal": (UCS_STATUS, [_P]),
    "ucs_status_string": (ctypes.c_char_p, [UCS_STATUS]),
}


def load_libucp() -> ctypes.CDLL:
    import libucx

    path = os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so.0")
    lib = ctypes.CDLL(path if os.path.exists(path) else "libucp.so.0")
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def iov_array(pieces: Any) -> ctypes.Array:
    """UCP's IOV array of (address, length) ``pieces`` (a uint64 [n, 2] array or pairs), in
    memory of its own: one copy of the rows, not a ctypes assignment per piece."""
    rows = np.ascontiguousarray(np.asarray(pieces, dtype=np.uint64).reshape(-1, 2))
    return (UcpDtIov * len(rows)).from_buffer_copy(rows)


class OpSlot(ctypes.Structure):
    """``duet_op`` of csrc/ucp_done.c: one request's user data, read and written by its callback.
    It must outlive the request (the callback writes it), so its owner keeps it until then."""

    _fields_ = [
        ("fd", ctypes.c_int64),
        ("state", ctypes.c_int64),
        ("status", ctypes.c_int64),
        ("request", ctypes.c_void_p),
    ]


OP_OUT, OP_CANCELLING, OP_FREED, OP_ENDED = 0, 1, 2, 3  # OpSlot.state (csrc/ucp_done.c)


class Callbacks:
    """csrc/ucp_done.c, loaded and told which libucp to free and cancel requests with: the two
    callbacks' addresses, its overflow flag, and the loop's side of an op slot."""

    def __init__(self, lib: ctypes.CDLL, ucp: ctypes.CDLL) -> None:
        self.lib = lib  # (keeps the library loaded while UCP may call it)
        self.send = ctypes.cast(lib.duet_ucp_send_done, ctypes.c_void_p).value
        self.recv = ctypes.cast(lib.duet_ucp_recv_done, ctypes.c_void_p).value
        self.overflowed = ctypes.c_int.in_dll(lib, "duet_ucp_overflowed")
        size = ctypes.c_int64.in_dll(lib, "duet_op_size").value
        if size != ctypes.sizeof(OpSlot):
            raise RuntimeError(f"duet_op is {size} bytes, OpSlot {ctypes.sizeof(OpSlot)}")
        lib.duet_ucp_use.argtypes = [_P, _P]
        lib.duet_ucp_use.restype = None
        lib.duet_ucp_use(
            ctypes.cast(ucp.ucp_request_free, _P), ctypes.cast(ucp.ucp_request_cancel, _P)
        )
        self.cancel = lib.duet_ucp_cancel
        self.cancel.argtypes, self.cancel.restype = [_P, ctypes.POINTER(OpSlot)], ctypes.c_int
        self._state = lib.duet_ucp_state
        self._state.argtypes = [ctypes.POINTER(OpSlot), ctypes.POINTER(ctypes.c_int64)]
        self._state.restype = ctypes.c_int64

    def state(self, slot: OpSlot) -> tuple[int, int]:
        """(state, UCP's status) of ``slot``, read after its callback's stores."""
        status = ctypes.c_int64()
        return self._state(slot, ctypes.byref(status)), status.value


@functools.lru_cache(maxsize=1)
def completion_callbacks() -> Callbacks | None:
    """csrc/ucp_done.c, built on first use; None, logged once, when it cannot be built here (no C
    compiler; ``DUET_UCP_CALLBACKS=0`` asks for none): completions are then polled."""
    if os.environ.get("DUET_UCP_CALLBACKS", "1") == "0":
        return None
    try:
        from kernels.native_launch import build_library, compiler_problem

        path = build_library(CALLBACKS_SOURCE, "duet_ucp_done", ".so", [], compiler_problem)
        return Callbacks(ctypes.CDLL(str(path)), load_libucp())
    except Exception as e:  # no compiler, a failed build: polling does the same, with more CPU
        log.warning("UCP completion callbacks unavailable (%s); polling UCP requests instead", e)
        return None
