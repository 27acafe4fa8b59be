"""Fixtures and the test run's own settings. The builders the tests share (models, batches, steps...) live in
tests/helpers/, imported by what they build: ``from helpers.models import make_llama``."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

# No test reaches the network. On a CPU with AVX-512 bf16, bitsandbytes fetches its CPU kernel from the Hugging Face
# hub as it is imported (``kernels.get_kernel``, which asks only the local cache where the hub is offline; it then
# computes with its own kernels). The hub reads this as huggingface_hub is imported: before any test imports it.
os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # one intra-op thread per test worker: no oversubscribed cores
    torch.set_num_threads(1)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under ``--dist loadgroup`` (make test), pytest-xdist sends the tests of one ``xdist_group`` to one worker by
    appending ``@group`` to their node ids. Where that has no effect (pytest 9.2 with pytest-xdist 3.8 ignored it,
    silently), the jobs of several ranks run two at a time on two cores and a module's job runs once per worker:
    every test of a group then fails, saying so."""
    grouped = getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group")
    if grouped and "@" not in item.nodeid:
        pytest.fail(
            f"pytest-xdist's xdist_group did nothing ({item.nodeid} has no @group suffix): this pytest and "
            "pytest-xdist do not work together; install the versions setup.cfg's [test] extra names",
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def unhurried_tuning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning's search runs to its end in the call it starts in: how many calls it takes depends on how fast this
    machine runs fake steps (a 2-layer test Llama's search takes 10-20 s here), and no test's outcome should.
    tests/test_tuning.py sets the budget itself where it checks it."""
    monkeypatch.setattr("oomguard._guard.foresight.MIN_SEARCH_SECONDS", float("inf"))


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt), put back as it was after (a test runner's worker may have
    put another in place)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
