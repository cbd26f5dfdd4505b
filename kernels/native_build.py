"""Builds, caches and loads this project's small C extensions (the direct reads' launcher,
kernels/csrc/page_copy_launch.c; the one-sided UCX writes, transfer/csrc/ucp_rma.c) with the
machine's C compiler, as Triton builds its own launchers.

Each build is cached under ``$DUET_CACHE_DIR`` (default ``~/.cache/duet``, or a per-user temp folder
when home is read-only), keyed by the source, the Python version and the build flags, so a changed
source or a different UCX rebuilds instead of loading a stale library.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def build_and_load(
    name: str, source: Path, cflags: Sequence[str] = (), ldflags: Sequence[str] = ()
) -> ModuleType:
    """The extension ``name`` (its ``PyInit_<name>``) built from ``source``; raises when it cannot
    be built or loaded."""
    return _load(name, _build(name, source, list(cflags), list(ldflags)))


def _build(name: str, source: Path, cflags: list[str], ldflags: list[str]) -> Path:
    text = source.read_bytes()
    key = text + sys.version.encode() + "\0".join(cflags + ldflags).encode()
    tag = hashlib.sha256(key).hexdigest()[:16]
    cache = _cache_dir()
    target = cache / f"{name}-{tag}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if target.exists():
        return target
    missing = toolchain_problem()
    if missing is not None:
        raise RuntimeError(missing)
    cc = _compiler()
    assert cc is not None
    include = sysconfig.get_paths()["include"]
    cache.mkdir(parents=True, exist_ok=True)
    # Built beside the target and renamed into place: processes starting together never load a
    # half-written file.
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        out = Path(tmp) / target.name
        cmd = [*shlex.split(cc), "-O2", "-shared", "-fPIC", f"-I{include}", *cflags, str(source)]
        cmd += ["-o", str(out), *ldflags]
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


def toolchain_problem() -> str | None:
    """Why this machine cannot build the extensions (no C compiler, no Python headers), or None."""
    if _compiler() is None:
        return "no C compiler (set CC)"
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        return f"no Python.h under {include}"
    return None


def _load(name: str, path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    assert spec is not None
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod
