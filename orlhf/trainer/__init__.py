"""The single controller and its phases: the loop (controller.py) and what it calls, each a module: scoring, experience,
the train phase, the async producer, dynamic filtering, evaluation, the sync guard, engine restarts, hybrid memory
hand-over, step statistics, and the run state a checkpoint holds. Weight sync is the rollout backends' (rollout/)."""
