"""--max_restarts: a run that lost a process starts its groups and engines again from its newest checkpoint.

    run_locked (launch/run.py), once Ray is up and the inputs are read:
      attempt: placement groups -> engines + model groups -> controller (resumed) -> fit -> export
      a failure -> RunRestarts.lost(error, attempt), while the attempt's processes are still up:
          the processes gone: the error's own (a RankError whose process died or hung: distributed/heartbeat.py)
          and a health check of every group and engine the attempt started (a peer's error can reach the driver
          before the dead rank's)
      none gone (a bug, bad data, NaN losses, a timeout of live processes): the error stops the run as before
      gone, with restarts left: one line naming them and the step, the attempt torn down (its processes killed,
          its placement groups removed), then RunRestarts.next_attempt: the newest complete checkpoint of this run,
          or the start of the run without one, and the placement waits up to --ray_timeout_s for the resources of
          a lost node to come back (then stops with the table of what is missing)
      gone, none left: one line, then the error stops the run naming the process, as with --max_restarts 0
Each restart is a line in the log and a row of <save_path>/restarts.jsonl (what was lost, the step in progress, the
checkpoint resumed); metrics rows carry `run_restarts`. The steps after the checkpoint are trained again: the metrics
file loses their rows before they are logged again (storage/metrics.py), so each step appears once. Engines that
--max_engine_restarts replaces in place never get here; the ones it does not (async, agents, CUDA IPC) do.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from orlhf.storage.run_folder import RunFolder

log = logging.getLogger("orlhf")


@dataclass
class Attempt:
    """One start of the run's groups: where it resumes, and what it has started so far (for the health check).
    `number`: restarts before it; `first_step`: the invocation's first step (--stop_after_steps counts from it);
    `carried`: the metric rows of earlier attempts up to the resumed step (the run's summary covers them)."""

    resume_from: Optional[Path] = None
    resume_step: Optional[int] = None
    number: int = 0
    first_step: int = 0
    carried: list = field(default_factory=list)
    rollout: Any = None  # the rollout backend's early start (launch_rollout), before the models exist
    models: Any = None
    controller: Any = None
    phase: str = "start-up"  # then "training" (Controller.fit), "export", "done" (launch/run.py's run_attempt)
    complete: bool = False  # the run's outputs are written: only its teardown is left

    def step(self) -> Optional[int]:
        """The step in progress, or whose checkpoint is being written (None during the start-up and the export)."""
        if self.controller is None or self.phase != "training":
            return None
        return self.controller.step_index + (0 if self.controller.saving else 1)

    def where(self) -> str:
        """The phase in words: "during the start-up", "during step 7", "during the checkpoint of step 6", ..."""
        step = self.step()
        if step is not None:
            return f"during the checkpoint of step {step}" if self.controller.saving else f"during step {step}"
        if self.phase == "done":
            return "at the end of the run"
        return "during the export" if self.phase == "export" else "during the start-up"

    def history(self) -> list:
        return self.carried + (self.controller.history if self.controller is not None else [])


def gone_processes(error: BaseException, attempt: Attempt, timeout_s: float = 10.0) -> list[str]:
    """Names of the attempt's processes that are gone ("actor rank 0", "vllm engine 1"): the error's own when its
    process died, and every rank and engine the attempt started that a health check finds dead."""
    names = []
    if getattr(error, "died", False) and hasattr(error, "rank"):
        names.append(_name(getattr(error, "host", None) or error.role, error.rank))
    models = attempt.models
    groups = models.groups() if models is not None else []
    seen: set = set()
    for group in groups:
        key = tuple(id(a) for a in getattr(group, "actors", []))
        if key in seen or not hasattr(group, "dead"):  # the CPU guests share their host's processes
            continue
        seen.add(key)
        names += [_name(getattr(group, "host_role", None) or group.role, r) for r in group.dead(timeout_s)]
    from orlhf.rollout.backend import EngineProcesses

    rollout = models.rollout if models is not None else attempt.rollout
    if isinstance(rollout, EngineProcesses):  # members of its own; the actor's ranks are checked with their group
        names += [_name("vllm", i) for i in rollout.dead(timeout_s)]
    return list(dict.fromkeys(names))


def _name(role: str, index: int) -> str:
    return f"vllm engine {index}" if role.startswith("vllm") else f"{role} rank {index}"


class RunRestarts:
    """The run's restarts (module docstring): `limit` = --max_restarts; `save_path` holds restarts.jsonl."""

    def __init__(self, limit: int, save_path: str, run_id: str, resumed: bool = False):
        self.limit, self.run_id, self.count = limit, run_id, 0
        self.path = RunFolder.at(save_path).restarts
        if not resumed:  # a fresh run starts a fresh record, as metrics.jsonl does; a resumed run's goes on
            self.path.unlink(missing_ok=True)

    def may_restart(self, error: BaseException, attempt: Attempt) -> bool:
        """Whether `error` lost a process of the attempt and a restart is left; says so in one line either way when
        processes are gone (the error itself then stops the run). Call before the attempt is torn down."""
        gone = gone_processes(error, attempt)
        if not gone:
            return False
        step, where = attempt.step(), attempt.where()
        if self.count >= self.limit:
            used = f", {self.count} used" if self.limit else ""
            log.error("%s lost %s; not restarted: --max_restarts %d%s", ", ".join(gone), where, self.limit, used)
            return False
        self.count += 1
        how = "stopped answering health checks" if getattr(error, "hung", False) else "died"
        seen = f"its process {how} in {error.role} {error.method}()" if getattr(error, "died", False) else None
        why = seen or f"found dead after: {_first_line(error)}"  # a peer's error reached the driver first
        log.warning(
            "%s lost %s (%s); restarting the run's groups (restart %d of --max_restarts %d)",
            ", ".join(gone),
            where,
            why,
            self.count,
            self.limit,
        )
        self._lost = {"lost": gone, "step": step, "error": _first_line(error), "time": time.time()}
        return True

    def next_attempt(self, attempt: Attempt, checkpoints) -> Attempt:
        """After the lost attempt is torn down: the next one, from this run's newest complete checkpoint (another
        run's in the same folder is never taken), or from the start of the run."""
        from orlhf.storage.checkpoint import read_meta

        path = next((p for p in checkpoints.complete() if read_meta(p).get("run_id") == self.run_id), None)
        step = int(read_meta(path)["step"]) if path is not None else 0
        kept = attempt.history()[: max(0, step - attempt.first_step)]
        nxt = Attempt(path, step, self.count, attempt.first_step, kept)
        if path is not None:
            log.warning("restart %d: resuming from %s (step %d)", self.count, path, step)
        else:
            log.warning("restart %d: no checkpoint of this run yet: starting again from step 0", self.count)
        self._record({**self._lost, "restart": self.count, "resumed_from": str(path) if path else None, "at": step})
        return nxt

    def _record(self, row: dict) -> None:
        """One row per restart in restarts.jsonl (best effort: the log line has said it already)."""
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:
            log.warning("could not record the restart in %s (%s)", self.path, e)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0].rstrip(":") if text else type(error).__name__
