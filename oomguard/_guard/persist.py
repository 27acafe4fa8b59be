"""Remembering plans across restarts: a small JSON state file, written atomically.

Each entry is keyed by what the plan depends on: a fingerprint of the model (parameter names, shapes and
dtypes), the device (its name and total memory) and the batch bucket. A restart with the same state file starts
every bucket on the plan that fitted. The file is replaced atomically (temporary file, fsync, rename), so a
kill at any moment leaves either the old file or the new one, never a broken one. A missing, corrupt or
mismatched file is ignored with one logged warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from oomguard._ladder.plan import Plan

__all__ = ["PlanStore", "model_fingerprint"]

logger = logging.getLogger("oomguard")

_FORMAT = "oomguard-plans"
_VERSION = 1


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short hash of the model's parameter names, shapes and dtypes (not their values)."""
    digest = hashlib.sha256()
    for name, param in model.named_parameters():
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
    return digest.hexdigest()[:16]


class PlanStore:
    """Plans per batch bucket for one model on one device, kept in ``path``.

    Entries of other models or devices in the same file are preserved.
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
                plans[int(key[len(self.prefix) :])] = Plan.from_dict(entry["plan"])
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
        """Write ``plans`` (all buckets of this model and device), keeping other entries, atomically."""
        if not self.writable:
            return
        entries = {k: v for k, v in (self._read(warn=False) or {}).items() if not k.startswith(self.prefix)}
        now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for bucket, plan in sorted(plans.items()):
            entries[f"{self.prefix}{bucket}"] = {"plan": plan.to_dict(), "updated": now}
        document = {"format": _FORMAT, "version": _VERSION, "plans": entries}
        _atomic_write(self.path, json.dumps(document, indent=1, sort_keys=True) + "\n")
        _remove_orphans(self.path)

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
            if document.get("format") != _FORMAT or not isinstance(document.get("plans"), dict):
                raise ValueError("not an oomguard state file")
            if document.get("version") != _VERSION:
                raise ValueError(f"version {document.get('version')!r}, expected {_VERSION}")
        except (ValueError, AttributeError) as error:
            if warn:
                logger.warning(
                    "oomguard: the state file %s is unreadable (%s); ignoring it and starting from the default "
                    "plan (it will be rewritten)",
                    self.path,
                    error,
                )
            return None
        plans: dict[str, Any] = document["plans"]
        return plans


_ORPHAN_AGE = 60.0  # seconds: a temporary file this old was left by a writer that was killed


def _remove_orphans(path: Path) -> None:
    """Delete temporary files that killed writers left beside ``path`` (never a fresh one: it may be in use)."""
    now = time.time()
    for orphan in path.parent.glob(f".{path.name}.*.tmp"):
        try:
            if now - orphan.stat().st_mtime > _ORPHAN_AGE:
                orphan.unlink()
        except OSError:
            pass


def _atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so that readers (and a kill at any moment) see the old or the new file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable
        directory = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(directory)
    except OSError:
        pass
    finally:
        os.close(directory)
