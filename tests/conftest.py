"""Fixtures and the test run's own settings. The builders the tests share (models, batches, steps...) live in
tests/helpers/, imported by what they build: ``from helpers.models import make_llama``."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):  # one intra-op thread per test worker: no oversubscribed cores
    torch.set_num_threads(1)


@pytest.fixture
def python_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt), put back as it was after (a test runner's worker may have
    put another in place)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
