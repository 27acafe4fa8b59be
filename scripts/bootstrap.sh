#!/bin/sh
# Make the local virtualenv that `make test` and `make demo` use, from a fresh clone.
#
# - A torch that is already importable by $PYTHON is kept (the venv sees it through --system-site-packages).
# - Otherwise, without an NVIDIA GPU, the CPU build of torch is installed: never the multi-GB CUDA wheels.
# - Then this package is installed in editable mode with the extra named second (default: test): `make demo` asks
#   for `demo` (transformers and matplotlib), `make test` for `test` (every extra, pytest, mypy, ruff, mkdocs).
set -eu

venv=${1:-.venv}
extra=${2:-test}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
    if "$python" -c "import torch" >/dev/null 2>&1; then
        echo "bootstrap: reusing the torch installed for $python"
        "$python" -m venv --system-site-packages "$venv"
    else
        "$python" -m venv "$venv"
    fi
fi
pip="$venv/bin/python -m pip --disable-pip-version-check"

if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "bootstrap: NVIDIA GPU found, installing torch with CUDA"
        $pip install "torch>=2.4"
    else
        # 2.13.0 is the CPU build kept on this project's machines; elsewhere PyTorch's CPU index has it.
        echo "bootstrap: no NVIDIA GPU, installing a CPU build of torch"
        $pip install "torch==2.13.0" ||
            $pip install "torch>=2.4" --index-url https://download.pytorch.org/whl/cpu
    fi
fi

$pip install -e ".[$extra]"
