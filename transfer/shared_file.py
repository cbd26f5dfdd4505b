"""Small shared-memory files between the two workers of one host: P's lease board (lease_board.py)
and D's done board (done_board.py). One process makes and writes a file; its peer maps it
read-only by path.

The maker keeps an exclusive flock on its file while it lives, and making a file removes the files
of the same kind that nobody holds (a killed worker cannot remove its own); that works across PID
namespaces, unlike a pid check.
"""

from __future__ import annotations

import fcntl
import glob
import mmap
import os
import stat
import tempfile
import uuid


class SharedFileUnavailable(Exception):
    """The file cannot be made or opened here (no shared memory, another host's path)."""


def shared_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _remove_dead(directory: str, prefix: str) -> None:
    for path in glob.glob(os.path.join(directory, prefix + "*")):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its owner lives
            continue
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
        finally:
            os.close(fd)


class SharedFile:
    """A new file of ``size`` bytes named ``<prefix><pid>-<random>``, mapped read-write."""

    def __init__(self, prefix: str, size: int) -> None:
        directory = shared_dir()
        _remove_dead(directory, prefix)
        name = f"{prefix}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self.path = os.path.join(directory, name)
        # Made under a name the clean-up does not match, and locked, before it takes its own: a
        # clean-up running meanwhile cannot take it for a dead worker's.
        scratch = os.path.join(directory, "." + name)
        try:
            fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SharedFileUnavailable(f"cannot create {scratch}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we live: see above
            os.ftruncate(fd, size)
            # Every page taken now: tmpfs hands pages out on first write, and a write the full
            # mount cannot serve is a SIGBUS that kills the worker, not an error. Here it is
            # ENOSPC, and the link falls back to UCX or ReadDone.
            os.posix_fallocate(fd, 0, size)
            self.map = mmap.mmap(fd, size)
            os.rename(scratch, self.path)
        except OSError as e:
            os.close(fd)
            for path in (scratch, self.path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            raise SharedFileUnavailable(f"cannot make {self.path}: {e}") from None
        self._fd = fd

    def close(self) -> None:
        """Unmap (unless a view of the map is still alive: the unlink still frees it), remove the
        file and drop the flock."""
        try:
            self.map.close()
        except BufferError:
            pass
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)


def map_readonly(path: str, prefix: str, what: str) -> mmap.mmap:
    """The peer's file at ``path``, mapped read-only; its name must start with ``prefix``."""
    if not os.path.basename(path).startswith(prefix):
        raise SharedFileUnavailable(f"{path!r} is not a {what}")
    try:  # (non-blocking: a FIFO by that name must not hang the loop thread)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise SharedFileUnavailable(f"cannot open the peer's {what}: {e}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            raise SharedFileUnavailable(f"{path!r} is not a {what} of this user")
        return mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
    except (OSError, ValueError) as e:  # ValueError: an empty file
        raise SharedFileUnavailable(f"cannot map the peer's {what}: {e}") from None
    finally:
        os.close(fd)
