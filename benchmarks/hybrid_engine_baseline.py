"""A DeepSpeed-Chat-style PPO trainer (the "hybrid engine" design), built from orlhf's parts, as a baseline.

DeepSpeed-Chat runs every model on every GPU: `deepspeed --num_gpus N` starts N identical processes, each holding
the actor, critic, reference and reward engines, and each step runs strictly one phase after the other:

    every rank (SPMD, no driver):  the same prompts loader, the same step
      generate         actor: HF generate inside its ZeRO-3 engine on this rank's share of the prompts
                       (GatheredParameters over the whole model; or DeepSpeed's hybrid engine on GPUs)
                       -> all ranks exchange rollouts -> one global batch (orlhf's rollouts_to_batch)
      score            this rank's share, one model after the other: actor old log-probs, ref log-probs,
                       critic values, reward (the RM engine, or the reward function) -> all-gathered
      make_experience  every rank: the same KL-shaped rewards, advantages, returns (orlhf.experience)
      train_actor      PPO on this rank's share of the shuffled experience (orlhf's PolicyWorker.train_step)
      train_critic     then the critic on the same share (orlhf's CriticWorker.train_step)
      (no weight sync: the actor that trains is the one that generates)

What is orlhf's and what is not: the model workers (DeepSpeed configs, losses, micro-batching), the PPO math
(orlhf.algo via orlhf.experience), prompts (orlhf.data), rewards (orlhf.rewards), the flags and their validation
(orlhf train-ppo's, with the demo preset) are shared, so the same flags give the same models, data, batch sizes,
generation lengths, sampling and learning rates. What differs is the system: one process per device holding
every model, HF generate instead of vLLM, sequential phases instead of parallel groups. The only new orlhf code is
orlhf/workers/hybrid.py (PolicyWorker + generate()).

Why torch.multiprocessing and not Ray actors: DeepSpeed-Chat is SPMD from the `deepspeed` launcher, with no
controller process; spawned ranks that each run the loop are that design, while Ray would add the driver and
remote calls this baseline exists to leave out (and Ray is not installable on the lent GPU machines).
--world_size 1 runs in this process, as DeepSpeed-Chat does on one GPU.

CPU (this machine; ~30 s for the demo's 8 steps):
    .venv/bin/python benchmarks/hybrid_engine_baseline.py --max_samples 512 --save_path /tmp/hybrid
    .venv/bin/python benchmarks/hybrid_engine_baseline.py --world_size 2 --threads 1   # two ranks, one core each
GPU node (N GPUs; all four models on every GPU; DeepSpeed-Chat's memory options):
    python benchmarks/hybrid_engine_baseline.py --device cuda --world_size 8 --pretrain MODEL \\
        --reward_pretrain RM --prompt_data prompts.jsonl --input_key prompt --bf16 --adam_offload \\
        --ref_reward_offload --hybrid_engine --generate_max_len 512 --rollout_batch_size 512
Every `orlhf train-ppo` flag is accepted (placement and vLLM flags are ignored: every model is on every rank);
the options of this script are listed under "Hybrid engine" in --help.
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
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import typer  # noqa: E402

from orlhf import cli  # noqa: E402
from orlhf import config as C  # noqa: E402
from orlhf.worker_config import WorkerConfig, worker_config  # noqa: E402

log = logging.getLogger("hybrid")


@dataclasses.dataclass(frozen=True)
class HybridOptions:
    world_size: int = 1  # ranks (GPUs), each holding every model
    gather: str = "whole"  # how generate sees the ZeRO-3 parameters: whole | per_layer (orlhf/workers/hybrid.py)
    hybrid_engine: bool = False  # DeepSpeed's DeepSpeedHybridEngine for generation (CUDA only)
    threads: Optional[int] = None  # torch threads per rank on CPU (default: cores / world_size)


# ---- one rank: all models, the sequential step -----------------------------------------------------------------


class HybridTrainer:
    """Every model of one rank and the PPO step, phases strictly in sequence. All ranks run the same calls."""

    def __init__(self, cfg: C.TrainConfig, opts: HybridOptions, rank: int, world: int):
        from orlhf.algo.kl import make_kl_controller
        from orlhf.algo.rewards import RunningMoments
        from orlhf.data import PromptLoader, build_prompts, load_prompt_rows, load_tokenizer
        from orlhf.experience import ExperienceConfig
        from orlhf.rewards import make_reward_source
        from orlhf.workers import CriticWorker, ReferenceWorker, RewardWorker
        from orlhf.workers.hybrid import HybridPolicyWorker
        from orlhf.workers.value_head import reward_normalization

        self.cfg, self.rank, self.world = cfg, rank, world
        d, p = cfg.data, cfg.ppo
        self.tok = load_tokenizer(d.pretrain)
        rows = load_prompt_rows(d.prompt_data, d.input_key, d.label_key, d.max_samples)
        prompts, stats = build_prompts(rows, self.tok, d.input_key, d.label_key, d.apply_chat_template,
                                       d.input_template, p.prompt_max_len, d.prompt_overflow)
        if rank == 0:
            log.info("%s", stats.summary())
        self.loader = PromptLoader(prompts, p.rollout_batch_size, p.num_episodes, p.seed)  # same order on all ranks
        samples = p.rollout_batch_size * p.n_samples_per_prompt
        opt_steps = self.loader.total_steps * p.max_epochs * (samples // p.train_batch_size)

        def wc(role: str) -> WorkerConfig:  # the role's slice of the config, as orlhf's groups get it
            return worker_config(cfg, role, opt_steps)

        self.actor = HybridPolicyWorker(wc("actor"), gather=opts.gather, hybrid_engine=opts.hybrid_engine,
                                        max_out_tokens=p.prompt_max_len + p.generate_max_len)
        self.ref = ReferenceWorker(wc("ref"))
        self.critic = CriticWorker(wc("critic")) if cfg.has_critic else None
        self.reward = RewardWorker(wc("reward")) if cfg.has_reward_model else None
        self.reward_fn = make_reward_source(d.remote_rm_url) if d.remote_rm_url else None
        self.exp_cfg = ExperienceConfig.from_ppo(p)
        self.kl_ctl = make_kl_controller(p.init_kl_coef, p.kl_target, p.kl_horizon)
        norm = reward_normalization(p.normalize_reward, d.reward_pretrain)  # as orlhf's controller decides
        self.reward_norm = RunningMoments() if norm == "running" else None
        self.step_index, self.timings, self.train_split = 0, {}, {}

    def models(self) -> list:
        return [m for m in (self.actor, self.ref, self.critic, self.reward) if m is not None]

    def init(self) -> None:
        for m in self.models():  # the same order on every rank: ZeRO-3 loading is collective
            m.init()

    def step(self, prompts: list) -> dict[str, Any]:
        from orlhf.experience import rollouts_to_batch

        self.timings, self.train_split = {}, {"actor": 0.0, "critic": 0.0}
        t0 = time.perf_counter()
        with self.timed("generate"):
            rollouts = self.generate(prompts)
        batch, engine_lp = rollouts_to_batch(rollouts, self.tok.pad_token_id)
        with self.timed("score"):
            scores, old_lp, ref_lp, values = self.score(batch, rollouts, prompts)
        with self.timed("make_experience"):
            exp, info = self.make_experience(batch, scores, old_lp, ref_lp, values)
        actor_stats, critic_stats = self.train(exp)  # timed inside: "train" = actor then critic
        self.step_index += 1
        seconds = time.perf_counter() - t0
        gap = ((engine_lp - old_lp).abs() * batch.action_mask).sum().item() / max(1, int(batch.action_mask.sum()))
        row = {**info, "policy_loss": actor_stats["loss"], "actor_lr": actor_stats["lr"],
               "clip_frac": actor_stats["clip_frac"], "approx_kl": actor_stats["approx_kl"],
               "kl_coef": self.kl_ctl.value, "weight_version": self.step_index, "engine_logprob_gap": gap,
               "samples": len(rollouts), "samples_per_s": len(rollouts) / seconds, "step_s": seconds,
               "train_actor_s": self.train_split["actor"], "train_critic_s": self.train_split["critic"],
               **{f"timing/{k}": v for k, v in self.timings.items()}}
        if critic_stats is not None:
            row.update(value_loss=critic_stats["loss"], critic_lr=critic_stats["lr"],
                       value_clip_frac=critic_stats["clip_frac"])
        return row

    # ---- phases ----

    def generate(self, prompts: list) -> list:
        from orlhf.workers.hybrid import GenerateSpec

        p, k = self.cfg.ppo, len(prompts) // self.world
        spec = GenerateSpec(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.generate_max_len,
                            n=p.n_samples_per_prompt, seed=p.seed * 1_000_003 + self.step_index)
        mine = [(i, prompts[i].ids) for i in range(self.rank * k, (self.rank + 1) * k)]
        local = self.actor.generate(mine, spec, self.tok.pad_token_id, self.tok.eos_token_id)
        return [r for part in self.all_gather_objects(local) for r in part]  # rank order = prompt order

    def score(self, batch, rollouts: list, prompts: list):
        """This rank's contiguous share through each model in turn; the results all-gathered in batch order."""
        share = len(batch) // self.world
        lo, hi = self.rank * share, (self.rank + 1) * share
        local = batch.split([lo, share, len(batch) - hi])[1]
        old_lp = self.actor.log_probs(local)
        ref_lp = self.ref.log_probs(local)
        values = self.critic.values(local) if self.critic else None
        if self.reward is not None:
            scores = self.reward.scores(local)
        else:
            mine = rollouts[lo:hi]
            texts = self.tok.batch_decode([r.prompt_ids + r.response_ids for r in mine], skip_special_tokens=True)
            scores = self.reward_fn.score(texts, [prompts[r.prompt_index].text for r in mine],
                                          [prompts[r.prompt_index].label for r in mine]).float()
        scores, old_lp, ref_lp = (self.all_gather_cat(t) for t in (scores, old_lp, ref_lp))
        values = self.all_gather_cat(values) if values is not None else None
        if self.reward_norm is not None:
            self.reward_norm.update(scores)
        return scores, old_lp, ref_lp, values

    def make_experience(self, batch, scores, old_lp, ref_lp, values):
        """As orlhf's Controller.make_experience: every rank computes the same global experience."""
        from orlhf.experience import make_experience

        shaped = self.reward_norm.normalize(scores) if self.reward_norm is not None else scores
        exp, info = make_experience(batch, shaped, old_lp, ref_lp, values, self.kl_ctl.value, self.exp_cfg,
                                    weight_version=self.step_index)
        info["reward_mean"] = scores.mean().item()
        self.kl_ctl.update(info["kl"], len(scores))
        return exp, info

    def train(self, exp) -> tuple[dict, Optional[dict]]:
        """max_epochs passes, the controller's shuffle; the actor trains, then the critic (not in parallel)."""
        import torch

        p, share = self.cfg.ppo, len(exp) // self.world
        actor_stats, critic_stats = [], []
        for epoch in range(p.max_epochs):
            g = torch.Generator().manual_seed(p.seed + 7919 * self.step_index + epoch)
            shuffled = exp.index(torch.randperm(len(exp), generator=g))
            local = shuffled.split([share] * self.world)[self.rank]
            with self.timed("train"):
                t0 = time.perf_counter()
                actor_stats += self.all_gather_objects(self.actor.train_step(local))
                self.train_split["actor"] += time.perf_counter() - t0
                if self.critic is not None:
                    t0 = time.perf_counter()
                    critic_stats += self.all_gather_objects(self.critic.train_step(local))
                    self.train_split["critic"] += time.perf_counter() - t0
        return mean_stats(actor_stats), mean_stats(critic_stats) if critic_stats else None

    # ---- helpers ----

    def all_gather_objects(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def all_gather_cat(self, t):
        """Equal-shaped per-rank tensors -> one tensor in rank order (results travel on the device backend)."""
        if self.world == 1:
            return t
        import torch
        import torch.distributed as dist

        local = t.to(self.actor.device)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts).cpu()

    @contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - t0


def mean_stats(stats: list) -> dict[str, float]:
    keys = ("loss", "lr", "clip_frac", "approx_kl")
    return {k: sum(float(getattr(s, k)) for s in stats) / len(stats) for k in keys}


# ---- launch ----------------------------------------------------------------------------------------------------


def run_rank(rank: int, world: int, cfg: C.TrainConfig, opts: HybridOptions, port: int) -> None:
    """One rank: env for torch.distributed, all models, the loop; rank 0 logs metrics.jsonl and reward.png."""
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), DS_ACCELERATOR=cfg.runtime.device)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="[hybrid] %(message)s")
    # DeepSpeed calls all_gather_into_tensor / reduce_scatter_tensor on every ZeRO-3 step: one warning each.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if cfg.runtime.device == "cpu":
        torch.set_num_threads(opts.threads or max(1, (os.cpu_count() or 1) // world))
    trainer = HybridTrainer(cfg, opts, rank, world)
    t0 = time.monotonic()
    trainer.init()
    if rank == 0:
        log.info("%d models on each of %d rank(s) ready in %.1f s (%d torch threads per rank)",
                 len(trainer.models()), world, time.monotonic() - t0, torch.get_num_threads())
    history = fit(trainer, cfg)
    if rank == 0:
        from orlhf.entry import summarize

        summarize(history)
        print(json.dumps(summary(history, cfg, opts)), flush=True)


def summary(history: list[dict], cfg: C.TrainConfig, opts: HybridOptions) -> dict:
    """The final JSON line: throughput and time per phase over all steps, reward per step."""
    seconds = sum(r["step_s"] for r in history) or 1.0
    phases = sorted({k for r in history for k in r if k.startswith("timing/")})
    return {"benchmark": "hybrid_engine_baseline", "device": cfg.runtime.device, "world_size": opts.world_size,
            "gather": "hybrid_engine" if opts.hybrid_engine else opts.gather, "steps": len(history),
            "samples_per_s": sum(r["samples"] for r in history) / seconds,
            "seconds_per_step": {k[7:]: sum(r.get(k, 0.0) for r in history) / max(1, len(history)) for k in phases},
            "reward_per_step": [round(r["reward_mean"], 4) for r in history]}


def fit(trainer: HybridTrainer, cfg: C.TrainConfig) -> list[dict]:
    from orlhf.metrics import MetricsLogger

    metrics = MetricsLogger(cfg.logging.save_path) if trainer.rank == 0 else None
    history = []
    try:
        for prompts in trainer.loader:
            row = trainer.step(prompts)
            history.append(row)
            if metrics is not None:
                metrics.log(trainer.step_index, row)
                log.info("step %d/%d reward %.4f kl %.5f policy_loss %.4f %.1f samples/s (%s)", trainer.step_index,
                         trainer.loader.total_steps, row["reward_mean"], row["kl"], row["policy_loss"],
                         row["samples_per_s"], " ".join(f"{k[7:]} {v:.2f}s" for k, v in row.items()
                                                        if k.startswith("timing/")))
    finally:
        if metrics is not None:
            metrics.close()
    return history


def resolve(cfg: C.TrainConfig, opts: HybridOptions) -> C.TrainConfig:
    """Every role on all `world_size` ranks, then finished as orlhf does (device, validation, the demo's paths)."""
    from orlhf.finish import finish
    from orlhf.roles import ROLES

    w = opts.world_size
    if w < 1:
        raise C.ConfigError([f"--world_size must be >= 1 (got {w})"])
    placement = C.PlacementConfig(**{f"{r}_num_gpus_per_node": w for r in ROLES})
    cfg = finish(dataclasses.replace(cfg, placement=placement))
    p, problems = cfg.ppo, []
    if p.rollout_batch_size % w:
        problems.append(f"--rollout_batch_size {p.rollout_batch_size} must be a multiple of --world_size {w} "
                        "(each rank generates an equal share of the prompts)")
    if opts.hybrid_engine and cfg.runtime.device != "cuda":
        problems.append("--hybrid_engine uses DeepSpeed's inference kernels, which need CUDA (on CPU: 'This op had "
                        "not been implemented on CPU backend'); drop it on --device cpu")
    if problems:
        raise C.ConfigError(problems)
    return cfg


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


# ---- command line: orlhf train-ppo's flags (generated from config.py) plus the options above ---------------------

PANEL = "Hybrid engine (this baseline)"
OPTIONS = {
    "world_size": (int, typer.Option(1, "--world_size", rich_help_panel=PANEL,
                                     help="Ranks (GPUs on CUDA), each holding every model.")),
    "gather": (Literal["whole", "per_layer"], typer.Option("whole", "--gather", rich_help_panel=PANEL,
                                 help="How generate sees the ZeRO-3 weights: whole (GatheredParameters over the "
                                      "model, as the hybrid engine) or per_layer (ZeRO-3 fetches per forward).")),
    "hybrid_engine": (bool, typer.Option(False, "--hybrid_engine", rich_help_panel=PANEL,
                                         help="Generate with DeepSpeed's hybrid engine (CUDA only).")),
    "threads": (Optional[int], typer.Option(None, "--threads", rich_help_panel=PANEL,
                                            help="CPU: torch threads per rank (default: cores / world size).")),
}


def _baseline(ctx: typer.Context, **flags: Any) -> None:
    cfg = cli.parse_or_exit(ctx, flags)
    opts = HybridOptions(**{k: flags[k] for k in OPTIONS})
    sys.exit(run_reporting_errors(cfg, opts))


def run_reporting_errors(cfg: C.TrainConfig, opts: HybridOptions) -> int:
    """As orlhf's cli.run_reporting_errors, without its Ray-side errors (so no Ray import: GPU boxes lack it)."""
    from orlhf.data import DataError
    from orlhf.rewards import RewardError

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
_baseline.__signature__ = _baseline.__signature__.replace(parameters=[  # type: ignore[attr-defined]
    *_baseline.__signature__.parameters.values(),  # type: ignore[attr-defined]
    *(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=typ)
      for name, (typ, option) in OPTIONS.items()),
])
_baseline.__annotations__.update({n: t for n, (t, _) in OPTIONS.items()})


def main(argv: Optional[list[str]] = None) -> None:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False,
                      context_settings={"help_option_names": ["-h", "--help"]})
    app.command(help=__doc__.split("\n")[0], context_settings={"token_normalize_func": cli._normalize_flag})(_baseline)
    app(args=cli.fill_optional_values(list(sys.argv[1:] if argv is None else argv)),
        prog_name="hybrid_engine_baseline.py")


if __name__ == "__main__":
    main()
