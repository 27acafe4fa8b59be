"""Integrations with training frameworks: ``oomguard.integrations.transformers.OOMGuardTrainer``.

For Hugging Face Accelerate, pass ``accelerator=`` to :func:`oomguard.oom_guard` directly.
"""
