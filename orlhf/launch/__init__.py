"""One run top to bottom (run.py: lock, inputs, Ray start, bring-up, fit, export) and `orlhf plan`."""
