"""Mechanism: the only code that changes torch state (checkpointing, autocast, offload, the undoable optimizer step).

Every change is undone by the same object that made it."""
