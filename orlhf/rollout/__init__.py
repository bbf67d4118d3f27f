"""Generation side: vLLM engines as Ray actors (engine.py) and the worker extension that loads new weights."""
