"""What a failed attempt added to a trainer's own records, taken back before the batch is tried again.

A trainer's ``compute_loss`` often counts as it goes: TRL's SFTTrainer appends entropy and token accuracy to
``self._metrics`` and adds to ``self._total_train_tokens``; a user's subclass may keep a list of losses. Run again
after an out-of-memory error, it would count the failed attempt too. :class:`PlainState` keeps a copy of every
attribute of the trainer that holds plain data (numbers, strings, and lists, tuples, dicts, deques and sets of
them), and puts those values back, in place, so that whatever holds a reference to a dict or list sees it too.
"""

from __future__ import annotations

import collections
import copy
from typing import Any

__all__ = ["PlainState"]

_SCALARS = (int, float, complex, str, bytes, type(None))  # (bool is an int)
_DEPTH = 4  # deeper than any metrics record; anything deeper is left alone


def is_plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data: cheap and safe to copy, and nothing a tensor or a model hides in."""
    if isinstance(value, _SCALARS):
        return True
    if depth >= _DEPTH:
        return False
    if isinstance(value, dict):
        return all(is_plain(k, depth + 1) and is_plain(v, depth + 1) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset, collections.deque)):
        return all(is_plain(v, depth + 1) for v in value)
    return False


class PlainState:
    """The plain-data attributes of ``owner`` as they are now, to be put back by :meth:`restore`.

    >>> class Counter: pass
    >>> c = Counter(); c.seen = [1]; c.tokens = 10
    >>> state = PlainState(c)
    >>> c.seen.append(2); c.tokens += 5
    >>> state.restore(); (c.seen, c.tokens)
    ([1], 10)
    """

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.saved = {name: copy.deepcopy(value) for name, value in vars(owner).items() if is_plain(value)}

    def restore(self) -> None:
        """Every saved attribute back to its saved value (containers in place). Attributes added since are kept:
        they are the trainer's lazily made state, not counts of an attempt."""
        attributes = vars(self.owner)
        for name, saved in self.saved.items():
            value = copy.deepcopy(saved)  # (a restore may happen again, after the next failed attempt)
            current = attributes.get(name)
            if type(current) is not type(value) or not isinstance(current, (dict, list, set, collections.deque)):
                attributes[name] = value
            elif isinstance(current, list):
                current[:] = value
            else:
                current.clear()
                current.update(value) if isinstance(current, (dict, set)) else current.extend(value)
