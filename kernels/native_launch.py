"""The C launcher of the direct reads' page copies (csrc/page_copy_launch.c): built on first use with
the machine's C compiler, as Triton builds its own launchers, and cached under
``$DUET_CACHE_DIR`` (default ``~/.cache/duet``, or a per-user temp folder when home is read-only).

``module()`` returns the loaded extension, or None when it cannot be had (no compiler, no Python
headers, a failed build); callers then keep the Python launch path, which does the same work more
slowly. ``prepared_launch`` binds one compiled Triton kernel's arguments for ``queue``: it reads the
kernel's parameter list from its PTX and from Triton's signature, and refuses (None) any kernel whose
parameters it cannot account for exactly, rather than guess an ABI.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

NAME = "duet_page_copy_launch"
SOURCE = Path(__file__).parent / "csrc" / "page_copy_launch.c"
_SIZES = {"i32": 4, "u32": 4, "i64": 8, "u64": 8}  # scalar types the launcher passes
_PTX_SIZES = {"u32": 4, "s32": 4, "b32": 4, "u64": 8, "s64": 8, "b64": 8}


@functools.lru_cache(maxsize=1)
def module() -> ModuleType | None:
    """The extension, built if needed; None (logged once) when it cannot be built or loaded."""
    if os.environ.get("DUET_NATIVE_LAUNCH", "1") == "0":
        return None
    try:
        return _load(_build())
    except Exception as e:  # any failure leaves the Python path in place
        log.warning("the C page-copy launcher is not available (%s); using the Python path", e)
        return None


def _build() -> Path:
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    return build_library(SOURCE, NAME, suffix, [f"-I{include}", "-ldl"], toolchain_problem)


def build_library(
    source_path: Path,
    name: str,
    suffix: str,
    flags: list[str],
    problem: Callable[[], str | None],
) -> Path:
    """``source_path`` compiled into a shared library under the cache folder (once per source and
    Python version), its path; raises RuntimeError when ``problem()`` names what is missing or
    the compiler fails."""
    source = source_path.read_bytes()
    tag = hashlib.sha256(source + sys.version.encode()).hexdigest()[:16]
    cache = _cache_dir()
    target = cache / f"{name}-{tag}{suffix}"
    if target.exists():
        return target
    missing = problem()
    if missing is not None:
        raise RuntimeError(missing)
    cc = _compiler()
    cache.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes starting together never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        cmd = [*shlex.split(cc), "-O2", "-shared", "-fPIC", str(source_path), *flags]
        cmd += ["-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


def _cache_dir() -> Path:
    """``$DUET_CACHE_DIR``, else ~/.cache/duet, else a per-user folder under the temp dir (a
    worker whose home is read-only)."""
    if "DUET_CACHE_DIR" in os.environ:
        return Path(os.environ["DUET_CACHE_DIR"])
    home = Path.home() / ".cache" / "duet"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return _private_dir(Path(tempfile.gettempdir()) / f"duet-{os.getuid()}")


def _private_dir(path: Path) -> Path:
    """``path``, made (mode 0700) if missing; refused unless it is ours and only ours: a shared
    temp dir must not hand us someone else's library to load."""
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not path.is_dir() or path.is_symlink() or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{path} is not a private folder of this user")
    return path


def _compiler() -> str | None:
    return (
        os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc") or shutil.which("clang")
    )


def compiler_problem() -> str | None:
    """ "no C compiler" when there is none, else None."""
    return "no C compiler (set CC)" if _compiler() is None else None


def toolchain_problem() -> str | None:
    """Why this machine cannot build the extension (no C compiler, no Python headers), or None."""
    if _compiler() is None:
        return compiler_problem()
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        return f"no Python.h under {include}"
    return None


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def prepared_launch(
    compiled: Any,
    arg_names: list[str],
    values: Mapping[str, int],
    src_ids: str,
    dst_ids: str,
    blocks_per_item: int,
) -> Any | None:
    """A launch handle for ``queue``: ``compiled`` (a Triton CompiledKernel, after its first run)
    with the argument values ``values`` by name (pointers as addresses), the two id arguments
    ``src_ids`` and ``dst_ids`` filled in per call, ``blocks_per_item`` programs per page pair.
    None, logged, when the C launcher is missing or the kernel's parameters are not exactly the
    arguments Triton kept plus unused scratch pointers."""
    mod = module()
    if mod is None:
        return None
    try:
        params = _parameters(compiled, arg_names)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        log.warning("the C launcher cannot launch %s (%s); using Triton's", compiled, e)
        return None
    out, src_index, dst_index = [], -1, -1
    try:
        for name in params:
            if name is None:  # a scratch pointer Triton appends: unused by this kernel (checked)
                out.append(0)
                continue
            if name == src_ids:
                src_index = len(out)
            if name == dst_ids:
                dst_index = len(out)
            out.append(int(values[name]))  # every argument the kernel takes has a value
        md = compiled.metadata
        return mod.prepare(
            int(compiled.function),
            32 * int(md.num_warps),
            int(md.shared),
            blocks_per_item,
            tuple(out),
            src_index,
            dst_index,
        )
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        log.warning("the C launcher cannot bind %s (%r); using Triton's", compiled, e)
        return None


def _parameters(compiled: Any, arg_names: list[str]) -> list[str | None]:
    """The kernel's parameters in order: an argument's name, or None for a scratch pointer.
    Raises ValueError when the PTX and Triton's signature disagree."""
    md = compiled.metadata
    for key in ("global_scratch_size", "profile_scratch_size"):
        if int(getattr(md, key, 0) or 0):
            raise ValueError(f"the kernel needs {key}={getattr(md, key)}")
    if int(getattr(md, "num_ctas", 1)) != 1 or getattr(md, "launch_cooperative_grid", False):
        raise ValueError("the kernel needs clusters or a cooperative launch")
    if getattr(md, "launch_pdl", False):
        raise ValueError("the kernel needs programmatic dependent launch")
    signature = compiled.src.signature
    kept = [n for n in arg_names if signature[n] != "constexpr"]
    ptx = ptx_parameters(compiled.asm["ptx"], compiled.metadata.name)
    if len(ptx) < len(kept) or len(ptx) > len(kept) + 2:
        raise ValueError(f"PTX has {len(ptx)} parameters for {len(kept)} arguments")
    for name, size in zip(kept, ptx):
        kind = signature[name]
        want = 8 if kind.startswith("*") else _SIZES.get(kind)
        if want != size:
            raise ValueError(f"argument {name} ({kind}) is a {size}-byte PTX parameter")
    if any(size != 8 for size in ptx[len(kept) :]):
        raise ValueError("the extra PTX parameters are not pointers")
    return [*kept, *[None] * (len(ptx) - len(kept))]


def ptx_parameters(ptx: str, name: str) -> list[int]:
    """Byte sizes of the parameters of entry ``name`` in ``ptx``."""
    found = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    if found is None:
        raise ValueError(f"no entry {name} in the PTX")
    sizes = []
    for decl in found.group(1).split(","):
        kind = re.search(r"\.param\s+\.(\w+)", decl)
        if kind is None or kind.group(1) not in _PTX_SIZES:  # byte arrays (structs) included
            raise ValueError(f"unexpected PTX parameter {decl.strip()!r}")
        sizes.append(_PTX_SIZES[kind.group(1)])
    return sizes
