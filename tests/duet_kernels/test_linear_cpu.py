"""The CPU linear (oneDNN) against torch's F.linear, its reference twin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import duet_kernels
from duet_kernels.linear_cpu import linear_cpu, onednn_available

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("rows", [0, 1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cpu_matches_f_linear(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn((rows, 96), generator=gen)
    weight = torch.randn((200, 96), generator=gen) / 10
    b = torch.randn(200, generator=gen) if bias else None
    out = linear_cpu(x, weight, b)
    assert out.shape == (rows, 200) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_linear_cpu_keeps_leading_dims_and_strided_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn((3, 5, 128), generator=gen)[:, :, ::2]  # last dim strided
    weight = torch.randn((40, 64), generator=gen)
    torch.testing.assert_close(linear_cpu(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_dispatch_uses_torch_for_other_dtypes_and_on_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn((4, 32), generator=gen).to(torch.bfloat16)
    weight = torch.randn((8, 32), generator=gen).to(torch.bfloat16)
    assert torch.equal(duet_kernels.linear(x, weight), F.linear(x, weight))
    monkeypatch.setenv("DUET_KERNELS", "ref")
    xf, wf = x.float(), weight.float()
    assert torch.equal(duet_kernels.linear(xf, wf), F.linear(xf, wf))


@pytest.mark.parametrize("rows", [1, 2, 7, 32, 300])
def test_packed_weight_gives_the_unpacked_results(rows: int) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn((rows, 96), generator=gen)
    weight = torch.randn((200, 96), generator=gen) / 10
    packed = duet_kernels.pack_linear_weight(weight)
    assert packed is not None
    torch.testing.assert_close(
        duet_kernels.linear(x, weight, packed=packed), F.linear(x, weight), rtol=1e-5, atol=1e-5
    )


def test_no_packing_off_the_cpu_path(monkeypatch: pytest.MonkeyPatch) -> None:
    assert duet_kernels.pack_linear_weight(torch.randn(8, 4).to(torch.bfloat16)) is None
    monkeypatch.setenv("DUET_KERNELS", "ref")
    assert duet_kernels.pack_linear_weight(torch.randn(8, 4)) is None
