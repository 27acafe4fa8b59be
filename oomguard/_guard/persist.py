"""Remembering plans across restarts: a small JSON state file, written atomically, under a lock, and bounded.

Each entry is keyed by what the plan depends on: a fingerprint of the model (parameter names, shapes and
dtypes), the device (its name and total memory) and the batch bucket. A restart with the same state file starts
every bucket on the plan that fitted.

* **Atomic.** The file is replaced atomically (temporary file, fsync, rename), so a kill at any moment leaves
  either the old file or the new one, never a broken one.
* **Shared.** Jobs may share one file: a save reads, merges and writes under an exclusive lock, so no job drops
  another's plans. On POSIX the lock is ``flock`` on the state file itself: a killed job leaves no lock file
  behind (the kernel releases its lock), and a missing file is created by a hard link, which fails if another
  job created it first. Elsewhere a lock file (``.NAME.lock``) created exclusively is the lock, best effort.
* **Bounded.** A save keeps the :data:`PER_MODEL` most recently updated entries of each model and device, and
  :data:`TOTAL` entries overall (the least recently updated go first), so the file, and so the cost of every
  save, stays small however many models and buckets have used it.
* **Forgiving.** A missing, corrupt, deeply nested or mismatched file is ignored with one logged warning, never
  a crash, and the next save replaces it.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from oomguard._ladder.plan import Plan

__all__ = ["PER_MODEL", "TOTAL", "UNSAVED_ADVICE", "PlanStore", "model_fingerprint"]

logger = logging.getLogger("oomguard")

_FORMAT = "oomguard-plans"
_VERSION = 1
#: Entries kept per model and device (a job rarely sees more batch buckets than this).
PER_MODEL = 64
#: Entries kept in one state file.
TOTAL = 1024
_LOCK_TIMEOUT = 30.0  # seconds: longer than any save takes; past it the save fails (and is retried later)
#: What a failed save means and what to do, for the warning (or the event) that reports it.
UNSAVED_ADVICE = (
    "training goes on with the plans kept in memory, and the save is retried on the next plan change; "
    "check that the folder exists and is writable and that the disk has room"
)

_Scalar = (str, int, float, bool, type(None))


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's parameter names, shapes and dtypes (not their values)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:16]


class PlanStore:
    """Plans per batch bucket for one model on one device, kept in ``path``.

    Entries of other models or devices in the same file are preserved (within the bounds, see the module).
    """

    def __init__(self, path: str | Path, fingerprint: str, device: str, writable: bool = True) -> None:
        self.path = Path(path)
        self.prefix = f"{fingerprint}|{device}|"
        self.writable = writable  # under distributed training only rank 0 writes

    def load(self) -> dict[int, Plan]:
        """The saved plans for this model and device, by bucket; empty (with one warning) if there are none."""
        entries = self._read(warn=True)
        if entries is None:
            return {}
        plans: dict[int, Plan] = {}
        broken: list[str] = []
        for key, entry in entries.items():
            if not key.startswith(self.prefix):
                continue
            try:
                plans[int(key[len(self.prefix) :])] = Plan.from_dict(_plan_of(entry))
            except (KeyError, TypeError, ValueError) as error:
                broken.append(f"{key!r} ({error})")
        if broken:  # one warning for the whole file, whatever is wrong in it
            logger.warning(
                "oomguard: ignoring %d unreadable saved plan(s) in %s: %s; %s",
                len(broken),
                self.path,
                "; ".join(broken),
                "the others are used" if plans else "starting from the default plan",
            )
        elif not plans:
            logger.warning(
                "oomguard: %s holds no plan for this model and device (saved for another model, device or "
                "memory size?); starting from the default plan",
                self.path,
            )
        return plans

    def save(self, plans: dict[int, Plan]) -> None:
        """Write ``plans`` (all buckets of this model and device), keeping other entries, atomically.

        Raises ``OSError`` when the file cannot be written (the caller warns and retries later).
        """
        if not self.writable:
            return
        while True:
            with _locked(self.path) as locked:
                entries = (self._read(warn=False) or {}) if locked else {}
                text = self._document(entries, plans)
                if locked:
                    _atomic_write(self.path, text)
                elif not _create(self.path, text):
                    continue  # another job created the file meanwhile: merge with it, under its lock
            break
        _remove_orphans(self.path)

    def _document(self, entries: dict[str, Any], plans: dict[int, Plan]) -> str:
        """The file's new text: ``entries`` read from it, with this model's plans replaced, within the bounds."""
        now = datetime.now().astimezone().isoformat(timespec="milliseconds")
        ours: dict[str, Any] = {}
        for bucket, plan in plans.items():
            key, data = f"{self.prefix}{bucket}", plan.to_dict()
            previous = entries.get(key)
            unchanged = isinstance(previous, dict) and previous.get("plan") == data
            updated = previous.get("updated") if unchanged and isinstance(previous, dict) else None
            ours[key] = {"plan": data, "updated": updated if isinstance(updated, str) else now}
        ours = _newest(ours, PER_MODEL, TOTAL)
        others = {key: entry for key, entry in entries.items() if not key.startswith(self.prefix)}
        kept = _newest(others, PER_MODEL, TOTAL - len(ours))  # this job's plans always stay: they were just saved
        document = {"format": _FORMAT, "version": _VERSION, "plans": {**kept, **ours}}
        return json.dumps(document, indent=1, sort_keys=True) + "\n"

    def _read(self, warn: bool) -> dict[str, Any] | None:
        try:
            text = self.path.read_bytes().decode("utf-8")
        except FileNotFoundError:
            if warn:
                logger.warning("oomguard: no state file at %s yet; starting from the default plan", self.path)
            return None
        except (OSError, UnicodeDecodeError) as error:
            if warn:
                logger.warning("oomguard: cannot read the state file %s (%s); ignoring it", self.path, error)
            return None
        try:
            document = json.loads(text)
            if not isinstance(document, dict):
                raise ValueError(f"a JSON {type(document).__name__}, not an object")
            if document.get("format") != _FORMAT or not isinstance(document.get("plans"), dict):
                raise ValueError("not an oomguard state file")
            if document.get("version") != _VERSION:
                raise ValueError(f"version {document.get('version')!r}, expected {_VERSION}")
        except (ValueError, RecursionError) as error:  # RecursionError: nesting deeper than the parser goes
            if warn:
                logger.warning(
                    "oomguard: the state file %s is unreadable (%s); ignoring it and starting from the default "
                    "plan (it will be rewritten)",
                    self.path,
                    str(error)[:200],
                )
            return None
        plans: dict[str, Any] = document["plans"]
        return plans


def _plan_of(entry: Any) -> Mapping[str, Any]:
    """The ``plan`` of a state-file entry, if it is a flat mapping (what :meth:`Plan.to_dict` writes)."""
    if not isinstance(entry, dict):
        raise TypeError(f"the entry is a JSON {type(entry).__name__}, not an object with a 'plan'")
    plan = entry["plan"]
    if not isinstance(plan, dict):
        raise TypeError(f"its 'plan' is a JSON {type(plan).__name__}, not an object")
    for name, value in plan.items():
        flat = value.values() if name == "extras" and isinstance(value, dict) else (value,)
        if not all(isinstance(item, _Scalar) for item in flat):
            raise TypeError(f"its plan field {name!r} holds {type(value).__name__}, not a plain value")
    return plan


def _is_entry(entry: Any) -> bool:
    """Whether ``entry`` is worth keeping in the file: a flat plan, and plain values beside it."""
    try:
        _plan_of(entry)
    except (KeyError, TypeError):
        return False
    return all(isinstance(value, _Scalar) for key, value in entry.items() if key != "plan")


def _newest(entries: dict[str, Any], per_model: int, limit: int) -> dict[str, Any]:
    """The most recently updated of ``entries``: at most ``per_model`` of each model and device (the key's part
    before the bucket), ``limit`` in all; ties by key, so every writer keeps the same.

    Entries no reader could use (a plan that is not a flat mapping) are dropped, not copied on. Only the entries
    walked are checked, newest first, so a save over a huge file costs one sort of its keys.
    """
    order = sorted(((_moment(entry), key) for key, entry in entries.items()), reverse=True)
    kept: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for _, key in order:
        if len(kept) >= limit:
            break
        model = key.rpartition("|")[0]
        if counts.get(model, 0) < per_model and _is_entry(entries[key]):
            counts[model] = counts.get(model, 0) + 1
            kept[key] = entries[key]
    return kept


def _moment(entry: Any) -> float:
    """An entry's ``updated`` time as seconds since the epoch; 0 (the oldest) when there is none to read."""
    stamp = entry.get("updated") if isinstance(entry, dict) else None
    return _parse_moment(stamp) if isinstance(stamp, str) else 0.0


@functools.lru_cache(maxsize=4096)  # stamps repeat: one save writes one stamp on every entry it changes
def _parse_moment(stamp: str) -> float:
    if stamp.endswith("Z"):
        stamp = stamp[:-1] + "+00:00"
    elif len(stamp) > 5 and stamp[-5] in "+-" and stamp[-4:].isdigit():  # +0200 (older files): Python 3.10 wants +02:00
        stamp = f"{stamp[:-2]}:{stamp[-2:]}"
    try:
        return datetime.fromisoformat(stamp).timestamp()
    except (ValueError, OverflowError, OSError):
        return 0.0


_ORPHAN_AGE = 60.0  # seconds: a temporary file this old was left by a writer that was killed


def _remove_orphans(path: Path) -> None:
    """Delete temporary files that killed writers left beside ``path`` (never a fresh one: it may be in use)."""
    now = time.time()
    for orphan in path.parent.glob(f".{path.name}.*.tmp"):
        with suppress(OSError):
            if now - orphan.stat().st_mtime > _ORPHAN_AGE:
                orphan.unlink()


def _atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers (and a kill at any moment) see the old or the new file."""
    temporary = _write_temporary(path, text)
    try:
        os.replace(temporary, path)
    except BaseException:
        _unlink(temporary)
        raise
    _sync_directory(path.parent)


def _create(path: Path, text: str) -> bool:
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
    def _locked(path: Path) -> Iterator[bool]:
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
    def _locked(path: Path) -> Iterator[bool]:
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
