"""The dry-run planner: which plan a training step needs, from one step on fake tensors."""
