"""The run folder: logs, metrics and report, checkpoints (the format apart from the IO), the run lock."""
