"""Generation side: vLLM engines as Ray actors (engine.py), the worker extension that loads new weights inside them
(worker_ext.py), and the executors that turn prompts into rollouts: one generation per sample, or a multi-turn
agent episode (executor.py, agent.py)."""
