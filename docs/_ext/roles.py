"""The package's docstrings, written for Sphinx, made Markdown for the API page (mkdocstrings renders Markdown).

- A role naming a public name (``:class:`~oomguard.StepResult```, ``:func:`oomguard.oom_guard```) becomes a
  cross-reference, which ``mkdocs build --strict`` checks, so a docstring naming a renamed public name fails the
  build; any other role (a private helper, a method) becomes inline code. Left alone, ``:class:`` shows as text.
- A doctest (``>>>`` lines and the output after them) becomes a fenced ``pycon`` block: left alone, its output
  (``[([0, 1], ...)]``) reads as Markdown reference links that resolve nowhere.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

PACKAGE = Path(__file__).resolve().parents[2] / "oomguard"

#: ``:class:`~oomguard.X```, ``:meth:`name```...: the role, an optional ``~`` (show the last part only), the target.
ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):`(~?)([\w.]+)`")


def _exported(module: str) -> set[str]:
    """The qualified names in a module's ``__all__``, read from its source (importing would import torch: seconds)."""
    tree = ast.parse((PACKAGE.parent / module.replace(".", "/") / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return {f"{module}.{name}" for name in ast.literal_eval(node.value)}
    return set()


#: The names the API page documents: a role naming one of them becomes a checked link.
PUBLIC = _exported("oomguard") | _exported("oomguard.testing")


def _markdown(match: re.Match[str]) -> str:
    """A role as Markdown: a cross-reference to a documented public name, else inline code."""
    short, target = match.group(1), match.group(2).lstrip(".")
    shown = target.rsplit(".", 1)[-1] if short else target
    return f"[`{shown}`][{target}]" if target in PUBLIC else f"`{shown}`"


#: A doctest: its ``>>>`` and ``...`` lines and the output after them, up to a blank line (at any indentation).
DOCTEST = re.compile(r"^([ \t]*)>>> .*\n(?:\1\S.*(?:\n|$))*", re.MULTILINE)


def _fenced(match: re.Match[str]) -> str:
    """A doctest as a fenced block at its own indentation."""
    indent, body = match.group(1), match.group(0).rstrip("\n")
    return f"{indent}```pycon\n{body}\n{indent}```\n"


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's roles and doctests before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = DOCTEST.sub(_fenced, ROLE.sub(_markdown, obj.docstring.value))
