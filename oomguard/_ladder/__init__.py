"""Policy: plans, the rungs that make them need less memory, and their registry. Pure values and decisions; no
torch state is touched here."""
