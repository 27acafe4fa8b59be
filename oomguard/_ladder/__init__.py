"""Policy: plans and the rungs that make them cheaper. Pure values and decisions; no torch state is touched here."""
