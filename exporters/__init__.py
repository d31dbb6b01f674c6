"""Signal sources for hybridmon: one module per source, each a Collector (see base.py)."""
