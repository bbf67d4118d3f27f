"""ActorGroup: one model role as N rank actors on their placement-group bundles.

    driver                                 Ray
    ActorGroup("actor", PolicyWorker, cfg, slots)    slots: placement.RankBundle per rank
      |-- RankActor(rank 0) on slot 0  --> PolicyWorker(cfg) with MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK
      |-- RankActor(rank 1) on slot 1  --> ...
    group.call(PolicyWorker.init).get()                  every rank, same args (collectives: all ranks enter)
    group.call_sharded(PolicyWorker.log_probs, batch)    batch split over ranks -> GroupCall; .get_cat() gathers
    group.call_rank(0, PolicyWorker.sync_address)        one rank
    wait_calls(call_a, call_b)                           several calls (of any groups) waited on together
    settle(call, timeout_s)                              each member waited on alone: results, lost, failed
    spawn_groups(roles, spawn, stack)                    several groups started at once, each shut down with stack

A RankActor (distributed/rank_actor.py) holds each rank's worker in its process.
Calls name the method by reference (orlhf/distributed/endpoints.py): it must be an @endpoint of the group's worker
class, checked before anything is sent. Every call starts at once and returns a GroupCall; .get() waits. The
engines' group (rollout/engine.py) has the same call / call_rank and returns the same GroupCall; so do the groups a
platform's tuning builds on these actors (distributed/tuning.py: on CPU, orlhf/cpu/hosting.py).

Invariants:
- Every wait has a timeout; a timeout names the role, method and the ranks still running.
- The first rank that fails ends the wait at once (its peers may be stuck in a collective waiting for it):
  the error names role, rank, method and carries the remote traceback.
- ZeRO-3 forwards are collective, so every rank must run the same number of micro-batches: call_sharded
  pads the batch to a multiple of the world size (repeating the last row) and trims the results.
"""

from __future__ import annotations

import logging
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any, Callable, Optional, Sequence

import ray
import torch

from orlhf.distributed import addresses
from orlhf.distributed.endpoints import check_exports, method_name
from orlhf.distributed.heartbeat import Heartbeat
from orlhf.distributed.placement import RankBundle, scheduling_options
from orlhf.distributed.rank_actor import RankActor, log_name
from orlhf.storage.logs import LOG_DIR_ENV, tail, worker_log_path

log = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A rank actor raised or died. `role`, `rank` and `method` say where; the message holds the traceback.
    `host`: the role whose rank processes ran the call, when another role's (its log is that role's). `hung`: its
    process stopped answering health checks (distributed/heartbeat.py); it counts as gone (`died`) too."""

    def __init__(
        self,
        role: str,
        rank: int,
        method: str,
        detail: str,
        died: bool = False,
        host: Optional[str] = None,
        hung: bool = False,
    ):
        self.role, self.rank, self.method, self.died = role, rank, method, died or hung  # died: the process is gone
        self.host, self.hung = host, hung
        detail = re.sub(r"\x1b\[[0-9;]*m", "", detail)  # Ray colours its task names
        path = worker_log_path(log_name(host or role, rank))
        if path is not None:
            last = tail(path) if self.died else ""  # no traceback travelled: show what the process printed last
            detail += f"\nlast lines of {path}:\n{last}" if last else f"\nits full output: {path}"
        where = f" (in {host} rank {rank}'s process)" if host else ""
        super().__init__(f"{role} rank {rank} failed in {method}(){where}:\n{detail}")


class GroupCall:
    """Remote calls in flight on some members of a group (ranks or engines); .get() waits for all of them.
    `actors`: the actor of each member (health-checked while waiting when `hang_s` is set: heartbeat.py)."""

    def __init__(
        self,
        role: str,
        method: str,
        refs: list,
        ranks: list,
        timeout_s: float,
        n_out: Optional[int] = None,
        host: Optional[str] = None,
        actors: Optional[list] = None,
        hang_s: Optional[float] = None,
    ):
        self.role, self.method, self.refs, self.ranks, self.n_out = role, method, refs, ranks, n_out
        self.timeout_s, self.host = timeout_s, host  # host: the role whose rank processes run these calls
        self.actors, self.hang_s = actors if hang_s else None, hang_s

    def get(self, timeout_s: Optional[float] = None) -> list:
        """Results in member order; a failure, a hung process or a timeout raises naming the role, method and
        member."""
        where = [(self.role, r, self.method, self.host) for r in self.ranks]
        what = f"{self.role}: {self.method}()"
        return _wait(self.refs, where, what, timeout_s or self.timeout_s, self._heartbeat(self.actors))

    def _heartbeat(self, actors: Optional[list]) -> Optional[Heartbeat]:
        return Heartbeat(actors, self.hang_s) if actors and self.hang_s else None

    def future(self):
        """A concurrent.futures.Future of a one-member call (asyncio code waits on it: rollout/executor.py)."""
        if len(self.refs) != 1:
            raise ValueError(f"{self.role}: future() needs a call on one member, this one has {len(self.refs)}")
        return self.refs[0].future()

    def get_cat(self, timeout_s: Optional[float] = None) -> torch.Tensor:
        """Concatenate per-rank tensors along dim 0 and drop call_sharded's padding rows."""
        return torch.cat(self.get(timeout_s), dim=0)[: self.n_out]


def wait_all(refs: list, ranks: list, role: str, method: str, timeout_s: float, host: Optional[str] = None) -> list:
    """ray.get for refs from several ranks, failing fast on the first error and after timeout_s."""
    return _wait(refs, [(role, r, method, host) for r in ranks], f"{role}: {method}()", timeout_s)


def settle(call: GroupCall, timeout_s: float) -> tuple[dict, dict, dict]:
    """Wait for each member of `call` on its own, by one deadline, where wait_all stops at the first failure:
    (results, lost, failed), each keyed by member. lost: the member died (RankError.died) or had not answered by the
    deadline (TimeoutError) or stopped answering health checks (RankError.hung); failed: it raised (RankError). For
    callers that go on without some members (trainer/engine_restart.py replaces lost engines)."""
    deadline = time.monotonic() + timeout_s
    results: dict = {}
    lost: dict = {}
    failed: dict = {}
    for k, (ref, member) in enumerate(zip(call.refs, call.ranks)):
        left = max(1.0, deadline - time.monotonic())  # one that finished meanwhile is still collected
        where = [(call.role, member, call.method, call.host)]
        beat = call._heartbeat([call.actors[k]] if call.actors else None)
        try:
            results[member] = _wait([ref], where, f"{call.role}: {call.method}()", left, beat)[0]
        except RankError as e:
            (lost if e.died else failed)[member] = e
        except TimeoutError as e:
            lost[member] = e
    return results, lost, failed


def health_check(call: GroupCall, timeout_s: float) -> dict:
    """{member: RankError} of the members of a pid() `call` that are gone: their process died, or gave no answer
    within timeout_s (hung: pid() runs beside any call, heartbeat.HEALTH)."""
    gone = {}
    for member, e in settle(call, timeout_s)[1].items():
        if not isinstance(e, RankError):
            detail = f"its process gave no answer to a health check within {timeout_s:.0f} s: hung"
            e = RankError(call.role, member, call.method, detail, host=call.host, hung=True)
        gone[member] = e
    return gone


def wait_calls(*calls: GroupCall, timeout_s: Optional[float] = None) -> list[list]:
    """Wait for several calls together, failing fast on the first error: when two groups talk to each other
    (a weight sync), one side's failure leaves the other stuck in a collective, so neither is waited alone.
    Returns each call's results."""
    refs = [r for c in calls for r in c.refs]
    where = [(c.role, k, c.method, c.host) for c in calls for k in c.ranks]
    what = " + ".join(f"{c.role}: {c.method}()" for c in calls)
    actors = [a for c in calls for a in (c.actors or [None] * len(c.refs))]
    hang_s = min((c.hang_s for c in calls if c.actors), default=None)
    beat = Heartbeat(actors, hang_s) if hang_s else None
    flat = _wait(refs, where, what, timeout_s or max(c.timeout_s for c in calls), beat)
    out, i = [], 0
    for c in calls:
        out.append(flat[i : i + len(c.refs)])
        i += len(c.refs)
    return out


def _wait(
    refs: list,
    where: list[tuple[str, Any, str, Optional[str]]],
    what: str,
    timeout_s: float,
    beat: Optional[Heartbeat] = None,
) -> list:
    """where[i] = (role, rank, method, host or None) of refs[i], for the error of the first one that fails, times
    out, or (with `beat`) runs on a process that stopped answering health checks."""
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending, deadline = list(refs), time.monotonic() + timeout_s
    poll_s = beat.every_s if beat is not None else 5.0
    while pending:
        hung = beat.hung([index[r] for r in pending]) if beat is not None else None
        if hung is not None:
            role, rank, method, host = where[hung[0]]
            detail = f"its process gave no answer to a health check for {hung[1]:.0f} s (--hang_timeout_s): hung"
            raise RankError(role, rank, method, detail, host=host, hung=True)
        left = deadline - time.monotonic()
        if left <= 0:
            several = len({w[0] for w in where}) > 1  # name the group of each rank when there are several
            still = sorted(
                (f"{where[index[r]][0]} {where[index[r]][1]}" if several else where[index[r]][1] for r in pending),
                key=str,
            )
            raise TimeoutError(
                f"{what} did not finish on rank(s) {still} within {timeout_s:.0f} s "
                "(raise --ray_timeout_s if the work is just slow)"
            )
        done, pending = ray.wait(pending, num_returns=1, timeout=min(left, poll_s))
        for ref in done:
            i = index[ref]
            role, rank, method, host = where[i]
            try:
                results[i] = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, addresses.AddressError):  # one line that says what to set: no traceback
                    raise e.cause from None
                raise RankError(role, rank, method, str(e), host=host) from None
            except ray.exceptions.RayActorError as e:
                raise RankError(role, rank, method, f"the rank actor died: {e}", died=True, host=host) from None
    return results


class Calls:
    """The call API of every model group: ActorGroup here, and the groups a platform's tuning builds on its rank
    actors (distributed/tuning.py). A method is named by reference and checked against the group's worker class
    (`role`, `worker_cls`, `world_size`); `_submit` starts it on the given ranks."""

    role: str
    worker_cls: type
    world_size: int

    def _submit(self, name: str, ranks: list[int], args: list[tuple], kwargs: dict) -> GroupCall:
        raise NotImplementedError

    def call(self, fn: Callable, *args, **kwargs) -> GroupCall:
        """Call `fn` on every rank with the same arguments; .get() gives the results in rank order."""
        name = method_name(self.role, self.worker_cls, fn)
        return self._submit(name, list(range(self.world_size)), [args] * self.world_size, kwargs)

    def call_rank(self, rank: int, fn: Callable, *args, **kwargs) -> GroupCall:
        return self._submit(method_name(self.role, self.worker_cls, fn), [rank], [args], kwargs)

    def dead(self, timeout_s: float = 10.0) -> dict[int, Exception]:
        """{rank: its error} of the ranks whose process is gone: died, or hung (a health check; a rank busy with a
        long call, or stuck in a collective with a dead peer, still answers: pid() has a thread of its own)."""
        actors = getattr(self, "actors", [])
        call = GroupCall(self.role, "pid", [a.pid.remote() for a in actors], list(range(len(actors))), timeout_s)
        return health_check(call, timeout_s)

    def call_sharded(self, fn: Callable, batch: Any, *args, **kwargs) -> GroupCall:
        """Split `batch` (a types.py dataclass with .split, or a list) over the ranks in contiguous chunks;
        .get_cat() gives per-rank tensors concatenated in batch order, .get() the per-rank results."""
        name = method_name(self.role, self.worker_cls, fn)
        chunks = shard(batch, self.world_size)
        out = self._submit(name, list(range(self.world_size)), [(c, *args) for c in chunks], kwargs)
        out.n_out = len(batch)
        return out


class ActorGroup(Calls):
    """N rank actors of one role (actor, critic, ref, reward) running `worker_cls(cfg)` each.

    `actor_cls`: the rank actors' Ray class (RankActor's remote methods), `concurrency` the calls each runs at
    once: both as the platform's tuning asks (distributed/tuning.py). `hang_s`: a rank whose process gives no answer
    to health checks this long during a call is hung (distributed/heartbeat.py)."""

    def __init__(
        self,
        role: str,
        worker_cls: type,
        cfg: Any,
        slots: Sequence[RankBundle],
        *,
        device: str,
        gpus_per_node: int = 1,
        timeout_s: float = 600.0,
        env: Optional[dict[str, str]] = None,
        actor_cls: Any = RankActor,
        concurrency: int = 2,
        hang_s: Optional[float] = None,
    ):
        self.role, self.world_size, self.timeout_s, self.worker_cls = role, len(slots), timeout_s, worker_cls
        self.hang_s = hang_s  # --hang_timeout_s: calls health-check their ranks (heartbeat.py); None: not
        check_exports(role, worker_cls)  # before any process starts
        base_env = {"DS_ACCELERATOR": device, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        if LOG_DIR_ENV in os.environ:  # ranks write their output to <save_path>/logs (storage/logs.py)
            base_env.setdefault(LOG_DIR_ENV, os.environ[LOG_DIR_ENV])
        self.actors = [
            self._spawn(actor_cls, concurrency, rank, slot, device, base_env) for rank, slot in enumerate(slots)
        ]
        # Rendezvous on rank 0's node. On CUDA each rank sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES),
        # so LOCAL_RANK is 0 there; on CPU it is the rank's index within its node group.
        master_addr, master_port = wait_all([self.actors[0].address.remote()], [0], role, "address", timeout_s)[0]
        setups = []
        for rank, actor in enumerate(self.actors):
            rank_env = {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": "0" if device == "cuda" else str(rank % max(gpus_per_node, 1)),
            }
            setups.append(actor.setup.remote(worker_cls, cfg, rank_env))
        wait_all(setups, list(range(self.world_size)), role, "setup", timeout_s)
        log.info("%s: %d rank(s), pids %s", role, self.world_size, self.pids())

    def _spawn(self, actor_cls: Any, concurrency: int, rank: int, slot: RankBundle, device: str, env: dict[str, str]):
        if slot.placement_group is not None:
            opts = scheduling_options(slot, device)
        else:  # no placement group (tests, ad-hoc use): Ray picks a node
            opts = {"num_cpus": slot.share, "num_gpus": slot.share if device == "cuda" else 0}
        return actor_cls.options(**opts, max_restarts=0, max_concurrency=concurrency).remote(self.role, rank, env)

    # ---- calls (method references, orlhf/distributed/endpoints.py) --------------------------------------------------
    def _submit(self, name: str, ranks: list[int], args: list[tuple], kwargs: dict) -> GroupCall:
        """Start `name` on `ranks` (args[i] for ranks[i])."""
        refs = [self.actors[r].call.remote(name, *a, **kwargs) for r, a in zip(ranks, args)]
        actors = [self.actors[r] for r in ranks]
        return GroupCall(self.role, name, refs, ranks, self.timeout_s, actors=actors, hang_s=self.hang_s)

    def pids(self) -> list[int]:
        ranks = list(range(self.world_size))
        return wait_all([a.pid.remote() for a in self.actors], ranks, self.role, "pid", self.timeout_s)

    def shutdown(self) -> None:
        """Kill the rank actors."""
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []


def spawn_groups(roles: list[str], spawn: Callable[[str], Any], stack: ExitStack) -> dict:
    """{role: spawn(role)} built in parallel threads (each group waits on its ranks' process start and imports);
    every group built is shut down when `stack` closes, also when another one failed (its error is raised after
    all have finished)."""
    with ThreadPoolExecutor(max_workers=len(roles), thread_name_prefix="orlhf-spawn") as pool:
        futures = {role: pool.submit(spawn, role) for role in roles}
    groups, errors = {}, []
    for role, future in futures.items():
        if future.exception() is not None:
            errors.append(future.exception())
            continue
        groups[role] = future.result()
        stack.callback(groups[role].shutdown)
    if errors:
        raise errors[0]
    return groups


def shard(batch: Any, world_size: int) -> list:
    """Contiguous, equal-size chunks; the batch is padded by repeating its last row to a multiple of world_size."""
    n = len(batch)
    if n == 0:
        raise ValueError("cannot shard an empty batch")
    per = -(-n // world_size)
    pad = per * world_size - n
    if isinstance(batch, list):
        padded = batch + [batch[-1]] * pad
        return [padded[i * per : (i + 1) * per] for i in range(world_size)]
    if pad:
        batch = type(batch).cat([batch] + [batch.split([n - 1, 1])[1]] * pad)
    return batch.split([per] * world_size)
