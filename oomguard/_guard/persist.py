"""Remembering plans across restarts: a small JSON state file, written atomically, under a lock, and bounded.

Each entry is keyed by what the plan depends on: a fingerprint of the model (parameter names, shapes and
dtypes), the device (its name and total memory) and the batch bucket. A restart with the same state file starts
every bucket on the plan that fitted.

* **Atomic** and **shared**: a save reads, merges and writes under an exclusive lock, and replaces the file
  atomically (:mod:`oomguard._guard.files`). The merge is per entry: a save writes the plans (and answers) this
  job changed since it last read or wrote them, and keeps every other entry as the file has it, those other jobs
  of the same model and device saved included; an entry of this job's that the file lost is put back.
* **Bounded.** A save keeps the :data:`PER_MODEL` most recently updated entries of each model and device, and
  :data:`TOTAL` entries overall (the least recently updated go first), so the file, and so the cost of every
  save, stays small however many models and buckets have used it.
* **Forgiving.** A missing, corrupt, deeply nested or mismatched file is ignored with one logged warning, never
  a crash, and the next save replaces it.
* **Answers.** Beside the plans, the file keeps the dry-run planner's recorded answers for this model and device
  (``"answers"``, bounded the same way: :mod:`oomguard._guard.answers`), so a restarted job plans nothing it
  planned before. A file without them (an older one) loads as before; its next save adds them.
* **Filtered.** A plan another job saved under the same key (the same model and device), or an answer it
  recorded, is taken only if this job's ladder could have come to it here: the loader passes the ladder's reasons
  to refuse it, and refused plans and answers are named in the same one warning (a batch whose answer is refused
  is planned again). They stay in the file for the jobs that can use them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import torch

from oomguard._guard.files import atomic_write, create, locked, remove_orphans
from oomguard._ladder.plan import Plan

__all__ = ["PER_MODEL", "TOTAL", "UNSAVED_ADVICE", "PlanStore", "model_fingerprint"]

logger = logging.getLogger("oomguard")

_FORMAT = "oomguard-plans"
_VERSION = 1
#: Entries kept per model and device (a job rarely sees more batch buckets than this).
PER_MODEL = 64
#: Entries kept in one state file.
TOTAL = 1024
_RACES = 8  # times a save may find the file created (or gone) under it before it gives up
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
        #: This model and device's recorded answers (:mod:`oomguard._guard.answers`): those :meth:`load` read and
        #: this job could have come to, and those added since; a :meth:`save` writes those that changed.
        self.answers: dict[str, dict[str, Any]] = {}
        #: What this store last read from the file or wrote to it, per key, with the entry's stamp: a save writes
        #: only the entries that differ from it (this job's changes), and keeps the file's for the others.
        self._seen: dict[str, _Seen] = {}
        self._seen_answers: dict[str, _Seen] = {}

    def load(self, refuse: Callable[[Plan], Sequence[str]] | None = None) -> dict[int, Plan]:
        """The saved plans for this model and device, by bucket; empty (with one warning) if there are none. Its
        recorded answers go to :attr:`answers`.

        ``refuse`` says why this job cannot take a plan (:meth:`~oomguard._ladder.ladder.Ladder.beyond`: a rung
        not on its ladder, a level it cannot reach); such plans, and answers that recommend one, are ignored,
        named with their reasons in the same one warning as unreadable entries.
        """
        document = self._read(warn=True)
        if document is None:
            return {}
        plans: dict[int, Plan] = {}
        ignored: list[str] = []
        for key, entry in document["plans"].items():
            if not key.startswith(self.prefix):
                continue
            bucket = key[len(self.prefix) :]
            try:
                plan = Plan.from_dict(_plan_of(entry))
                number = int(bucket)
            except (KeyError, TypeError, ValueError) as error:
                ignored.append(f"bucket {bucket!r} (unreadable: {error})")
                continue
            reasons = _refusals(refuse, plan)
            if reasons:
                ignored.append(f"bucket {bucket!r} ({plan.describe()}: {'; '.join(reasons)})")
            else:
                plans[number] = plan
                self._seen[key] = _Seen({"plan": plan.to_dict()}, entry.get("updated"))
        refused = self._load_answers(document.get("answers"), refuse)
        if ignored or refused:  # one warning for the whole file, whatever is wrong in it
            counts = [f"{len(ignored)} saved plan(s)"] if ignored else []
            counts += [f"{len(refused)} recorded answer(s)"] if refused else []
            logger.warning(
                "oomguard: ignoring %s in %s that this job cannot use: %s; %s%s",
                " and ".join(counts),
                self.path,
                "; ".join(ignored + refused),
                "the others are used" if plans else "starting from the default plan",
                "; the batches of the answers ignored are planned again" if refused else "",
            )
        elif not plans:
            logger.warning(
                "oomguard: %s holds no plan for this model and device (saved for another model, device or "
                "memory size?); starting from the default plan",
                self.path,
            )
        return plans

    def _load_answers(self, answers: Any, refuse: Callable[[Plan], Sequence[str]] | None) -> list[str]:
        """Take this model and device's recorded answers in ``answers`` (the file's; an older file has none) into
        :attr:`answers`, but those whose plan ``refuse`` refuses: what the warning says of each of these."""
        refused: list[str] = []
        for key, entry in (answers if isinstance(answers, dict) else {}).items():
            if not key.startswith(self.prefix) or not _is_answer(entry):
                continue
            data = {k: v for k, v in entry.items() if k != "updated"}
            try:
                plan = None if data["plan"] is None else Plan.from_dict(data["plan"])
            except (KeyError, TypeError, ValueError):
                plan = None  # (unreadable: the guard's Answers leave it out, and plan that batch again)
            reasons = () if plan is None else _refusals(refuse, plan)
            if plan is not None and reasons:
                refused.append(f"answer {key[len(self.prefix) :]!r} ({plan.describe()}: {'; '.join(reasons)})")
            else:
                self.answers[key] = data
                self._seen_answers[key] = _Seen(data, entry.get("updated"))
        return refused

    def save(self, plans: dict[int, Plan]) -> None:
        """Write ``plans`` (all buckets of this model and device) and :attr:`answers`, those that changed since
        this store last read or wrote them, keeping other entries, atomically.

        Raises ``OSError`` when the file cannot be written (the caller warns and retries later).
        """
        if not self.writable:
            return
        for _ in range(_RACES):
            with locked(self.path) as holding:  # False: there is no file to lock yet
                document = (self._read(warn=False) or {}) if holding else {}
                text, written, answered = self._document(document, plans)
                if holding:
                    atomic_write(self.path, text)
                elif not create(self.path, text):
                    continue  # another job created the file meanwhile: merge with it, under its lock
            self._seen.update(written)  # (only now: a save that failed wrote nothing)
            self._seen_answers.update(answered)
            remove_orphans(self.path)
            return
        raise OSError(f"{self.path} could neither be opened nor created (a dangling symbolic link?)")

    def _document(
        self, document: dict[str, Any], plans: dict[int, Plan]
    ) -> tuple[str, dict[str, _Seen], dict[str, _Seen]]:
        """The file's new text: the ``document`` read from it, merged with this model's ``plans`` and answers
        (:func:`_merged`); and the plans and answers it writes, for :attr:`_seen` once it is written."""
        now = datetime.now().astimezone().isoformat(timespec="milliseconds")
        entries: dict[str, Any] = document.get("plans") or {}
        answers = document.get("answers")
        ours = {f"{self.prefix}{bucket}": {"plan": plan.to_dict()} for bucket, plan in plans.items()}
        merged, written = _merged(entries, ours, self._seen, now, _is_entry)
        answers = answers if isinstance(answers, dict) else {}  # (an older file has none)
        recorded, answered = _merged(answers, self.answers, self._seen_answers, now, _is_answer)
        text = {"format": _FORMAT, "version": _VERSION, "plans": merged, "answers": recorded}
        return json.dumps(text, indent=1, sort_keys=True) + "\n", written, answered

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
        return document


class _Seen(NamedTuple):
    """An entry as this store last read or wrote it: its data (no stamp), and its ``updated`` stamp."""

    data: dict[str, Any]
    updated: Any


def _merged(
    entries: dict[str, Any],
    ours: dict[str, dict[str, Any]],
    seen: dict[str, _Seen],
    now: str,
    valid: Callable[[Any], bool],
) -> tuple[dict[str, Any], dict[str, _Seen]]:
    """``entries`` (the file's, every job's) merged with this store's ``ours``, within the bounds; and the entries
    of ours it writes.

    An entry of ours that differs from what this store last read or wrote (``seen``: this job changed it, or
    never saved it) is written, stamped ``now`` (or kept as it is where the file already has it so), and kept
    whatever the bounds (just saved). One that does not is left as the file has it: the file holds what this
    store wrote, or what another job of the same model saved since, which is newer; where the file lost it, it is
    put back with its stamp. Every other entry is kept, the most recent first (``valid`` says which are worth it).
    """
    written: dict[str, Any] = {}
    restored: dict[str, Any] = {}
    for key, data in ours.items():
        previous, before = entries.get(key), seen.get(key)
        if before is not None and before.data == data:  # not changed here since it was read or written
            if not valid(previous):  # (the file lost it: a corrupt file rewritten, another job's bounds)
                restored[key] = {**data, "updated": before.updated if isinstance(before.updated, str) else now}
            continue
        same = isinstance(previous, dict) and {k: v for k, v in previous.items() if k != "updated"} == data
        updated = previous.get("updated") if same and isinstance(previous, dict) else None
        written[key] = {**data, "updated": updated if isinstance(updated, str) else now}
    counts: dict[str, int] = {}  # (ours count towards their model's bound before the others)
    written = _newest(written, PER_MODEL, TOTAL, valid, counts)
    others = {**{key: entry for key, entry in entries.items() if key not in written}, **restored}
    kept = _newest(others, PER_MODEL, TOTAL - len(written), valid, counts)
    merged = {**kept, **written}
    stamps = {key: _Seen(ours[key], entry["updated"]) for key, entry in written.items()}
    return merged, stamps


def _refusals(refuse: Callable[[Plan], Sequence[str]] | None, plan: Plan) -> Sequence[str]:
    """Why this job cannot take ``plan``; a check that fails (a custom rung's ``escalate`` raising) refuses it."""
    if refuse is None:
        return ()
    try:
        return refuse(plan)
    except Exception as error:  # loading a state file never crashes a job: the plan is only not taken
        return [f"checking it failed ({type(error).__name__}: {error})"]


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


def _is_answer(entry: Any) -> bool:
    """Whether ``entry`` is worth keeping among the answers: plain values, and a flat plan or none."""
    if not isinstance(entry, dict) or "plan" not in entry:
        return False
    try:
        if entry["plan"] is not None:
            _plan_of(entry)
    except (KeyError, TypeError):
        return False
    return all(isinstance(value, _Scalar) for key, value in entry.items() if key != "plan")


def _newest(
    entries: dict[str, Any],
    per_model: int,
    limit: int,
    valid: Callable[[Any], bool] = _is_entry,
    counts: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The most recently updated of ``entries``: at most ``per_model`` of each model and device (the key's part
    before the bucket; ``counts``: those already kept, by model, updated here), ``limit`` in all; ties by key, so
    every writer keeps the same.

    Entries no reader could use (a plan that is not a flat mapping) are dropped, not copied on. Only the entries
    walked are checked, newest first, so a save over a huge file costs one sort of its keys.
    """
    order = sorted(((_moment(entry), key) for key, entry in entries.items()), reverse=True)
    kept: dict[str, Any] = {}
    counts = {} if counts is None else counts
    for _, key in order:
        if len(kept) >= limit:
            break
        model = key.rpartition("|")[0]
        if counts.get(model, 0) < per_model and valid(entries[key]):
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
