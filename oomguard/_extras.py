"""The optional dependencies, and the error that names the extra to install when one is missing.

``pip install oomguard`` needs only torch: the guard, the ladder, the simulated GPU and the planner of a model
you build yourself run on it. What reads Hugging Face configs or trains through their Trainer needs
``oomguard[hf]`` (transformers and accelerate); NVML telemetry needs ``oomguard[nvml]`` and is simply left out
without it.
"""

from __future__ import annotations

import importlib
import types

__all__ = ["missing", "require"]


def require(module: str, *, extra: str, purpose: str) -> types.ModuleType:
    """``module`` imported, or an ``ImportError`` saying that ``purpose`` needs it and which extra installs it.

    >>> require("math", extra="hf", purpose="counting").sqrt(4.0)
    2.0
    >>> require("no_such_module_here", extra="hf", purpose="planning a preset")
    Traceback (most recent call last):
    ...
    ImportError: planning a preset needs no_such_module_here, which is not installed: pip install 'oomguard[hf]'
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise missing(module, extra=extra, purpose=purpose) from error


def missing(module: str, *, extra: str, purpose: str) -> ImportError:
    """The error for ``module`` not installed: what needs it (``purpose``) and the extra that installs it."""
    return ImportError(
        f"{purpose} needs {module}, which is not installed: pip install 'oomguard[{extra}]'", name=module
    )
