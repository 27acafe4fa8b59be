"""The ``oomguard`` command: ``demo``, ``report`` and ``plan``."""
