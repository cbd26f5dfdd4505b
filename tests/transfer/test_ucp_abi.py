"""transfer/ucp_abi.py's ctypes layouts against the C header of the UCX it calls: compiled with the
machine's C compiler and the headers the libucx wheel ships."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from transfer.ucp_abi import (
    UCP_DATATYPE_IOV,
    UCP_OP_ATTR_FIELD_CALLBACK,
    UCP_OP_ATTR_FIELD_DATATYPE,
    UCP_OP_ATTR_FIELD_USER_DATA,
    UCP_WORKER_ATTR_FIELD_THREAD_MODE,
    UCS_STATUS,
    UCS_THREAD_MODE_MULTI,
    UcpDtIov,
    UcpRequestParam,
    UcpWorkerAttr,
)

PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include <ucp/api/ucp.h>
#define OFF(t, f) printf(#t "." #f " %zu\n", offsetof(t, f))
int main(void) {
    OFF(ucp_request_param_t, op_attr_mask); OFF(ucp_request_param_t, flags);
    OFF(ucp_request_param_t, request); OFF(ucp_request_param_t, cb);
    OFF(ucp_request_param_t, datatype); OFF(ucp_request_param_t, user_data);
    OFF(ucp_request_param_t, reply_buffer); OFF(ucp_request_param_t, memory_type);
    OFF(ucp_request_param_t, recv_info); OFF(ucp_request_param_t, memh);
    OFF(ucp_dt_iov_t, buffer); OFF(ucp_dt_iov_t, length);
    OFF(ucp_worker_attr_t, field_mask); OFF(ucp_worker_attr_t, thread_mode);
    printf("sizeof.ucp_request_param_t %zu\n", sizeof(ucp_request_param_t));
    printf("sizeof.ucp_dt_iov_t %zu\n", sizeof(ucp_dt_iov_t));
    printf("sizeof.ucp_worker_attr_t %zu\n", sizeof(ucp_worker_attr_t));
    printf("sizeof.ucs_status_t %zu\n", sizeof(ucs_status_t));
    printf("const.iov %d\n", (int)UCP_DATATYPE_IOV);
    printf("const.multi %d\n", (int)UCS_THREAD_MODE_MULTI);
    printf("const.cb %d\n", (int)UCP_OP_ATTR_FIELD_CALLBACK);
    printf("const.user_data %d\n", (int)UCP_OP_ATTR_FIELD_USER_DATA);
    printf("const.datatype %d\n", (int)UCP_OP_ATTR_FIELD_DATATYPE);
    printf("const.thread_mode %d\n", (int)UCP_WORKER_ATTR_FIELD_THREAD_MODE);
    return 0;
}
"""


def header_values(tmp_path: Path) -> dict[str, int]:
    import libucx

    include = Path(libucx.__file__).parent / "include"
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None or not (include / "ucp" / "api" / "ucp.h").exists():
        pytest.skip("needs a C compiler and the libucx wheel's headers")
    (tmp_path / "abi.c").write_text(PROGRAM)
    subprocess.run(
        [cc, f"-I{include}", str(tmp_path / "abi.c"), "-o", str(tmp_path / "abi")],
        check=True,
        timeout=60,
    )
    out = subprocess.run([str(tmp_path / "abi")], capture_output=True, text=True, check=True)
    return {k: int(v) for k, v in (line.split() for line in out.stdout.splitlines())}


def test_ctypes_layouts_and_constants_match_ucp_h(tmp_path: Path) -> None:
    c = header_values(tmp_path)
    for struct, name in (
        (UcpRequestParam, "ucp_request_param_t"),
        (UcpDtIov, "ucp_dt_iov_t"),
        (UcpWorkerAttr, "ucp_worker_attr_t"),
    ):
        for field, _ in struct._fields_:
            if f"{name}.{field}" in c:
                assert getattr(struct, field).offset == c[f"{name}.{field}"], (name, field)
    assert ctypes.sizeof(UcpRequestParam) == c["sizeof.ucp_request_param_t"]
    assert ctypes.sizeof(UcpDtIov) == c["sizeof.ucp_dt_iov_t"]
    assert ctypes.sizeof(UCS_STATUS) == c["sizeof.ucs_status_t"]  # a packed enum: one byte
    # UCP writes only the fields the mask names, but the buffer must hold the whole structure.
    assert ctypes.sizeof(UcpWorkerAttr) >= c["sizeof.ucp_worker_attr_t"]
    assert (UCP_DATATYPE_IOV, UCS_THREAD_MODE_MULTI) == (c["const.iov"], c["const.multi"])
    assert (UCP_OP_ATTR_FIELD_CALLBACK, UCP_OP_ATTR_FIELD_USER_DATA) == (
        c["const.cb"],
        c["const.user_data"],
    )
    assert UCP_OP_ATTR_FIELD_DATATYPE == c["const.datatype"]
    assert UCP_WORKER_ATTR_FIELD_THREAD_MODE == c["const.thread_mode"]
