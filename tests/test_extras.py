"""What ``pip install oomguard`` needs: torch alone. The guard, its ladder, the simulated GPU and the planner of a
model the user builds run without the extras; what needs one says which to install."""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Run first in the child: every optional dependency (and tenacity, no longer one) is absent, as on a machine where
#: only torch is installed; numpy and psutil too, which torch does not require (the test venv has both). A None in
#: ``sys.modules`` is what an absent module looks like to both askers: ``import`` raises ModuleNotFoundError and
#: ``importlib.util.find_spec`` answers None (torch asks that of numpy, and imports on without it).
_WITHOUT_EXTRAS = """
import sys
MISSING = ("transformers", "accelerate", "trl", "peft", "bitsandbytes", "datasets", "matplotlib", "pynvml", "tenacity",
           "numpy")
sys.modules.update(dict.fromkeys((*MISSING, "psutil")))
"""


def _run_without_extras(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = _WITHOUT_EXTRAS + textwrap.dedent(code)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)


def test_the_only_hard_requirement_is_torch() -> None:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    required = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    assert [line.split(">")[0].split("=")[0] for line in required] == ["torch"]
    extras = config["options.extras_require"]
    assert {"hf", "trl", "peft", "qlora", "plot", "nvml", "test"} <= set(extras)
    assert "transformers" in extras["hf"] and "nvidia-ml-py" in extras["nvml"]
    assert {"peft", "bitsandbytes"} <= {line.split(">")[0].strip() for line in extras["qlora"].splitlines()}
    assert "bitsandbytes" in extras["test"], "CI installs it: the QLoRA tests run there"


@pytest.mark.subprocess
def test_a_guarded_step_recovers_and_plans_with_torch_alone() -> None:
    done = _run_without_extras(
        """
        import torch, oomguard
        from oomguard.testing import SimulatedGPU
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

        @oomguard.oom_guard(model=model, optimizer=optimizer, predictive=False, tune_after=None)
        def step(batch):
            x, y = batch
            return torch.nn.functional.mse_loss(model(x), y)

        with SimulatedGPU("600KiB") as gpu:
            gpu.adopt(model)
            result = step((torch.randn(256, 64), torch.randn(256, 1)))
        assert result.ooms >= 1 and result.micro_batches > 1, result
        for name in ("transformers", "accelerate", "bitsandbytes", "pynvml", "tenacity", "numpy", "psutil"):
            assert sys.modules.get(name) is None, name  # (never imported: a None stays None)
        try:
            oomguard.plan("gpt2", gpu_memory="6GiB")
        except ImportError as error:
            print("PLAN:", error)
        try:
            import oomguard.integrations.transformers
        except ImportError as error:
            print("TRAINER:", error)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if line.startswith(("PLAN", "TRAINER")))
    assert "needs transformers" in lines["PLAN"] and "pip install 'oomguard[hf]'" in lines["PLAN"]
    assert "OOMGuardTrainer" in lines["TRAINER"] and "oomguard[hf]" in lines["TRAINER"]
