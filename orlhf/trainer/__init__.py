"""The single controller and its phases: the loop (controller.py), scoring, experience, the async producer,
dynamic filtering, evaluation, the sync guard, weight sync (driver side), hybrid memory hand-over, run state."""
