"""Writing a file that several jobs share, safely: atomically replaced, under an exclusive lock.

* **Atomic.** The file is replaced atomically (temporary file, fsync, rename), so a kill at any moment leaves
  either the old file or the new one, never a broken one.
* **Shared.** A reader-merger-writer holds an exclusive lock, so no job drops another's writes. On POSIX the lock
  is ``flock`` on the file itself: a killed job leaves no lock file behind (the kernel releases its lock), and a
  missing file is created by a hard link, which fails if another job created it first. Elsewhere a lock file
  (``.NAME.lock``) created exclusively is the lock, best effort.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

__all__ = ["atomic_write", "create", "locked", "remove_orphans"]

_LOCK_TIMEOUT = 5.0  # seconds: far longer than a save takes; past it the save fails (and is retried later)

_ORPHAN_AGE = 60.0  # seconds: a temporary file this old was left by a writer that was killed


def remove_orphans(path: Path) -> None:
    """Delete temporary files that killed writers left beside ``path`` (never a fresh one: it may be in use)."""
    now = time.time()
    for orphan in path.parent.glob(f".{path.name}.*.tmp"):
        with suppress(OSError):
            if now - orphan.stat().st_mtime > _ORPHAN_AGE:
                orphan.unlink()


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers (and a kill at any moment) see the old or the new file."""
    temporary = _write_temporary(path, text)
    try:
        os.replace(temporary, path)
    except BaseException:
        _unlink(temporary)
        raise
    _sync_directory(path.parent)


def create(path: Path, text: str) -> bool:
    """Create ``path`` holding ``text``, whole at once; False (nothing written) if it exists by now.

    A hard link to a complete temporary file fails if another job created the file first, where a rename would
    silently replace that job's plans.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _write_temporary(path, text)
    try:
        try:
            os.link(temporary, path)
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno not in _NO_LINKS:  # a full disk, say: that is the save's failure
                raise
            os.replace(temporary, path)  # a file system without hard links: the first save only is unguarded
    finally:
        _unlink(temporary)
    _sync_directory(path.parent)
    return True


_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK)  # what link() says where links are not


def _write_temporary(path: Path, text: str) -> str:
    """A complete, synced temporary file beside ``path`` holding ``text`` (removed again if that fails)."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        _unlink(temporary)
        raise
    return temporary


def _unlink(path: str | Path) -> None:
    with suppress(OSError):
        os.unlink(path)


def _sync_directory(directory: Path) -> None:
    """Make a rename (or link) in ``directory`` durable; best effort (not every system can open a folder)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    with suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def _wait(deadline: float, delay: float, path: Path) -> float:
    """Sleep before the next try at the lock; the next delay. Past ``deadline``, give up with a TimeoutError."""
    if time.monotonic() > deadline:
        raise TimeoutError(
            f"another process has held the lock on the state file {path} for over {_LOCK_TIMEOUT:.0f} s "
            f"(a job stopped in the middle of a save?)"
        )
    time.sleep(delay)
    return min(2 * delay, 0.05)


if sys.platform == "win32":

    @contextmanager
    def locked(path: Path) -> Iterator[bool]:
        """Hold the lock file ``.NAME.lock`` beside ``path`` (created exclusively) while saving; yields True.

        Best effort: a lock file older than a save could ever take is one a killed job left, and is taken over.
        """
        lock = path.with_name(f".{path.name}.lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline, delay = time.monotonic() + _LOCK_TIMEOUT, 0.001
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                break
            except FileExistsError:
                try:
                    if time.time() - lock.stat().st_mtime > _ORPHAN_AGE:
                        _unlink(lock)
                        continue
                except OSError:
                    continue  # released in the meantime
                delay = _wait(deadline, delay, path)
        try:
            yield True
        finally:
            os.close(fd)
            _unlink(lock)

else:
    import fcntl

    @contextmanager
    def locked(path: Path) -> Iterator[bool]:
        """Hold ``flock`` on the state file ``path`` itself while saving; yields True, or False if there is no
        file to lock yet (the caller then creates it exclusively).

        The file is replaced on every save, so a lock taken on a file that was replaced while we waited locks
        nothing: check that the locked file is still the one at ``path``, and start again if not.
        """
        deadline, delay = time.monotonic() + _LOCK_TIMEOUT, 0.001
        while True:
            try:
                fd = _open_to_lock(path)
            except FileNotFoundError:
                yield False
                return
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        delay = _wait(deadline, delay, path)
                    except OSError:  # no locks on this file system (some network mounts): save unlocked
                        break
                if _same_file(fd, path):
                    yield True
                    return
            finally:
                os.close(fd)  # releases the lock

    def _open_to_lock(path: Path) -> int:
        try:
            return os.open(path, os.O_RDWR)  # writable: network file systems only lock files open for writing
        except PermissionError:
            return os.open(path, os.O_RDONLY)  # a read-only file in a writable folder can still be replaced

    def _same_file(fd: int, path: Path) -> bool:
        with suppress(FileNotFoundError):
            current, locked = os.stat(path), os.fstat(fd)
            return (locked.st_dev, locked.st_ino) == (current.st_dev, current.st_ino)
        return False
