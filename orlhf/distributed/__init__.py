"""Ray plumbing, no model code: typed endpoints, rank-actor groups and their one call API, the layout (pure),
placement groups, Ray start, and the platform tuning seam (tuning.py) through which CPU-only code plugs in."""
