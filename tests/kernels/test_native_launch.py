"""kernels/native_launch.py: the C launcher builds with the machine's compiler and loads; its id
filling (the part that runs without a GPU) is exact for lists and arrays and refuses what does not
fit or is not an int; the PTX parameter reader counts what it should and refuses what it cannot
account for. Launches themselves are tested on a GPU (test_gpu_kernels.py,
tests/transfer/test_direct_copy_gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kernels import native_launch

# Skipped only where nothing can build it; with a compiler and Python's headers it must build.
pytestmark = pytest.mark.skipif(
    native_launch.toolchain_problem() is not None, reason=str(native_launch.toolchain_problem())
)

PTX = """
.visible .entry _copy_pairs_kernel(
	.param .u64 .ptr .global .align 1 _copy_pairs_kernel_param_0,
	.param .u64 .ptr .global .align 1 _copy_pairs_kernel_param_1,
	.param .u32 _copy_pairs_kernel_param_2,
	.param .u64 .ptr .global .align 1 _copy_pairs_kernel_param_3,
	.param .u64 .ptr .global .align 1 _copy_pairs_kernel_param_4
)
.maxntid 128, 1, 1
{
"""


@pytest.fixture(scope="module")
def mod():
    m = native_launch.module()
    assert m is not None, "the C launcher did not build (see the log)"
    return m


def test_fill_copies_lists_and_arrays_from_skip(mod) -> None:
    out = np.full(8, -7, dtype=np.int64)
    assert mod.fill_ids(out.ctypes.data, 8, [5, 6, 7, 2**40], 1) == 3
    assert out[:4].tolist() == [6, 7, 2**40, -7]
    ids = np.arange(100, 110, dtype=np.int64)
    assert mod.fill_ids(out.ctypes.data, 8, ids, 2) == 8
    assert out.tolist() == list(range(102, 110))
    # Other arrays (strided, narrower ints) are refused: the caller takes the Python path.
    for other in (np.arange(20, dtype=np.int64)[::4], np.array([3, 1], dtype=np.int32)):
        with pytest.raises(TypeError):
            mod.fill_ids(out.ctypes.data, 8, other, 0)


def test_fill_reads_only_native_int64_arrays_and_plain_sequences(mod) -> None:
    out = np.zeros(4, dtype=np.int64)
    swapped = np.array([1, 2, 3], dtype=">i8")  # not memcpy'd: read value by value
    with pytest.raises(TypeError):  # an array of another byte order is neither
        mod.fill_ids(out.ctypes.data, 4, swapped, 0)
    assert mod.fill_ids(out.ctypes.data, 4, np.array([4, 5], dtype="<i8"), 0) == 2
    assert out[:2].tolist() == [4, 5]
    assert mod.fill_ids(out.ctypes.data, 4, (7, 8, 9), 1) == 2  # a tuple
    for bad in ({1: 2}, {3}, b"\x01\x02", "12", range(3)):
        with pytest.raises(TypeError):
            mod.fill_ids(out.ctypes.data, 4, bad, 0)


def test_fill_refuses_what_does_not_fit_and_non_ints(mod) -> None:
    out = np.zeros(4, dtype=np.int64)
    assert mod.fill_ids(out.ctypes.data, 4, list(range(5)), 0) is None  # no room
    assert mod.fill_ids(out.ctypes.data, 4, [1, 2], 3) is None  # skip past the end
    assert mod.fill_ids(out.ctypes.data, 4, [1, 2], -1) is None
    with pytest.raises(TypeError):
        mod.fill_ids(out.ctypes.data, 4, [1, "2"], 0)
    with pytest.raises(OverflowError):
        mod.fill_ids(out.ctypes.data, 4, [2**70], 0)
    # Refusals wrote nothing; the non-int stopped the fill after its first id.
    assert out.tolist() == [1, 0, 0, 0]


def test_fill_runs_no_python_code_of_an_id(mod) -> None:
    """Ints, int subclasses and numpy's integers are read in C; an object whose ``__index__`` is
    Python code (which could change the list being read) is refused before it runs."""
    import enum

    class Page(enum.IntEnum):
        ONE = 1

    out = np.zeros(4, dtype=np.int64)
    assert mod.fill_ids(out.ctypes.data, 4, [Page.ONE, True, np.int64(7), np.uint16(9)], 0) == 4
    assert out.tolist() == [1, 1, 7, 9]
    ids: list = [3]

    class Sneaky:
        def __index__(self) -> int:
            ids.clear()  # (a list read by C, emptied under it)
            return 5

    ids.append(Sneaky())
    with pytest.raises(TypeError, match="Sneaky"):
        mod.fill_ids(out.ctypes.data, 4, ids, 0)
    assert len(ids) == 2  # its __index__ never ran


def test_scan_finds_bounds_and_repeats(mod) -> None:
    def scan(src: list[int], dst: list[int]) -> tuple[int, ...]:
        a, b = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
        return mod.scan_ids(a.ctypes.data, b.ctypes.data, len(src))

    assert scan([], []) == (0, 0, 0, 0, 0, 0)
    assert scan([7, 3, 9], [4, 8, 2]) == (3, 3, 9, 2, 8, 0)
    assert scan([1, 2, 3], [4, 8, 4])[5] == 1
    rng = np.random.default_rng(0)
    many = rng.permutation(100_000)[:5000] + 1  # past the pairwise loop: the bitmap
    assert scan(many.tolist(), many.tolist()) == (
        5000,
        many.min(),
        many.max(),
        many.min(),
        many.max(),
        0,
    )
    twice = many.copy()
    twice[4000] = twice[17]
    assert scan(many.tolist(), twice.tolist())[5] == 1
    wide = [1, 2**40] + list(range(3, 101))  # a range too wide for the bitmap: not known
    assert scan(wide, wide)[5] == -1
    assert scan([-5, 3], [-2, -9])[1:5] == (-5, 3, -9, -2)
    # Unchecked ids at the int64 extremes: the span does not fit an int64 (no bitmap for it).
    extremes = [-(2**63), 2**63 - 1] + list(range(1, 70))
    assert scan(extremes, extremes) == (71, -(2**63), 2**63 - 1, -(2**63), 2**63 - 1, -1)


def test_ptx_parameters_reads_sizes_and_refuses_structs() -> None:
    assert native_launch.ptx_parameters(PTX, "_copy_pairs_kernel") == [8, 8, 4, 8, 8]
    with pytest.raises(ValueError, match="no entry"):
        native_launch.ptx_parameters(PTX, "other_kernel")
    struct = PTX.replace(".param .u32 _copy", ".param .align 8 .b8 _copy")
    with pytest.raises(ValueError, match="unexpected PTX parameter"):
        native_launch.ptx_parameters(struct, "_copy_pairs_kernel")


def test_disabled_by_environment(monkeypatch) -> None:
    monkeypatch.setenv("DUET_NATIVE_LAUNCH", "0")
    native_launch.module.cache_clear()
    try:
        assert native_launch.module() is None
    finally:
        monkeypatch.undo()
        native_launch.module.cache_clear()


def _compiled(signature: dict[str, str], ptx_params: list[str], **metadata):
    """A stand-in for a Triton CompiledKernel: the parts _parameters reads."""
    from types import SimpleNamespace

    decls = ",\n".join(f"\t.param .{t} k_param_{i}" for i, t in enumerate(ptx_params))
    md = {"name": "k", "global_scratch_size": 0, "profile_scratch_size": 0, "num_ctas": 1}
    return SimpleNamespace(
        metadata=SimpleNamespace(**{**md, **metadata}),
        src=SimpleNamespace(signature=signature),
        asm={"ptx": f".visible .entry k(\n{decls}\n)\n{{"},
    )


def test_parameters_follow_triton_signature_and_ptx() -> None:
    names = ["src", "ids", "rows", "one", "BLOCK"]
    sig = {"src": "*i32", "ids": "*i64", "rows": "i32", "one": "constexpr", "BLOCK": "constexpr"}
    # Two trailing scratch pointers (Triton >= 3.5), or none.
    for extra in ([], ["u64"], ["u64", "u64"]):
        params = native_launch._parameters(_compiled(sig, ["u64", "u64", "u32", *extra]), names)
        assert params == ["src", "ids", "rows", *[None] * len(extra)]
    bad = [
        (_compiled(sig, ["u64", "u64"]), "PTX has 2 parameters"),
        (_compiled(sig, ["u64", "u64", "u32", "u64", "u64", "u64"]), "PTX has 6"),
        (_compiled(sig, ["u64", "u64", "u64"]), "argument rows"),  # an i32 passed as 8 bytes
        (_compiled(sig, ["u64", "u64", "u32", "u32"]), "not pointers"),
        (_compiled(sig, ["u64", "u64", "u32"], global_scratch_size=64), "global_scratch"),
        (_compiled(sig, ["u64", "u64", "u32"], num_ctas=2), "clusters"),
    ]
    for compiled, error in bad:
        with pytest.raises(ValueError, match=error):
            native_launch._parameters(compiled, names)


def test_prepared_launch_binds_every_kept_argument_or_refuses(mod) -> None:
    names = ["src", "ids", "rows", "BLOCK"]
    sig = {"src": "*i32", "ids": "*i64", "rows": "i32", "BLOCK": "constexpr"}
    compiled = _compiled(sig, ["u64", "u64", "u32", "u64", "u64"], num_warps=4, shared=0)
    compiled.function = 0x1234  # a CUfunction handle; prepare only stores it
    values = {"src": 0x7000, "ids": 0, "rows": 300, "BLOCK": 1024}
    handle = native_launch.prepared_launch(compiled, names, values, "ids", "ids", 16)
    assert handle is not None
    missing = {k: v for k, v in values.items() if k != "rows"}
    assert native_launch.prepared_launch(compiled, names, missing, "ids", "ids", 16) is None
    # An id argument the kernel does not take: nothing to fill in per call.
    assert native_launch.prepared_launch(compiled, names, values, "nope", "ids", 16) is None
