"""The guard: the recovery loop, and its own bookkeeping (plans per batch bucket, the state file, the tally)."""
