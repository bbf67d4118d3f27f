"""The PPO loop. One driver process (this one) calls the model groups and engines; no logic lives in them.

    for each step (a batch of --rollout_batch_size prompts):
      generate         engines: prompt ids -> n_samples_per_prompt rollouts each (ids, engine log-probs)
      score            in parallel: actor old log-probs | ref log-probs | critic values | rewards (RM group, or
                       the reward function / HTTP server while the groups work)
      make_experience  driver: KL, group baseline, KL-shaped rewards, advantages and returns (algo/)
      train            actor and critic train_step at the same time (non-blocking calls, gathered after)
      sync_weights     actor -> engines (weight_sync.py); weight_version += 1; before the next generate

Invariants: weights are synced after the optimizer steps of a step and before the next generation, so every
rollout of step k+1 comes from weight_version k+1. Async mode (fit_async) relaxes this: generation runs ahead
by at most --async_queue_size batches, and a sync never overlaps a generation (the producer's lock).
Each phase is timed (`timing/<phase>` seconds in metrics.jsonl).
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch

from orlhf.algo.kl import make_kl_controller
from orlhf.algo.rewards import RunningMoments
from orlhf.cluster import ActorGroup
from orlhf.config import TrainConfig
from orlhf.experience import ExperienceConfig, make_experience, rollouts_to_batch
from orlhf.metrics import MetricsLogger
from orlhf.rollout.engine import EngineGroup, SamplingSpec
from orlhf.sleep import SleepSwitch
from orlhf.types import Experience, Rollout, SequenceBatch, TrainStats
from orlhf.weight_sync import WeightSync

log = logging.getLogger(__name__)


@dataclass
class Models:
    """Everything the controller drives. critic exists with gae only; reward with --reward_pretrain only."""

    actor: ActorGroup
    ref: ActorGroup
    engines: EngineGroup
    sync: WeightSync
    critic: Optional[ActorGroup] = None
    reward: Optional[ActorGroup] = None

    def groups(self) -> list:
        return [g for g in (self.actor, self.ref, self.critic, self.reward) if g is not None]


class Controller:
    def __init__(self, cfg: TrainConfig, models: Models, loader, tokenizer, metrics: MetricsLogger,
                 reward_source=None, checkpoints=None):
        self.cfg, self.m, self.loader, self.tok, self.metrics = cfg, models, loader, tokenizer, metrics
        self.reward_source = reward_source  # function file / HTTP; None when a reward-model group scores
        self.exp_cfg = ExperienceConfig.from_ppo(cfg.ppo)
        p = cfg.ppo
        self.kl_ctl = make_kl_controller(p.init_kl_coef, p.kl_target, p.kl_horizon)
        self.reward_norm = RunningMoments() if p.normalize_reward else None
        self.step_index = 0  # steps done
        self.weight_version = 0  # bumped by every sync; engines tag rollouts with the version they hold
        self.timings: dict[str, float] = {}
        self.history: list[dict] = []
        self.checkpoints = checkpoints  # a checkpoint.CheckpointManager, or None
        self.sleep = SleepSwitch(cfg, models)  # hybrid mode's memory hand-over (no-op unless asked, on GPU)
        self._first_step = 0  # step_index when this invocation started (resume)
        self._sync_lock = threading.Lock()
        self._last_step_end = time.perf_counter()

    # ---- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        """Train over the loader: step by step, or with generation overlapping training (--async_train)."""
        if self.cfg.ppo.async_train:
            return self.fit_async()
        with self.progress() as report:
            for prompts in self.loader:
                if self.should_stop():
                    break
                self.timings = {}
                with self.timed("generate"):
                    self.sleep.before_generate()
                    rollouts = self.generate(prompts, self.step_index)
                    self.sleep.after_generate()
                report(self.learn(prompts, rollouts))
        return self.history

    def fit_async(self) -> list[dict]:
        """Engines generate batch k+1 (and up to --async_queue_size ahead) while the trainers learn on batch k.

        Weight syncs take the producer's lock, so they never race a generation; each rollout keeps the weight
        version it was generated with, and staleness (trainer version - generation version) <= queue size.
        """
        from orlhf.async_rollout import RolloutProducer

        producer = RolloutProducer(self.generate, self.loader, self.cfg.ppo.async_queue_size,
                                   lambda: self.weight_version)
        self._sync_lock = producer.lock
        with producer, self.progress() as report:
            for prompts, rollouts, gen_seconds in producer:
                if self.should_stop():
                    break
                self.timings = {"generate": gen_seconds}
                report(self.learn(prompts, rollouts))
        return self.history

    def learn(self, prompts: list, rollouts: list[Rollout]) -> dict[str, Any]:
        """Everything after generation for one batch: score, make experience, train, sync. Returns metrics."""
        batch, engine_log_probs = rollouts_to_batch(rollouts, self.tok.pad_token_id)
        with self.timed("score"):
            scores, old_lp, ref_lp, values = self.score(batch, rollouts, prompts)
        with self.timed("make_experience"):
            exp, info = self.make_experience(batch, scores, old_lp, ref_lp, values)
        with self.timed("train"):
            actor_stats, critic_stats = self.train(exp)
        gen_version = min(r.weight_version for r in rollouts)
        staleness = self.weight_version - gen_version  # trainer version these rollouts are trained at
        with self.timed("sync"):
            self.sync_weights()
        self.step_index += 1
        now = time.perf_counter()
        seconds, self._last_step_end = now - self._last_step_end, now  # wall time per step, overlap included
        row = {**info, "policy_loss": actor_stats["loss"], "actor_lr": actor_stats["lr"],
               "clip_frac": actor_stats["clip_frac"], "approx_kl": actor_stats["approx_kl"],
               "entropy": actor_stats["entropy"],
               "kl_coef": self.kl_ctl.value, "weight_version": self.weight_version,
               "generation_weight_version": gen_version, "staleness": staleness,
               "engine_logprob_gap": _masked_abs_mean(engine_log_probs - old_lp, batch.action_mask),
               "samples": len(rollouts), "samples_per_s": len(rollouts) / seconds, "step_s": seconds,
               **{f"timing/{k}": v for k, v in self.timings.items()}}
        if critic_stats is not None:
            row.update(value_loss=critic_stats["loss"], critic_lr=critic_stats["lr"],
                       value_clip_frac=critic_stats["clip_frac"])
        return row

    @contextmanager
    def progress(self):
        """A progress bar (step, ETA, reward, samples/s) and per-step logging; yields report(row)."""
        from tqdm import tqdm

        total = self.loader.total_steps
        bar = tqdm(total=total, initial=self.step_index, desc="ppo", unit="step", dynamic_ncols=True)
        self._last_step_end = time.perf_counter()

        def report(row: dict) -> None:
            self.history.append(row)
            if self.step_index % self.cfg.logging.logging_steps == 0 or self.step_index == total:
                self.metrics.log(self.step_index, row)
            if self.checkpoints is not None and self.cfg.logging.save_steps > 0 \
                    and self.step_index % self.cfg.logging.save_steps == 0:
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl']:.4f}",
                            sps=f"{row['samples_per_s']:.1f}")

        try:
            yield report
        finally:
            bar.close()

    # ---- checkpoints (orlhf/checkpoint.py holds the format; this is the call order) ---------------------------
    def should_stop(self) -> bool:
        """--stop_after_steps: end this invocation early, on a step boundary, keeping the full run's schedule."""
        n = self.cfg.runtime.stop_after_steps
        return n is not None and self.step_index - self._first_step >= n

    def save_checkpoint(self) -> None:
        """Every trained group's DeepSpeed state + the controller's, into a temp folder renamed into place."""
        from orlhf.checkpoint import config_fingerprint, rng_state, save_controller_state

        t0 = time.perf_counter()
        mgr, step = self.checkpoints, self.step_index
        tmp = mgr.begin(step)
        trained = [("actor", self.m.actor)] + ([("critic", self.m.critic)] if self.m.critic else [])
        calls = [g.call_all_async("save_checkpoint", str(tmp / role)) for role, g in trained]
        if self.cfg.logging.save_hf_ckpt:
            calls.append(self.m.actor.call_all_async("save_hf", str(tmp / "hf" / "actor")))
        for call in calls:
            call.get()
        spe = self.loader.steps_per_episode  # loader position of the consumed batches (async reads ahead)
        loader_state = {**self.loader.state_dict(), "episode": step // spe, "batch_in_episode": step % spe}
        save_controller_state(tmp, {
            "step_index": step, "weight_version": self.weight_version, "loader": loader_state,
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_norm": self.reward_norm.state_dict() if self.reward_norm else None, "rng": rng_state()})
        path = mgr.commit(tmp, step, {"fingerprint": config_fingerprint(self.cfg),
                                      "roles": {role: g.world_size for role, g in trained}})
        log.info("checkpoint %s (%.1f s)", path, time.perf_counter() - t0)

    def resume(self, path) -> None:
        """Load a checkpoint written by save_checkpoint (groups already init()-ed), then re-sync the engines,
        which still hold the initial weights, before the first generation."""
        from orlhf.checkpoint import load_controller_state, set_rng_state

        trained = [("actor", self.m.actor)] + ([("critic", self.m.critic)] if self.m.critic else [])
        for call in [g.call_all_async("load_checkpoint", str(path / role)) for role, g in trained]:
            call.get()
        state = load_controller_state(path)
        self.step_index, self.weight_version = state["step_index"], state["weight_version"]
        self._first_step = self.step_index
        self.loader.load_state_dict(state["loader"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.reward_norm is not None:
            self.reward_norm.load_state_dict(state["reward_norm"])
        set_rng_state(state["rng"])
        self.m.sync.sync(self.weight_version)
        log.info("resumed from %s at step %d (weight version %d)", path, self.step_index, self.weight_version)

    # ---- phases -----------------------------------------------------------------------------------------------
    def generate(self, prompts: list, batch_index: int) -> list[Rollout]:
        """Rollouts for one prompt batch; sampling seeds depend on (seed, batch index) only (reproducible)."""
        p = self.cfg.ppo
        sampling = SamplingSpec(temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.generate_max_len,
                                max_len=p.max_len,
                                n=p.n_samples_per_prompt, seed=p.seed * 1_000_003 + batch_index)
        return self.m.engines.generate([q.ids for q in prompts], sampling)

    def score(self, batch: SequenceBatch, rollouts: list[Rollout], prompts: list):
        """Everything that reads the rollouts, started together and gathered after."""
        old_call = self.m.actor.call_sharded_async("log_probs", batch)
        ref_call = self.m.ref.call_sharded_async("log_probs", batch)
        value_call = self.m.critic.call_sharded_async("values", batch) if self.m.critic else None
        reward_call = self.m.reward.call_sharded_async("scores", batch) if self.m.reward else None
        if self.reward_source is not None:  # runs here while the groups compute
            scores = self.reward_source.score(*self._reward_inputs(rollouts, prompts))
        else:
            scores = reward_call.get_cat()
        if self.reward_norm is not None:
            self.reward_norm.update(scores)
        values = value_call.get_cat() if value_call else None
        return scores.float(), old_call.get_cat(), ref_call.get_cat(), values

    def make_experience(self, batch, scores, old_lp, ref_lp, values) -> tuple[Experience, dict]:
        shaped_scores = self.reward_norm.normalize(scores) if self.reward_norm is not None else scores
        exp, info = make_experience(batch, shaped_scores, old_lp, ref_lp, values, self.kl_ctl.value, self.exp_cfg,
                                    weight_version=self.weight_version)
        info["reward_mean"] = scores.mean().item()  # the raw task reward, whatever the normalization
        self.kl_ctl.update(info["kl"], len(scores))
        return exp, info

    def train(self, exp: Experience) -> tuple[dict, Optional[dict]]:
        """max_epochs passes over the step's experience, shuffled; actor and critic in parallel."""
        actor_stats, critic_stats = [], []
        for epoch in range(self.cfg.ppo.max_epochs):
            g = torch.Generator().manual_seed(self.cfg.ppo.seed + 7919 * self.step_index + epoch)
            shuffled = exp.index(torch.randperm(len(exp), generator=g))
            actor_call = self.m.actor.call_sharded_async("train_step", shuffled)
            critic_call = self.m.critic.call_sharded_async("train_step", shuffled) if self.m.critic else None
            actor_stats += actor_call.get()
            if critic_call is not None:
                critic_stats += critic_call.get()
        return _mean_stats(actor_stats), _mean_stats(critic_stats) if critic_stats else None

    def sync_weights(self) -> None:
        with self._sync_lock:  # async mode: waits for the generation in flight; sync mode: uncontended
            self.sleep.before_sync()
            self.weight_version += 1
            self.m.sync.sync(self.weight_version)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _reward_inputs(self, rollouts: list[Rollout], prompts: list) -> tuple[list[str], list[str], list]:
        texts = self.tok.batch_decode([r.prompt_ids + r.response_ids for r in rollouts], skip_special_tokens=True)
        return texts, [prompts[r.prompt_index].text for r in rollouts], [prompts[r.prompt_index].label
                                                                         for r in rollouts]

    @contextmanager
    def timed(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - t0


def _mean_stats(stats: list[TrainStats]) -> dict[str, float]:
    keys = [f.name for f in fields(TrainStats) if f.name != "extra"]
    return {k: sum(float(getattr(s, k)) for s in stats) / len(stats) for k in keys}


def _masked_abs_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    return (x.abs() * mask).sum().item() / max(1, int(mask.sum()))
