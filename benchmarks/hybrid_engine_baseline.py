"""A DeepSpeed-Chat-style PPO trainer (the "hybrid engine" design), built from orlhf's parts, as a baseline.

DeepSpeed-Chat runs every model on every GPU: `deepspeed --num_gpus N` starts N identical processes, each holding
the actor, critic, reference and reward engines, and each step runs strictly one phase after the other:

    every rank (SPMD, no driver): the same prompts loader, the same step: orlhf's Controller, unchanged,
    driving groups that are this rank's own workers (LocalGroup) instead of Ray rank actors
      generate         actor: HF generate inside its ZeRO-3 engine on this rank's share of the prompts
                       (hybrid_worker.py: GatheredParameters over the whole model; or DeepSpeed's hybrid engine on
                       GPUs) -> all ranks exchange rollouts -> one global batch
      score            this rank's share, one model after the other (each call runs when the controller makes
                       it): actor old log-probs, ref log-probs, critic values, reward model -> all-gathered when
                       the controller collects them; a reward function scores the whole batch on every rank
      make_experience  every rank: the same KL-shaped rewards, advantages, returns (the controller's)
      train            PPO on this rank's share of the controller's shuffled experience: actor, then critic
      (no weight sync: the actor that trains is the one that generates; only the version tag moves)

What is orlhf's and what is not: the loop and its phases (orlhf.trainer.controller.Controller: sampling seeds, scoring
and its skips, experience, shuffles, metrics), the model workers (DeepSpeed configs, losses, micro-batching), the PPO
math (orlhf.algo via orlhf.trainer.experience), prompts (orlhf.launch.run_inputs.load_prompts), rewards, the flags and
their validation (orlhf train-ppo's, with the demo preset) are shared, so the same flags give the same models, data,
batch sizes, generation lengths, sampling and learning rates. What differs is the system: one process per device holding
every model, HF generate instead of vLLM, sequential phases instead of parallel groups. The code of its own is this file
(the SPMD groups, launch, command line) and hybrid_worker.py (PolicyWorker + generate()).

Why torch.multiprocessing and not Ray actors: DeepSpeed-Chat is SPMD from the `deepspeed` launcher, with no
controller process; spawned ranks that each run the loop are that design, while Ray would add the driver and
remote calls this baseline exists to leave out (and Ray is not installable on the lent GPU machines: nothing
here imports it). --world_size 1 runs in this process, as DeepSpeed-Chat does on one GPU.

CPU (this machine; ~30 s for the demo's 8 steps):
    .venv/bin/python benchmarks/hybrid_engine_baseline.py --max_samples 512 --save_path /tmp/hybrid
    .venv/bin/python benchmarks/hybrid_engine_baseline.py --world_size 2 --threads 1   # two ranks, one core each
Beside orlhf and TRL at the same work, on any model and data (trl_compare.py's hybrid mode gives it the sync orlhf
mode's flags; --model_preset smollm2: SmolLM2-135M-Instruct, its addition task in the chat template, as `orlhf
make-demo --real` writes them):
    .venv/bin/python benchmarks/trl_compare.py --model_preset smollm2 --modes orlhf,trl,hybrid ...
GPU node (N GPUs; all four models on every GPU; DeepSpeed-Chat's memory options):
    python benchmarks/hybrid_engine_baseline.py --device cuda --world_size 8 --pretrain MODEL \\
        --reward_pretrain RM --prompt_data prompts.jsonl --input_key prompt --bf16 --adam_offload \\
        --ref_reward_offload --hybrid_engine --generate_max_len 512 --rollout_batch_size 512
Every `orlhf train-ppo` flag is accepted (placement and vLLM flags are ignored: every model is on every rank;
so are checkpoint and evaluation flags); --async_train and --agent_func_path are refused (they need engines
apart from the trainers). The options of this script are listed under "Hybrid engine" in --help.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Optional

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer  # noqa: E402

from orlhf import cli  # noqa: E402
from orlhf.config import train_config as C  # noqa: E402
from orlhf.config.worker_config import worker_config  # noqa: E402
from orlhf.distributed.endpoints import method_name  # noqa: E402
from orlhf.rollout.backend import RolloutBackend  # noqa: E402
from orlhf.trainer.controller import Controller  # noqa: E402
from orlhf.trainer.models import Models  # noqa: E402

log = logging.getLogger("hybrid")


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    world_size: int = 1  # ranks (GPUs), each holding every model
    gather: str = "whole"  # how generate sees the ZeRO-3 parameters: whole | per_layer (hybrid_worker.py)
    hybrid_engine: bool = False  # DeepSpeed's DeepSpeedHybridEngine for generation (CUDA only)
    threads: Optional[int] = None  # torch threads per rank on CPU (default: cores / world_size)


# ---- SPMD stand-ins for the Ray groups the controller drives ----------------------------------------------------


class Ranks:
    """This rank and the collectives that turn per-rank results into the controller's whole-batch results."""

    def __init__(self, rank: int, world: int, device):
        self.rank, self.world, self.device = rank, world, device

    def share(self, batch):
        """This rank's contiguous, equal share of a batch (a types.py dataclass with .split, or a list)."""
        if len(batch) % self.world:
            raise ValueError(f"a batch of {len(batch)} does not split evenly over {self.world} ranks")
        k = len(batch) // self.world
        if isinstance(batch, list):
            return batch[self.rank * k : (self.rank + 1) * k]
        return batch.split([k] * self.world)[self.rank]

    def gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def gather_cat(self, t):
        """Equal-shaped per-rank tensors -> one tensor in rank order (results travel on the device backend)."""
        if self.world == 1:
            return t
        import torch
        import torch.distributed as dist

        local = t.to(self.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts).cpu()


class LocalCall:
    """A finished call on this rank; like distributed.groups.GroupCall, .get() / .get_cat() give every rank's
    results."""

    def __init__(self, ranks: Ranks, result):
        self.ranks, self.result = ranks, result

    def get(self, timeout_s: Optional[float] = None) -> list:
        return self.ranks.gather_objects(self.result)

    def get_cat(self, timeout_s: Optional[float] = None):
        return self.ranks.gather_cat(self.result)


class LocalGroup:
    """One role's worker on this rank, answering the calls the controller makes of a distributed.groups.ActorGroup.
    A call runs at once, on this rank's share; every rank makes the same calls in the same order (the controller's), so
    ZeRO-3's collectives inside the workers and the gathers in .get() line up."""

    def __init__(self, role: str, worker, ranks: Ranks):
        self.role, self.worker, self.ranks = role, worker, ranks
        self.seconds: dict[str, float] = {}  # per method, since the last reset (the step's train split)

    @property
    def world_size(self) -> int:
        return self.ranks.world

    def _run(self, fn: Callable, *args, **kwargs):
        name = method_name(self.role, type(self.worker), fn)  # the check ActorGroup makes: an @endpoint of it
        t0 = time.perf_counter()
        result = getattr(self.worker, name)(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
        return result

    def call_sharded(self, fn: Callable, batch, *args, **kwargs) -> LocalCall:
        return LocalCall(self.ranks, self._run(fn, self.ranks.share(batch), *args, **kwargs))

    def call(self, fn: Callable, *args, **kwargs) -> LocalCall:
        return LocalCall(self.ranks, self._run(fn, *args, **kwargs))


class HybridGenerator(RolloutBackend):
    """The controller's rollout backend (orlhf/rollout/backend.py): the trained actor generates this rank's share of
    the prompts (HF generate in its own engine), and the ranks exchange rollouts, so every rank holds the whole batch
    in prompt order. Built by hand on each SPMD rank, never by a run's start-up; agents' turns and the rest are the
    contract's defaults."""

    kind = "hybrid"

    def __init__(self, actor, ranks: Ranks, pad_id: int, eos_id: int):
        self.actor, self.ranks, self.pad_id, self.eos_id = actor, ranks, pad_id, eos_id
        self.weight_version = 0  # the actor's: moved by load_weights after each train step

    def load_weights(self, version: int) -> float:
        """Nothing to send: the actor that trains is the one that generates; the version tag moves, so rollouts
        carry the version they were sampled with."""
        self.weight_version = version
        return 0.0

    def generate(self, prompts: list[list[int]], sampling, images=None) -> list:
        mine = self.ranks.share(list(enumerate(prompts)))
        local = self.actor.generate(mine, sampling, self.pad_id, self.eos_id)
        for r in local:
            r.weight_version = self.weight_version
        return [r for part in self.ranks.gather_objects(local) for r in part]  # rank order = prompt order


class NoMetrics:
    """Ranks other than 0 log nothing (rank 0's MetricsLogger writes metrics.jsonl)."""

    def log(self, step: int, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


class HybridController(Controller):
    """orlhf's Controller, with the step's train time split by role (the phases run one after the other here)
    and one log line per step; no `timing/sync` (nothing is synced)."""

    def learn(self, prompts: list, rollouts: list, reward=None) -> dict[str, Any]:
        for g in self.m.groups():
            g.seconds.clear()
        row = super().learn(prompts, rollouts, reward)
        row.pop("timing/sync", None)
        row["train_actor_s"] = self.m.actor.seconds.get("train_step", 0.0)
        row["train_critic_s"] = self.m.critic.seconds.get("train_step", 0.0) if self.m.critic else 0.0
        log.info(
            "step %d/%d reward %.4f kl %.5f policy_loss %.4f %.1f samples/s (%s)",
            self.step_index,
            self.loader.total_steps,
            row["reward_mean"],
            row["kl"],
            row["policy_loss"],
            row["samples_per_s"],
            " ".join(f"{k[7:]} {v:.2f}s" for k, v in row.items() if k.startswith("timing/")),
        )
        return row


# ---- one rank: all models, the controller's loop -----------------------------------------------------------------


def build(cfg: C.TrainConfig, opts: HybridOptions, rank: int, world: int) -> HybridController:
    """Every model of this rank (orlhf's workers; the roles orlhf would start), wrapped for the controller."""
    from hybrid_worker import HybridPolicyWorker

    from orlhf.inputs.prompt_loader import PromptLoader
    from orlhf.inputs.tokenizer import load_tokenizer
    from orlhf.launch.run_inputs import load_prompts, make_reward
    from orlhf.storage.metrics import MetricsLogger
    from orlhf.workers import CriticWorker, ReferenceWorker, RewardWorker

    d, p = cfg.data, cfg.ppo
    tok = load_tokenizer(d.pretrain)
    loader = PromptLoader(load_prompts(cfg, tok), p.rollout_batch_size, p.num_episodes, p.seed)  # same on all ranks
    samples = p.rollout_batch_size * p.n_samples_per_prompt
    opt_steps = loader.total_steps * p.max_epochs * (samples // p.train_batch_size)

    def wc(role: str):  # the role's slice of the config, as orlhf's groups get it
        return worker_config(cfg, role, opt_steps)

    actor = HybridPolicyWorker(
        wc("actor"),
        gather=opts.gather,
        hybrid_engine=opts.hybrid_engine,
        max_out_tokens=p.prompt_max_len + p.generate_max_len,
    )
    ranks = Ranks(rank, world, actor.device)
    workers = {
        "actor": actor,
        "ref": ReferenceWorker(wc("ref")) if cfg.has_reference else None,
        "critic": CriticWorker(wc("critic")) if cfg.has_critic else None,
        "reward": RewardWorker(wc("reward")) if cfg.has_reward_model else None,
    }
    groups = {role: LocalGroup(role, w, ranks) if w is not None else None for role, w in workers.items()}
    models = Models(
        actor=groups["actor"],
        ref=groups["ref"],
        rollout=HybridGenerator(actor, ranks, tok.pad_token_id, tok.eos_token_id),
        critic=groups["critic"],
        reward=groups["reward"],
    )
    metrics = MetricsLogger(cfg.logging.save_path) if rank == 0 else NoMetrics()
    return HybridController(cfg, models, loader, tok, metrics, reward_source=make_reward(cfg))


def run_rank(rank: int, world: int, cfg: C.TrainConfig, opts: HybridOptions, port: int) -> None:
    """One rank: env for torch.distributed, all models, the loop; rank 0 logs metrics.jsonl and the summary."""
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR=cfg.runtime.device,
    )
    if rank:
        os.environ["TQDM_DISABLE"] = "1"  # one progress bar (rank 0's)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="[hybrid] %(message)s")
    # DeepSpeed calls all_gather_into_tensor / reduce_scatter_tensor on every ZeRO-3 step: one warning each.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if cfg.runtime.device == "cpu":
        from orlhf.cpu.rank_actor import tune_rank_process

        torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // world))
        tune_rank_process()  # as orlhf's CPU rank processes do
    controller = build(cfg, opts, rank, world)
    t0 = time.monotonic()
    for g in controller.m.groups():  # the same order on every rank: ZeRO-3 loading is collective
        g.worker.init()
    if rank == 0:
        log.info(
            "%d models on each of %d rank(s) ready in %.1f s (%d torch threads per rank)",
            len(controller.m.groups()),
            world,
            time.monotonic() - t0,
            torch.get_num_threads(),
        )
    try:
        history = controller.fit()
    finally:
        controller.metrics.close()
    if rank == 0:
        from orlhf.launch.run import summarize

        summarize(history)
        print(json.dumps(summary(history, cfg, opts)), flush=True)


def summary(history: list[dict], cfg: C.TrainConfig, opts: HybridOptions) -> dict:
    """The final JSON line: throughput and time per phase over all steps, reward per step."""
    seconds = sum(r["step_s"] for r in history) or 1.0
    phases = sorted({k for r in history for k in r if k.startswith("timing/")})
    return {
        "benchmark": "hybrid_engine_baseline",
        "device": cfg.runtime.device,
        "world_size": opts.world_size,
        "gather": "hybrid_engine" if opts.hybrid_engine else opts.gather,
        "steps": len(history),
        "samples_per_s": sum(r["samples"] for r in history) / seconds,
        "seconds_per_step": {k[7:]: sum(r.get(k, 0.0) for r in history) / max(1, len(history)) for k in phases},
        "reward_per_step": [round(r["reward_mean"], 4) for r in history],
    }


def resolve(cfg: C.TrainConfig, opts: HybridOptions) -> C.TrainConfig:
    """Every role on all `world_size` ranks, then finished as orlhf does (device, validation, the demo's paths)."""
    from orlhf.config.resolve import finish
    from orlhf.config.roles import ROLES

    w = opts.world_size
    if w < 1:
        raise C.ConfigError([f"--world_size must be >= 1 (got {w})"])
    placement = C.PlacementConfig(**{f"{r}_num_gpus_per_node": w for r in ROLES})
    cfg = finish(dataclasses.replace(cfg, placement=placement))
    p, problems = cfg.ppo, []
    if p.rollout_batch_size % w:
        problems.append(
            f"--rollout_batch_size {p.rollout_batch_size} must be a multiple of --world_size {w} "
            "(each rank generates an equal share of the prompts)"
        )
    if p.async_train:
        problems.append(
            "--async_train overlaps generation with training on other devices; here the actor that "
            "trains is the one that generates: drop --async_train"
        )
    if cfg.data.agent_func_path:
        problems.append(
            "--agent_func_path needs orlhf's vLLM engines (token-in, token-out turns); this baseline "
            "generates with HF generate: drop --agent_func_path"
        )
    if opts.hybrid_engine and cfg.runtime.device != "cuda":
        problems.append(
            "--hybrid_engine uses DeepSpeed's inference kernels, which need CUDA (on CPU: 'This op had "
            "not been implemented on CPU backend'); drop it on --device cpu"
        )
    elif opts.hybrid_engine and hybrid_engine_blocker():
        problems.append(hybrid_engine_blocker())
    if problems:
        raise C.ConfigError(problems)
    return cfg


def hybrid_engine_blocker() -> str:
    """Why DeepSpeed's hybrid engine cannot run with the installed transformers, or "" when it can."""
    import importlib.metadata

    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) < 5:
        return ""
    return (
        f"--hybrid_engine: DeepSpeed's hybrid engine swaps the decoder layers for inference kernels written for "
        f"transformers 4's layer call; with transformers {version} the first generate fails inside them "
        "(\"'tuple' object has no attribute 'size'\" in ds_transformer.py, DeepSpeed 0.19.8 on an H100). Drop "
        "--hybrid_engine: generation then gathers the whole model for HF generate, as DeepSpeed-Chat does "
        "without its kernels"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: C.TrainConfig, opts: HybridOptions) -> int:
    cfg = resolve(cfg, opts)
    port = free_port()
    if opts.world_size == 1:
        run_rank(0, 1, cfg, opts, port)
    else:
        import torch.multiprocessing as mp

        mp.spawn(run_rank, args=(opts.world_size, cfg, opts, port), nprocs=opts.world_size, join=True)
    return 0


# ---- command line: orlhf train-ppo's flags (generated from config/train_config.py) plus the options above -----------

PANEL = "Hybrid engine (this baseline)"
OPTIONS = {
    "world_size": (
        int,
        typer.Option(1, "--world_size", rich_help_panel=PANEL, help="Ranks (GPUs on CUDA), each holding every model."),
    ),
    "gather": (
        Literal["whole", "per_layer"],
        typer.Option(
            "whole",
            "--gather",
            rich_help_panel=PANEL,
            help="How generate sees the ZeRO-3 weights: whole (GatheredParameters over the "
            "model, as the hybrid engine) or per_layer (ZeRO-3 fetches per forward).",
        ),
    ),
    "hybrid_engine": (
        bool,
        typer.Option(
            False, "--hybrid_engine", rich_help_panel=PANEL, help="Generate with DeepSpeed's hybrid engine (CUDA only)."
        ),
    ),
    "threads": (
        Optional[int],
        typer.Option(
            None, "--threads", rich_help_panel=PANEL, help="CPU: torch threads per rank (default: cores / world size)."
        ),
    ),
}


def _baseline(ctx: typer.Context, **flags: Any) -> None:
    cfg = cli.parse_or_exit(ctx, flags)
    opts = HybridOptions(**{k: flags[k] for k in OPTIONS})
    sys.exit(run_reporting_errors(cfg, opts))


def run_reporting_errors(cfg: C.TrainConfig, opts: HybridOptions) -> int:
    """As orlhf's cli.run_reporting_errors, without its Ray-side errors (so no Ray import: GPU boxes lack it)."""
    from orlhf.inputs.prompts import DataError
    from orlhf.inputs.rewards import RewardError

    try:
        return launch(cfg, opts)
    except C.ConfigError as e:
        typer.secho(f"error: {len(e.problems)} problem(s) with the flags:", fg="red", err=True)
        typer.echo(str(e), err=True)
        return 2
    except (DataError, RewardError) as e:
        typer.secho(f"error: {e}", fg="red", err=True)
        return 1


cli.with_train_flags(_baseline)
_baseline.__signature__ = _baseline.__signature__.replace(
    parameters=[  # type: ignore[attr-defined]
        *_baseline.__signature__.parameters.values(),  # type: ignore[attr-defined]
        *(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=typ)
            for name, (typ, option) in OPTIONS.items()
        ),
    ]
)
_baseline.__annotations__.update({n: t for n, (t, _) in OPTIONS.items()})


def main(argv: Optional[list[str]] = None) -> None:
    app = typer.Typer(
        add_completion=False, pretty_exceptions_enable=False, context_settings={"help_option_names": ["-h", "--help"]}
    )
    app.command(help=__doc__.split("\n")[0], context_settings={"token_normalize_func": cli._normalize_flag})(_baseline)
    app(
        args=cli.fill_optional_values(list(sys.argv[1:] if argv is None else argv)),
        prog_name="hybrid_engine_baseline.py",
    )


if __name__ == "__main__":
    main()
