"""The README and the docs keep to their rules: a README a user reads in five minutes (short, with the install line and
the two commands from a fresh clone), measured figures only in ``benchmarks/RESULTS.md``, no private module shown to
users, every page in the site's navigation and every public name on the API page. ``make docs`` (``mkdocs build
--strict``) checks the links and anchors; these check what it cannot see."""

from __future__ import annotations

import re
from pathlib import Path

import oomguard
import oomguard.planner
import oomguard.testing

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

#: A measured figure: a number with a decimal point or thousands separator (``100.9``, ``1.069``, ``2,370``), or a
#: number with a unit of time, memory or share (``303 ms``, ``64 MiB``, ``35 %``). Spaces before the unit are dropped.
#: A version inside a name (``llama-3.2-1b``, ``qwen2.5-0.5b``) is not a figure.
FIGURE = re.compile(r"(?<![\w.])(?<![A-Za-z]-)(\d+(?:[.,]\d+)+|\d+ ?(?:ms|s|KiB|MiB|GiB|MB|GB|%|x))(?![\w.])")
#: Fenced code blocks of Markdown, with their contents.
CODE_BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


#: What comes just before a setting rather than a figure: a command's flag (``--gpu-memory 6GiB``) or a quoted
#: argument (``SimulatedGPU("64MiB")``).
SETTING = re.compile(r"(?:--[\w-]+[ =]|[\"'])$")


def _figures(text: str) -> set[str]:
    """The figures ``text`` states, written alike (``303 ms`` and ``303ms`` are one figure), settings left out."""
    return {
        match.group(1).replace(" ", "")
        for match in FIGURE.finditer(text)
        if not SETTING.search(text[max(0, match.start() - 40) : match.start()])
    }


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def test_readme_is_short_and_says_how_to_install_and_start() -> None:
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference to docs/, figures to RESULTS.md"
    commands = "\n".join(CODE_BLOCK.findall(text))
    # What works today, from a clone (the package is not published), and what will once it is.
    assert re.search(r"^pip install \.", commands, re.MULTILINE), "README.md: no `pip install .` from a clone"
    assert "`pip install oomguard`" in text, "README.md: say what installs it once it is published"
    # .ci/run and the project's before-stop check run these two commands from a fresh clone.
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", commands, re.MULTILINE), f"README.md: no `{command}` command"


def test_no_figure_appears_in_both_readme_and_results() -> None:
    shared = _figures(README.read_text(encoding="utf-8")) & _figures(RESULTS.read_text(encoding="utf-8"))
    assert not shared, f"figures in both README.md and benchmarks/RESULTS.md (keep them in RESULTS.md): {shared}"


def test_no_page_shows_a_private_module() -> None:
    private = re.compile(r"\b(?:from|import)\s+oomguard(?:\.\w+)*\._|\boomguard(?:\.\w+)*\._\w+\.\w")
    for path in [README, *_pages()]:
        for block in CODE_BLOCK.findall(path.read_text(encoding="utf-8")):
            assert not private.search(block), f"{path.name} shows a private module in code:\n{block}"


def test_every_page_is_in_the_nav_and_every_readme_link_resolves() -> None:
    nav = set(re.findall(r"^\s*- [^:\n]+: (\S+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(encoding="utf-8"), re.M))
    pages = {path.name for path in _pages()}
    assert pages, "docs/ has no page"
    assert pages == nav, f"pages not in mkdocs.yml's nav: {pages - nav}; nav entries with no page: {nav - pages}"
    # mkdocs checks the links between pages; the README is not one of them.
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", README.read_text(encoding="utf-8")):
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_every_public_name_is_on_the_api_page() -> None:
    api = (DOCS / "api.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^::: (\S+)", api, re.MULTILINE))
    public = {f"oomguard.{name}" for name in oomguard.__all__}
    public |= {f"oomguard.testing.{name}" for name in oomguard.testing.__all__}
    public |= {f"oomguard.planner.{name}" for name in oomguard.planner.__all__}
    assert not public - documented, f"public names missing from docs/api.md: {sorted(public - documented)}"
