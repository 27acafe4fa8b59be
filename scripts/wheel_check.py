"""The built wheel, installed where torch alone is: what ``pip install oomguard`` beside torch gives a user.

The test venv has numpy, psutil, transformers and the rest, so an undeclared import passes every test there (numpy
did, and ``import oomguard`` failed beside torch alone). This check builds the wheel from the working tree's files
(tracked and untracked, as ``git`` sees them, copied: nothing is built inside the checkout), makes a fresh venv
that sees the torch of the test venv and the packages torch requires and nothing else (linked, not installed: a
second torch would cost a minute and a download where none is kept), installs the wheel there without its
dependencies, and then asks that venv:

- ``pip check``: what the wheel declares (torch) is met by what is there;
- numpy is not importable (else the check proves nothing), ``oomguard`` comes from the installed wheel;
- a guarded step (an ``nn.Linear``, AdamW) under a :class:`~oomguard.testing.SimulatedGPU` runs out of memory,
  recovers and commits its step;
- every module of the package imports, or fails with the error that names the extra to install;
- ``oomguard --help`` runs, and ``oomguard --version`` names the wheel's version (``oomguard.__version__``, which
  setup.cfg reads: the one place the version is written);
- the wheel carries the licence (``LICENSE``, Apache-2.0) in its metadata folder.

Run by ``make wheel-check`` (part of ``make test``) with the test venv's Python: 18 s of CPU, 27-51 s here on two loaded
cores (the wheel's build 7 s, the guarded step and the imports 14 s, each further Python that imports torch 4-5 s).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import zipfile
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent

#: Run by the fresh venv's Python, outside the checkout.
SMOKE = textwrap.dedent(
    """
    import importlib, importlib.util, pkgutil, sys
    from pathlib import Path

    import torch

    import oomguard
    from oomguard.testing import SimulatedGPU

    assert Path(oomguard.__file__).is_relative_to(sys.prefix), f"oomguard from {oomguard.__file__}, not the wheel"
    assert importlib.util.find_spec("numpy") is None, "numpy is importable here: the check would prove nothing"

    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.weight.detach().clone()

    @oomguard.oom_guard(model=model, optimizer=optimizer, tune_after=None)
    def step(batch):
        x, y = batch
        return torch.nn.functional.mse_loss(model(x), y)

    with SimulatedGPU("2500KiB") as gpu:  # (the whole batch needs 3 MiB)
        gpu.adopt(model)
        result = step((torch.randn(512, 256), torch.randn(512, 256)))
    assert result.ooms >= 1, f"no recovery to check: {result}"
    assert not torch.equal(model.weight, before), "the step was not committed"

    needs_extra = []
    for module in pkgutil.walk_packages(oomguard.__path__, "oomguard."):
        if module.name == "oomguard.__main__":
            continue  # (importing it runs the command: `oomguard --help` below)
        try:
            importlib.import_module(module.name)
        except ImportError as error:
            if "pip install 'oomguard[" not in str(error):
                raise  # an undeclared dependency, or one imported where it should be imported lazily
            needs_extra.append(module.name)
    assert "numpy" not in sys.modules
    print(f"a guarded step recovered ({result.ooms} OOMs, micro-batches of {result.plan.micro_batch_size});",
          f"every module imports (needing an extra: {', '.join(needs_extra) or 'none'})")
    """
)


def torch_and_its_requirements() -> list[metadata.Distribution]:
    """The installed distribution of torch and of everything it requires (its extras left out), transitively."""
    found: dict[str, metadata.Distribution] = {}
    wanted = ["torch"]
    while wanted:
        name = canonicalize_name(wanted.pop())
        if name in found:
            continue
        found[name] = dist = metadata.distribution(name)
        for line in dist.requires or ():
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
    return list(found.values())


def link_only(dists: list[metadata.Distribution], into: Path) -> None:
    """Symbolic links in ``into`` to the top-level modules and metadata folders of ``dists``, nothing else of the
    folder they are installed in."""
    into.mkdir()
    for dist in dists:
        if dist.files is None:
            sys.exit(f"wheel-check: {dist.metadata['Name']} has no list of its files (RECORD; not installed by pip)")
        tops = {file.parts[0] for file in dist.files if file.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (into / top).exists():
                (into / top).symlink_to(source)


def working_tree(into: Path) -> None:
    """The checkout's files as a clean clone of this working tree would have them (git's view: ignored ones left
    out), copied to ``into``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():  # (a file deleted in the working tree is still listed by --cached)
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)


def isolation() -> tuple[str, ...]:
    """pip's option to build with the test venv's setuptools where it builds wheels by itself (70.1 and later;
    torch 2.13 requires 77): offline, 7 s here; else pip's isolated build, which installs the build requirements of
    pyproject.toml first (19 s here)."""
    try:
        built_in = importlib.util.find_spec("setuptools.command.bdist_wheel") is not None
    except ImportError:
        built_in = False
    return ("--no-build-isolation",) if built_in else ()


def run(
    *command: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``command`` run to its end; the check ends with its output where it fails."""
    started = time.perf_counter()
    done = subprocess.run([str(part) for part in command], capture_output=True, text=True, cwd=cwd, env=env)
    said = " ".join("<the check's script>" if "\n" in str(part) else str(part) for part in command)
    if os.environ.get("WHEEL_CHECK_TIMES"):
        print(f"wheel-check: {time.perf_counter() - started:5.1f} s  {said}")
    if done.returncode != 0:
        sys.exit(f"wheel-check: {said} failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return done


def metadata_version(wheel: Path) -> str:
    """The version a wheel's own metadata (``*.dist-info/METADATA``) declares; the check ends where the wheel
    leaves out the licence file."""
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (name,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        lines = archive.read(name).decode("utf-8").splitlines()
    if not any(name.endswith(("dist-info/licenses/LICENSE", "dist-info/LICENSE")) for name in names):
        sys.exit(f"wheel-check: {wheel.name} has no LICENSE in its metadata (setup.cfg's license_files)")
    return next(line.removeprefix("Version:").strip() for line in lines if line.startswith("Version:"))


def main() -> None:
    started = time.perf_counter()
    if Version(metadata.version("pip")) < Version("22.3"):  # (its `--python`: the test venv's pip installs elsewhere)
        sys.exit(f"wheel-check: pip {metadata.version('pip')} is too old: {sys.executable} -m pip install -U pip")
    with tempfile.TemporaryDirectory(prefix="oomguard-wheel-check-") as scratch:
        tmp = Path(scratch)
        working_tree(tmp / "src")
        run(sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation(), "-q", "-w", tmp / "dist", tmp / "src")
        (wheel,) = (tmp / "dist").glob("oomguard-*.whl")
        venv = tmp / "venv"
        run(sys.executable, "-m", "venv", "--without-pip", venv)
        python = venv / "bin" / "python"
        site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout.strip())
        dists = torch_and_its_requirements()
        link_only(dists, tmp / "torch-only")
        (site / "torch-only.pth").write_text(f"{tmp / 'torch-only'}\n")
        pip = (sys.executable, "-m", "pip", "--python", python, "--disable-pip-version-check")
        run(*pip, "install", "--no-deps", "--no-index", "-q", wheel)
        run(*pip, "check")
        env = {key: value for key, value in os.environ.items() if not key.startswith("PYTHON")}
        env["PYTHONNOUSERSITE"] = "1"
        smoke = run(python, "-c", SMOKE, cwd=tmp, env=env)
        run(venv / "bin" / "oomguard", "--help", cwd=tmp, env=env)
        said = run(venv / "bin" / "oomguard", "--version", cwd=tmp, env=env).stdout.strip()
        built = metadata_version(wheel)
        if said != f"oomguard {built}":
            sys.exit(f"wheel-check: `oomguard --version` said {said!r}, the wheel is version {built}")
    names = ", ".join(sorted(str(dist.metadata["Name"]) for dist in dists))
    print(
        f"wheel-check: {wheel.name} beside {names} alone: {smoke.stdout.strip()}; `oomguard --help` runs, "
        f"`oomguard --version` says {said!r}"
    )
    print(f"wheel-check: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
