"""Imported by every Python worker of a local CPU cluster orlhf starts, before the worker takes work (Ray's
`preload_python_modules`, cpu/tuning.worker_preload): torch and transformers' model base, which every orlhf actor
(model rank or vLLM engine) imports first, load while the driver places the groups and reads its inputs, instead
of after the actor lands on the worker. Ray prestarts min(cores, num_cpus) workers when the driver connects, and
orlhf's actors take those workers.

transformers' lazy-module tables come from their cache file (storage/import_tables.py).

As in CpuRankActor and CpuTuning.engine_start: no automatic garbage collection while the imports build objects
that are almost never garbage, then the heap is frozen so later collections skip them.

torch fixes its thread count at import, before Ray sets OMP_NUM_THREADS for the actor that later lands here, so
each actor applies Ray's value first thing (threads.threads_as_ray_set). The actors set their own environment
(DS_ACCELERATOR, VLLM_*) before importing DeepSpeed or vLLM, which are not preloaded.
"""

import gc
import importlib

from orlhf.storage.import_tables import install as install_import_tables

# transformers.modeling_utils: the model base every Llama/Qwen/... class imports; it pulls torch._dynamo and
# torch.distributed.tensor, most of transformers' import cost.
MODULES = ("torch", "transformers.modeling_utils")

gc.disable()
try:
    install_import_tables()  # transformers' tables from their cache (storage/import_tables.py)
    for name in MODULES:
        importlib.import_module(name)
finally:
    gc.freeze()
    gc.enable()
