"""The log file: events as JSON lines, strict JSON (what ``jq`` and log shippers accept).

A NaN or infinite number (a diverged loss, a predicted time past the float range) is written as ``null`` and named, by
its dotted path, in the object's ``"non_finite"`` entry. The CLI's ``--json`` answers go through the same rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

__all__ = ["JsonlSink", "strict_json"]


class _Event(Protocol):
    def to_dict(self) -> dict[str, Any]: ...


class JsonlSink:
    """Appends each event to ``path`` as one JSON object per line (opened per event: events are rare)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if self.path.parent and not self.path.parent.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def __call__(self, event: _Event) -> None:
        line = json.dumps(strict_json(event.to_dict()), default=str, sort_keys=False, allow_nan=False)
        with self.path.open("a", encoding="utf-8") as log:
            log.write(line + "\n")


def strict_json(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as strict JSON can hold it (no NaN or Infinity): each non-finite number ``null``, and a
    ``"non_finite"`` entry naming each by its dotted path (``"candidates.0.predicted_seconds": "inf"``)."""
    replaced: dict[str, str] = {}
    ready: dict[str, Any] = _finite(data, "", replaced)
    if replaced:  # null, and a note of what each stood for
        ready["non_finite"] = replaced
    return ready


def _finite(value: Any, path: str, replaced: dict[str, str]) -> Any:
    """``value`` with every NaN or infinite float replaced by None, each recorded in ``replaced`` by its dotted
    path (list items by their index)."""
    if isinstance(value, float) and not math.isfinite(value):
        replaced[path] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
        return None
    if isinstance(value, dict):
        return {_key(k): _finite(item, _dotted(path, k), replaced) for k, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item, _dotted(path, i), replaced) for i, item in enumerate(value)]
    return value


def _dotted(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _key(key: Any) -> Any:
    """A dict key strict JSON can hold (a non-finite float key becomes its text)."""
    return str(key) if isinstance(key, float) and not math.isfinite(key) else key
