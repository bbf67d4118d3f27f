"""Platform tuning: the one seam through which what only one platform needs reaches the core.

    where    hook (runs)                                 what it gives
    driver   preflight(cfg)                              the platform's refusals before Ray starts (ConfigError)
    driver   ray_options(cfg, num_cpus, processes)       extra ray.init arguments for a cluster this run starts
    driver   cluster_env(cfg)                            environment of that cluster's processes (set as it starts)
    driver   guests(cfg)                                 {role: host role} run inside the host's rank processes
    driver   model_groups(cfg, spawn, worker_of, stack)  the run's model groups by role, at bring-up
    driver   phases(cfg, models)                         the controller's hook: .before(phase) as each phase starts
    engine   engine_start(cfg, build)                    the engine's vLLM LLM, from build(extra LLM() arguments)

This base is the plain path, the one GPU runs take: nothing refused, one ActorGroup of plain rank actors per role
(Ray's pool threads run their calls), nothing done between phases, vLLM started as it comes. orlhf/cpu/tuning.py
fills the hooks in for CPU runs; launch/ picks it (launch/bringup.py, tuning_for) only when the device is cpu, so a
GPU run never imports orlhf.cpu. A Tuning travels to the engine actors as a constructor argument (Ray pickles it by
class), so it holds plain values only. Nothing heavy is imported here: the controller reads it too.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable


class Phases:
    """The controller's per-phase hook (Tuning.phases). This one does nothing."""

    def before(self, phase: str) -> None:
        """Runs as `phase` starts (Controller.timed), before its calls are sent."""


class Tuning:
    """The hooks, each doing what the plain path does (module docstring)."""

    def preflight(self, cfg) -> None:
        """Before Ray starts (launch/preflight.py): raise a ConfigError for flags this platform cannot run well."""

    def ray_options(self, cfg, num_cpus: int, processes: int) -> dict:
        """Extra ray.init arguments for a local cluster this run starts with `num_cpus` logical CPUs for
        `processes` model and engine processes (distributed/ray_start.py)."""
        return {}

    def cluster_env(self, cfg) -> dict[str, str]:
        """Environment variables for the processes of a local cluster this run starts: Ray's own and every worker,
        which inherit them from the raylet (distributed/ray_start.py sets them around ray.init only)."""
        return {}

    def guests(self, cfg) -> dict[str, str]:
        """{role: its host role} for the roles that run inside another role's rank processes (the placement gives
        them no bundle: distributed/layout.py). Here none: every rank keeps a process of its own (on GPUs it owns
        its device)."""
        return {}

    def model_groups(
        self, cfg, spawn: Callable[..., Any], worker_of: Callable[[str], tuple], stack: ExitStack
    ) -> dict[str, Any]:
        """{role: group} for the run's active roles, in placement order, each shut down when `stack` closes.
        spawn(role, **ActorGroup options) starts a role's ActorGroup on its bundles; worker_of(role) gives its
        (worker class, worker config). Here: one ActorGroup per role, all spawned at once."""
        from orlhf.config.roles import active_roles
        from orlhf.distributed.groups import spawn_groups

        return spawn_groups(active_roles(cfg), spawn, stack)

    def phases(self, cfg, models) -> Phases:
        """The controller's per-phase hook for `models` (trainer/controller.Models)."""
        return Phases()

    def engine_start(self, cfg, build: Callable[[dict], Any]) -> Any:
        """In an engine actor, once its environment is set: build(extra) imports vLLM and returns its LLM built
        with the engine's arguments and `extra` (rollout/engine.py)."""
        return build({})
