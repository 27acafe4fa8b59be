"""What a clone installs: one version, the licence, honest classifiers, and a demo that installs only what it needs.

The wheel itself, installed beside torch alone, is checked by ``make wheel-check`` (scripts/wheel_check.py).
"""

from __future__ import annotations

import configparser
import subprocess
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import oomguard
from oomguard._cli.main import main

ROOT = Path(__file__).resolve().parent.parent


def _setup() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def _extra(name: str) -> set[str]:
    lines = _setup()["options.extras_require"][name].splitlines()
    return {Requirement(line).name for line in lines if line.strip() and not line.strip().startswith("#")}


def test_oomguard_version_says_the_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"oomguard {oomguard.__version__}"
    assert _setup()["metadata"]["version"] == "attr: oomguard.__version__", "setup.cfg reads it: one place"
    assert metadata.version("oomguard") == oomguard.__version__


def test_the_licence_and_the_classifiers_say_what_the_package_is() -> None:
    assert (ROOT / "LICENSE").read_text(encoding="utf-8").split()[:4] == ["Apache", "License", "Version", "2.0,"]
    meta = _setup()["metadata"]
    assert meta["license"] == "Apache-2.0" and meta["license_files"] == "LICENSE"
    classifiers = [line.strip() for line in meta["classifiers"].splitlines() if line.strip()]
    assert "Framework :: Pytest" not in classifiers, "oomguard is not a pytest plugin"
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    supported = SpecifierSet(_setup()["options"]["python_requires"])
    versions = [c.rsplit(" :: ", 1)[1] for c in classifiers if c.startswith("Programming Language :: Python :: 3.")]
    assert versions and all(version in supported for version in versions), versions
    assert f"Programming Language :: Python :: {min(versions, key=lambda v: tuple(map(int, v.split('.'))))}" in (
        classifiers
    )


@pytest.mark.subprocess
def test_make_demo_installs_the_demo_extra_not_the_test_toolchain(tmp_path: Path) -> None:
    """Before: `make demo` ran the bootstrap that installs `.[test]` (97 packages, 1.8 GB of pytest, mypy, mkdocs,
    TRL...) to run the demo."""
    said = subprocess.run(
        ["make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert said.returncode == 0, said.stderr
    (bootstrap,) = [line for line in said.stdout.splitlines() if "bootstrap.sh" in line]
    assert bootstrap.split()[-1] == "demo", bootstrap
    assert 'install -e ".[$extra]"' in (ROOT / "scripts" / "bootstrap.sh").read_text(encoding="utf-8")
    demo = _extra("demo")
    assert "transformers" in demo, "the demo's Llama"
    assert not demo & {"pytest", "mypy", "ruff", "mkdocs", "trl", "datasets", "peft", "accelerate"}, demo
    assert demo <= _extra("test"), "make test installs what the demo needs too"


def test_the_ladder_option_names_the_default_ladder() -> None:
    """Before: the `ladder` docstring left out chunked_loss, the default ladder's first rung."""
    from oomguard._ladder.ladder import resolve_ladder

    doc = " ".join((oomguard.oom_guard.__doc__ or "").split())
    listed = doc.split("ladder: ", 1)[1].split("``[", 1)[1].split("]``", 1)[0]
    assert [name.strip(' "') for name in listed.split(",")] == list(resolve_ladder(None).names)
    assert "``amp`` (mixed precision" in doc and "changes the maths" in doc


def test_the_api_page_gives_every_guard_option_its_type_and_default() -> None:
    """Before: mkdocstrings showed all 28 options of oom_guard as "required", without a type: the signature it
    reads from the source is ``(fn=None, /, **options)``."""
    import dataclasses
    import sys

    import griffe

    sys.path.insert(0, str(ROOT / "docs" / "_ext"))
    try:
        from options import GuardOptionsSignature
    finally:
        sys.path.remove(str(ROOT / "docs" / "_ext"))
    package = griffe.load("oomguard", search_paths=[ROOT], extensions=griffe.load_extensions(GuardOptionsSignature))
    from oomguard._options import GuardOptions

    fields = {f.name: f for f in dataclasses.fields(GuardOptions) if f.init}
    for path in ("_decorator.oom_guard", "_guard.guard.OOMGuard.__init__"):
        parameters = {p.name: p for p in package.get_member(path).parameters if p.kind.name == "keyword_only"}
        assert list(parameters) == list(fields), path
        assert all(p.annotation is not None for p in parameters.values()), path
        required = [name for name, p in parameters.items() if p.default is None]
        assert required == ["model", "optimizer"], required
        assert str(parameters["max_attempts"].default) == "256" and str(parameters["ladder"].default) == "None"
