"""Generation side: the rollout backends behind one contract (backend.py; the run's backend is its record in
config/rollout_backends.py): vLLM engines as Ray actors (vllm_rollout.py, engine_group.py, engine.py, the worker
extension that loads weights in worker_ext.py, the driver's weight sync in weight_sync.py) and generation in the
actor's ranks (actor_rollout.py); the executors that turn prompts into rollouts, one generation per sample or a
multi-turn agent episode (executor.py, agent_engine.py, agent.py); --partial_rollout's segments (partial.py)."""
