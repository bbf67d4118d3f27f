"""The CPU package is reached only through the tuning seam (distributed/tuning.py): a CUDA run's driver, bring-up,
controller, engines and workers never import orlhf.cpu. A fresh interpreter imports every module such a run uses,
builds the run's Tuning from a --device cuda config and calls each hook as the run does (the preflight with --bf16,
model groups with a stand-in spawn, the engine start with a stand-in build), then lists the orlhf.cpu modules it
holds: none. (tests/gpu/test_gpu_paths.py checks the same in real rank and engine processes on a GPU.)"""

import json
import subprocess
import sys
from contextlib import ExitStack
from types import SimpleNamespace

CUDA_RUN = r"""
import json, pickle, sys
from contextlib import ExitStack
from types import SimpleNamespace

import orlhf.cli, orlhf.launch.run, orlhf.launch.bringup, orlhf.launch.export, orlhf.launch.plan
import orlhf.trainer.controller, orlhf.trainer.scoring, orlhf.rollout.weight_sync, orlhf.trainer.async_producer
import orlhf.rollout.engine, orlhf.rollout.executor, orlhf.rollout.worker_ext
import orlhf.distributed.groups, orlhf.distributed.ray_start, orlhf.distributed.layout, orlhf.distributed.tuning
import orlhf.workers, orlhf.workers.base, orlhf.workers.deepspeed_setup
from orlhf.config.flags import build_config
from orlhf.launch.bringup import tuning_for
from orlhf.rollout.engine_config import engine_config

cfg = build_config({"device": "cuda"}, {"device"})
tuning = pickle.loads(pickle.dumps(tuning_for(cfg)))  # as an engine actor receives it
tuning_for(cfg).preflight(build_config({"device": "cuda", "bf16": True}, {"device", "bf16"}))  # refuses nothing
spawned = {}
with ExitStack() as stack:
    groups = tuning.model_groups(
        cfg,
        lambda role, **options: spawned.setdefault(role, SimpleNamespace(options=options, shutdown=lambda: None)),
        lambda role: (None, None),
        stack,
    )
tuning.phases(cfg, SimpleNamespace()).before("train")
out = {
    "tuning": type(tuning).__name__,
    "ray_options": tuning.ray_options(cfg, 16, 4),
    "groups": {role: g.options for role, g in groups.items()},
    "engine_extra": tuning.engine_start(engine_config(cfg), lambda extra: extra),
    "cpu_modules": sorted(m for m in sys.modules if m == "orlhf.cpu" or m.startswith("orlhf.cpu.")),
}
print(json.dumps(out))
"""


def test_a_cuda_run_never_imports_the_cpu_package():
    done = subprocess.run([sys.executable, "-c", CUDA_RUN], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["cpu_modules"] == []
    assert out["tuning"] == "Tuning"  # the plain path: nothing added to Ray, the groups or the engines
    assert out["ray_options"] == {} and out["engine_extra"] == {}
    assert out["groups"] == {"actor": {}, "ref": {}, "critic": {}}  # plain ActorGroups (RankActor), no guests


def test_a_cpu_run_gets_the_cpu_tuning_and_its_hosted_groups(monkeypatch):
    """The demo's defaults on CPU: one actor rank process on a CpuRankActor with room for two guests, the ref and
    the one-rank critic inside it, the critic's values and train steps beside the actor's calls (sync mode: the
    ref's calls take their turn). Stand-ins for the groups: tests/ray/test_ref_hosting.py runs the real ones."""
    from orlhf.config.flags import build_config
    from orlhf.cpu.hosting import CpuGroup
    from orlhf.cpu.rank_actor import CpuRankActor
    from orlhf.cpu.tuning import CpuTuning
    from orlhf.launch.bringup import tuning_for

    cfg = build_config({"device": "cpu"}, {"device"})
    tuning = tuning_for(cfg)
    assert type(tuning) is CpuTuning
    spawned = {}

    def host(group, role, worker_cls, cfg, beside=()):
        return SimpleNamespace(role=role, host=group.role, beside=beside, world_size=1, pids=lambda: [0])

    def spawn(role, **options):  # an ActorGroup's stand-in: what CpuGroup reads of it
        spawned[role] = options
        return SimpleNamespace(role=role, worker_cls=None, world_size=1, timeout_s=1.0, actors=[], shutdown=print)

    monkeypatch.setattr(CpuGroup, "host", host)  # no Ray here
    with ExitStack() as stack:
        groups = tuning.model_groups(cfg, spawn, lambda role: (None, None), stack)
        stack.pop_all()
    assert spawned == {"actor": {"actor_cls": CpuRankActor, "concurrency": 6}}
    assert list(groups) == ["actor", "ref", "critic"] and isinstance(groups["actor"], CpuGroup)
    assert (groups["ref"].host, groups["critic"].host) == ("actor", "actor")
    assert [fn.__name__ for fn in groups["critic"].beside] == ["values", "train_step"] and groups["ref"].beside == ()
