"""Ray plumbing, no model code: typed endpoints, rank-actor groups, the layout (pure), placement groups, Ray start."""
