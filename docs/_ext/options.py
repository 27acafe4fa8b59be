"""The guard's options in the API page, with their types and defaults.

``oom_guard`` and ``OOMGuard`` take their options as ``**options`` and get a signature of keywords at run time, from
the fields of ``GuardOptions`` (``oomguard/_options.py``), which static analysis does not see: mkdocstrings showed
all of them as "required" and without a type. This extension gives the two signatures those fields as keyword-only
parameters, each with its annotation and default, as ``inspect.signature`` reports them at run time.
"""

from __future__ import annotations

from typing import Any

import griffe

KEYWORD_ONLY = griffe.ParameterKind("keyword-only")  # (its attribute is typed as a str by griffe's stubs)
#: Where the options are declared, and the callables that take them as ``**options``.
OPTIONS = "_options.GuardOptions"
TAKERS = ("_decorator.oom_guard", "_guard.guard.OOMGuard.__init__")


def _field(member: griffe.Object | griffe.Alias) -> griffe.Parameter | None:
    """An option as a keyword-only parameter; None for a field the constructor does not take (``init=False``)."""
    if not isinstance(member, griffe.Attribute) or member.annotation is None:
        return None
    default = None if member.value is None else str(member.value)
    if default is not None and default.startswith("field(") and "init=False" in default:
        return None
    return griffe.Parameter(member.name, annotation=member.annotation, kind=KEYWORD_ONLY, default=default)


class GuardOptionsSignature(griffe.Extension):
    """Puts the fields of ``GuardOptions`` for ``**options`` in ``oom_guard``'s and ``OOMGuard``'s signatures."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "oomguard":
            return
        declared = pkg.get_member(OPTIONS)
        fields = [p for p in map(_field, declared.members.values()) if p is not None]
        if len(fields) < 20:  # (a renamed or moved GuardOptions must fail the build, not render nothing)
            raise RuntimeError(f"docs/_ext/options.py: {OPTIONS} has {len(fields)} options, expected 20 or more")
        for path in TAKERS:
            taker = pkg.get_member(path)
            kept = [p for p in taker.parameters if p.kind is not griffe.ParameterKind.var_keyword]
            taker.parameters = griffe.Parameters(*kept, *fields)
