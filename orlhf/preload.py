"""Imported by every Python worker of a local CPU cluster orlhf starts, before the worker takes work (Ray's
`preload_python_modules`, raystart.py): torch and transformers' model base, which every orlhf actor (model rank or
vLLM engine) imports first, load while Ray is still starting and the driver loads its inputs, instead of after the
actor lands on the worker. Ray prestarts one worker per CPU slot at ray.init and orlhf's actors take those workers.

As in RankActor and EngineActor: no automatic garbage collection while the imports build ~500k objects that are
almost never garbage, then the heap is frozen so later collections skip them.

Nothing here reads the actor's settings: Ray sets OMP_NUM_THREADS when the actor starts (torch reads it at its first
parallel op, not at import), and the actors set their own environment (DS_ACCELERATOR, VLLM_*) before importing
DeepSpeed or vLLM, which are not preloaded.
"""

import gc
import importlib

# transformers.modeling_utils: the model base every Llama/Qwen/... class imports; it pulls torch._dynamo and
# torch.distributed.tensor, most of transformers' import cost.
MODULES = ("torch", "transformers.modeling_utils")

gc.disable()
try:
    for name in MODULES:
        importlib.import_module(name)
finally:
    gc.freeze()
    gc.enable()
