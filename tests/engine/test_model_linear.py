"""The model's Linear: duet_kernels.linear with a packed weight that follows every write to the weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.model.linear import Linear, MergedLinear


def test_linear_repacks_after_the_weight_changes() -> None:
    gen = torch.Generator().manual_seed(0)
    layer = Linear(16, 24, bias=True)
    x = torch.randn((5, 16), generator=gen)
    with torch.inference_mode():
        first = layer(x)
    torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        layer.weight.copy_(torch.randn((24, 16), generator=gen))  # as load_weights writes
    with torch.inference_mode():
        second = layer(x)
    torch.testing.assert_close(second, F.linear(x, layer.weight, layer.bias))
    assert not torch.allclose(first, second)


def test_linear_repacks_after_the_weight_is_replaced_by_a_slice() -> None:
    """A sharded layer keeps some rows of its weight: a slice from row 0 has the old data pointer."""
    gen = torch.Generator().manual_seed(2)
    layer = Linear(16, 24, bias=False)
    x = torch.randn((5, 16), generator=gen)
    with torch.inference_mode():
        assert layer(x).shape == (5, 24)
    layer.weight = torch.nn.Parameter(layer.weight.detach()[:8], requires_grad=False)
    with torch.inference_mode():
        out = layer(x)
    torch.testing.assert_close(out, F.linear(x, layer.weight))


def test_merged_linear_loads_shards_and_splits() -> None:
    gen = torch.Generator().manual_seed(1)
    layer = MergedLinear(8, (4, 2), bias=False)
    a, b = torch.randn((4, 8), generator=gen), torch.randn((2, 8), generator=gen)
    layer.load_shard(0, "weight", a)
    layer.load_shard(1, "weight", b)
    x = torch.randn((3, 8), generator=gen)
    with torch.inference_mode():
        out_a, out_b = layer.split(layer(x))
    torch.testing.assert_close(out_a, x @ a.T)
    torch.testing.assert_close(out_b, x @ b.T)
