"""The PPO loop. One driver process (this one) calls the model groups and engines; no logic lives in them.

    for each step (a batch of --rollout_batch_size prompts):
      generate         engines: prompt ids -> n_samples_per_prompt rollouts each (ids, engine log-probs); with
                       --agent_func_path one multi-turn agent episode per sample (rollout/executor.py);
                       with --dynamic_filtering scored at once and refilled until full (trainer/dynamic_filtering.py)
      score            in parallel: actor old log-probs | ref log-probs | critic values | rewards (RM group, or
                       the reward function / HTTP server while the groups work). Skipped, as they cannot change
                       the update: ref without a KL (TrainConfig.has_reference), old log-probs on a single pass
                       (TrainConfig.single_pass: the actor's training forward supplies them, the ratio is 1);
                       trainer/scoring.py (async mode starts the frozen models' forwards when a batch is generated)
      (guard)          engine log-probs vs the actor's: past a threshold set at step 1 the run stops (sync_guard.py)
      make_experience  driver: KL, group baseline, KL-shaped rewards, advantages and returns (experience.py, algo/)
      train            actor and critic train_step at the same time (trainer/train_phase.py);
                       --freezing_actor_steps N: the critic alone while the step index (0-based) is <= N
      sync_weights     actor -> engines (RolloutBackend.load_weights: rollout/weight_sync.py); weight_version += 1;
                       before the next generate
                       (skipped after a frozen-actor step: the engines already hold those weights)
      evaluate         every --eval_steps steps and after the last: held-out prompts on the new weights
                       (trainer/evaluation.py; no training state touched), the best checkpoint kept apart

Invariants: weights are synced after the optimizer steps of a step and before the next generation, so every
rollout of step k+1 comes from weight_version k+1. Async mode (fit_async) relaxes this: generation runs ahead
by at most --async_queue_size batches, and a sync never overlaps an engine call (the producer's lock); with
--partial_rollout a sync lands between two segments of a generation, whose samples then hold tokens of two weight
versions (rollout/partial.py).
Each phase is timed (`timing/<phase>` seconds in metrics.jsonl) and announced to the platform's tuning as it starts
(Tuning.phases, distributed/tuning.py: on CPU the cores go to the processes working in it).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Optional

import torch

from orlhf.config.train_config import TrainConfig
from orlhf.inputs.vision import vision_prompts
from orlhf.rollout.executor import agent_metrics, make_executor
from orlhf.rollout.partial import segmenter, version_stats
from orlhf.storage.logs import TRACE, terminal_muted
from orlhf.storage.metrics import MetricsLogger
from orlhf.trainer.async_producer import SyncGate
from orlhf.trainer.dynamic_filtering import DynamicFilter
from orlhf.trainer.engine_restart import EngineRestarts
from orlhf.trainer.experience import ExperienceMaker, rollouts_to_batch
from orlhf.trainer.hybrid_memory import SleepSwitch
from orlhf.trainer.models import Models
from orlhf.trainer.run_state import CheckpointSteps, RunState
from orlhf.trainer.scoring import ScoredAhead, Scorer
from orlhf.trainer.step_stats import StepCheck, engine_gap, step_row
from orlhf.trainer.sync_guard import SyncGuard
from orlhf.trainer.train_phase import train_epochs
from orlhf.types import Experience, Rollout, SamplingSpec

log = logging.getLogger(__name__)


class Controller(CheckpointSteps):
    """The loop (module docstring); its checkpoint steps (stop, save, resume) are trainer/run_state.py's."""

    def __init__(
        self,
        cfg: TrainConfig,
        models: Models,
        loader,
        tokenizer,
        metrics: MetricsLogger,
        reward_source=None,
        checkpoints=None,
        evaluator=None,
        best_checkpoints=None,
    ):
        self.cfg, self.m, self.loader, self.tok, self.metrics = cfg, models, loader, tokenizer, metrics
        # the score phase (trainer/scoring.py); reward_source: function file / HTTP, None when a reward model scores
        self.scorer = Scorer(cfg, models, tokenizer, reward_source)
        p = cfg.ppo
        self.experience = ExperienceMaker(p)  # the make_experience phase, with the KL controller across steps
        self.step_index = 0  # steps done
        self.weight_version = 0  # bumped by every sync; engines tag rollouts with the version they hold
        self.timings: dict[str, float] = {}
        self.history: list[dict] = []
        self.checkpoints = checkpoints  # a checkpoint.CheckpointManager, or None
        self.evaluator = evaluator  # an evaluation.Evaluator (--eval_dataset), or None
        self.best_checkpoints = best_checkpoints  # CheckpointManager of <ckpt_path>/best (--best_metric_key)
        self.sleep = SleepSwitch(cfg, models)  # hybrid mode's memory hand-over (no-op unless asked, on GPU)
        # Rollouts: one generation per sample, or an agent episode per sample with --agent_func_path.
        self.executor = make_executor(
            cfg.data.agent_func_path,
            models.rollout,
            tokenizer,
            cfg.ppo.prompt_max_len + cfg.ppo.generate_max_len,
            cfg.runtime.ray_timeout_s,
            vision_prompts(cfg),
        )
        # --max_engine_restarts: a lost engine replaced in place, at the step in progress and the current weights
        self.restarts = EngineRestarts.for_run(cfg, models, lambda: (self.step_index + 1, self.weight_version))
        self.guard = SyncGuard.from_config(cfg)  # calibrated at step 1, or --max_engine_logprob_gap (sync_guard.py)
        self.guard.announce()  # where it does not look, said once now
        self.numbers = StepCheck(p.actor_learning_rate, p.critic_learning_rate)  # NaN / inf stop the run
        self.stop_signal: Optional[str] = None  # "SIGTERM" / "SIGINT": stop at the next step boundary and save
        self.phases = models.tuning.phases(cfg, models)  # told as each phase starts (timed)
        self.first_step = 0  # step_index when this invocation started (resume; kept by a --max_restarts restart)
        self.run_restarts = 0  # --max_restarts restarts of this invocation before this controller (launch/restart.py)
        self._saved_step: Optional[int] = None  # step of this invocation's newest checkpoint
        self._sync_gate = SyncGate()  # async mode: the producer's, shared with its generations
        # --partial_rollout: the batch in segments (agents: their turns), a waiting sync let in between two (fit_async)
        self.partial = segmenter(self.executor, models.rollout, p, cfg.data.agent_func_path)
        self._last_step_end = time.perf_counter()
        self.filter = (
            DynamicFilter(
                p.rollout_batch_size,
                p.n_samples_per_prompt,
                p.dynamic_filtering_reward_range,
                self.generate,
                self.scorer.rewards,
            )
            if p.dynamic_filtering
            else None
        )

    # ---- the loop ---------------------------------------------------------------------------------------------
    def fit(self) -> list[dict]:
        """Train over the loader: step by step, or with generation overlapping training (--async_train)."""
        if self.cfg.ppo.async_train:
            return self.fit_async()
        if self.filter is not None:
            return self.fit_filtered()
        with self.progress() as report:
            for prompts in self.loader:
                if self.should_stop():
                    self.save_at_stop()
                    break
                self.timings = {}
                with self.timed("generate"):
                    self.sleep.before_generate()
                    rollouts = self.generate(prompts, self.step_index)
                    self.sleep.after_generate()
                report(self.learn(prompts, rollouts))
        return self.history

    def fit_filtered(self) -> list[dict]:
        """--dynamic_filtering: each step's prompts, rollouts and scores come from the filter, which reads the
        loader as far as it needs (trainer/dynamic_filtering.py); the run ends when the prompts run out."""
        batches = iter(self.loader)
        with self.progress() as report:
            while not self.should_stop():
                self.timings = {}
                with self.timed("generate"):
                    self.sleep.before_generate()
                    filled = self.filter.fill(batches, self.step_index)
                    self.sleep.after_generate()
                if filled is None:
                    break
                report({**self.learn(filled.prompts, filled.rollouts, filled.reward), **filled.info})
            if self.should_stop():  # as fit(): --stop_after_steps ended it, so the resume starts here
                self.save_at_stop()
        return self.history

    def fit_async(self) -> list[dict]:
        """Engines generate batch k+1 (and up to --async_queue_size ahead) while the trainers learn on batch k.

        Weight syncs take the producer's lock, so they never race a generation; each rollout keeps the weight
        version it was generated with, and staleness (trainer version - generation version) <= queue size.
        """
        from orlhf.trainer.async_producer import RolloutProducer

        fill = self.filter.fill if self.filter is not None else None  # --dynamic_filtering: full batches queued
        p = self.cfg.ppo
        per_generation = (p.vllm_generate_batch_size or p.rollout_batch_size) // p.rollout_batch_size
        producer = RolloutProducer(
            self.generate,
            self.loader,
            p.async_queue_size,
            self.scorer.ahead,
            fill=fill,
            batches_per_generation=per_generation,
            pending=self.pending,  # what the resumed checkpoint had generated (run_state.py)
        )
        self.producer, self.pending = producer, ()  # a checkpoint keeps its batches generated ahead
        self._sync_gate = producer.gate
        if self.partial is not None:
            self.partial.between = producer.gate.yield_to_sync
        if self.partial is self.executor:  # agents: new turns wait while a sync waits (rollout/partial.py TurnGate)
            self.executor.sync_waiting = lambda: producer.gate.waiting
        with producer, self.progress() as report:
            while not self.should_stop():  # before taking a batch: a stop keeps it in the producer's queue, saved
                item = producer.next()
                if item is None:
                    break
                self.timings = {"generate": item.seconds}
                if item.filled is None:
                    report(self.learn(item.prompts, item.rollouts, ahead=item.ahead))
                else:
                    filled = item.filled
                    report({**self.learn(item.prompts, item.rollouts, filled.reward, ahead=item.ahead), **filled.info})
            if self.should_stop():  # --stop_after_steps, a signal: saved here, with the batches generated ahead
                self.save_at_stop()
        self.producer = None
        return self.history

    def learn(
        self, prompts: list, rollouts: list[Rollout], reward=None, ahead: Optional[ScoredAhead] = None
    ) -> dict[str, Any]:
        """Everything after generation for one batch: score, make experience, train, sync. Returns metrics.
        reward: a rewards.RewardResult already computed while generating (--dynamic_filtering), else scored here.
        ahead: the batch and the frozen models' calls started when it was generated (async: Scorer.ahead)."""
        if ahead is not None:
            batch, engine_log_probs = ahead.batch, ahead.engine_log_probs
        else:
            batch, engine_log_probs = rollouts_to_batch(rollouts, self.tok.pad_token_id)
        gen_version = min(r.weight_version for r in rollouts)
        staleness = self.weight_version - gen_version  # trainer version these rollouts are trained at
        partial = version_stats(rollouts, self.weight_version) if self.partial is not None else {}
        with self.timed("score"):
            reward, old_lp, ref_lp, values = self.scorer.score(batch, rollouts, prompts, reward, ahead)
            batch = self.scorer.routed(batch)  # --router_replay R2: the old-log-prob forward's experts
        if old_lp is not None:  # stop before training on another policy's samples
            gap = engine_gap(engine_log_probs, old_lp, batch.action_mask)
            self.numbers.before_train(self.step_index + 1, gap)
            self.guard.check(gap, self.step_index + 1, staleness, gen_version)
        with self.timed("make_experience"):
            truncated = torch.tensor([not r.finished for r in rollouts])
            norm = self.scorer.reward_norm  # --normalize_reward's running statistics, updated in score
            exp, info = self.experience.make(
                batch, reward.rewards, old_lp, ref_lp, values, norm, self.weight_version, truncated, engine_log_probs
            )
        with self.timed("train"):
            actor_stats, critic_stats = self.train(exp, info["kl_coef"])
        if old_lp is None and not self.actor_frozen:  # single pass: the actor measured the gap in its training
            gap = engine_gap(engine_log_probs, None, batch.action_mask, actor_stats)  # forward; stop after it
        elif old_lp is None:
            gap = float("nan")  # nothing measured it: the frozen actor made no forward
        # before the sync: nothing non-finite reaches the engines, a checkpoint or the export
        self.numbers.after_train(self.step_index + 1, None if self.actor_frozen else actor_stats, critic_stats, gap)
        if old_lp is None and not self.actor_frozen:
            self.guard.check(gap, self.step_index + 1, staleness, gen_version)
        with self.timed("sync"):
            if not self.actor_frozen:  # a frozen actor's weights are the engines' already
                self.sync_weights()
        self.step_index += 1
        now = time.perf_counter()
        seconds, self._last_step_end = now - self._last_step_end, now  # wall time per step, overlap included
        fields = {
            "weight_version": self.weight_version,
            "generation_weight_version": gen_version,
            "staleness": staleness,
            **partial,  # --partial_rollout: per-token staleness, share of samples that crossed a sync
            "engine_logprob_gap": gap,
            "samples": len(rollouts),
            "samples_per_s": len(rollouts) / seconds,
            "step_s": seconds,
            "engine_restarts": self.restarts.count,  # engines replaced so far (trainer/engine_restart.py)
            "run_restarts": self.run_restarts,  # groups started again after a lost process (launch/restart.py)
            **reward.log_row(),
            **{f"timing/{k}": v for k, v in self.timings.items()},
            **agent_metrics(rollouts),
        }
        return step_row(info, actor_stats, critic_stats, fields, self.cfg.ppo)

    @contextmanager
    def progress(self):
        """A progress bar (step, ETA, reward, samples/s) and per-step logging; yields report(row)."""
        from tqdm import tqdm

        total = self.loader.total_steps
        if self.evaluator is not None and self.evaluator.before_train and self.step_index == 0:
            # where the eval curve starts: the weights before any update (a baseline, not a best checkpoint)
            self.metrics.log(0, self.evaluate(keep_best=False))
        hidden = terminal_muted()  # a signal is ending the run (launch/stop_signals.py)
        bar = tqdm(total=total, initial=self.step_index, desc="ppo", unit="step", dynamic_ncols=True, disable=hidden)
        self._last_step_end = time.perf_counter()

        def report(row: dict) -> None:
            if self.evaluator is not None and self.evaluator.due(
                self.step_index, self.step_index == total or self.should_stop()
            ):
                row.update(self.evaluate())
            self.history.append(row)
            if self.step_index % self.cfg.logging.logging_steps == 0 or self.step_index == total:
                self.metrics.log(self.step_index, row)
            if (
                self.checkpoints is not None
                and self.cfg.logging.save_steps > 0
                and self.step_index % self.cfg.logging.save_steps == 0
            ):
                self.save_checkpoint()
            bar.update(1)
            bar.set_postfix(
                reward=f"{row['reward_mean']:.3f}", kl=f"{row['kl']:.4f}", sps=f"{row['samples_per_s']:.1f}"
            )

        try:
            yield report
        finally:
            bar.close()

    def evaluate(self, keep_best: bool = True) -> dict[str, float]:
        """Held-out prompts on the current weights (orlhf/trainer/evaluation.py); the best checkpoint when it
        improved (keep_best)."""
        self.sleep.before_generate()
        metrics = self.evaluator.run(self.step_index, self.executor.generate, self.scorer.eval_scores)
        self.sleep.after_generate()
        if keep_best and self.evaluator.improved(metrics) and self.best_checkpoints is not None:
            log.info("best %s so far: %.4f at step %d", self.evaluator.best_key, self.evaluator.best, self.step_index)
            self.save_checkpoint(self.best_checkpoints)
        return metrics

    # ---- phases -----------------------------------------------------------------------------------------------
    def generate(self, prompts: list, batch_index: int) -> list[Rollout]:
        """Rollouts for one prompt batch; sampling seeds depend on (seed, batch index) only (reproducible)."""
        p = self.cfg.ppo
        sampling = SamplingSpec(
            temperature=p.temperature,
            top_p=p.top_p,
            max_new_tokens=p.generate_max_len,
            max_len=p.max_len,
            n=p.n_samples_per_prompt,
            seed=p.seed * 1_000_003 + batch_index,
        )
        generate = self.partial.generate if self.partial is not None else self.executor.generate
        return self.restarts.generate(generate, prompts, sampling)  # agents: a lost engine named

    def train(self, exp: Experience, kl_coef: float) -> tuple[dict, Optional[dict]]:
        """max_epochs passes over the step's experience, actor and critic in parallel (trainer/train_phase.py)."""
        actor = None if self.actor_frozen else self.m.actor
        return train_epochs(exp, kl_coef, self.cfg.ppo, self.step_index, actor, self.m.critic, self.sleep)

    @property
    def actor_frozen(self) -> bool:
        """--freezing_actor_steps N: the actor sits out while the step index (0-based) is <= N, OpenRLHF's
        `global_steps > freezing_actor_steps` test with its step counter starting at 0 (N + 1 steps, critic only)."""
        return self.step_index <= self.cfg.ppo.freezing_actor_steps

    def sync_weights(self) -> None:
        with self._sync_gate.sync():  # async: waits for the engine call in flight (a segment with --partial_rollout)
            self.sleep.before_sync()
            self.weight_version += 1
            self.restarts.sync(self.weight_version)  # an engine lost in it is replaced (trainer/engine_restart.py)

    # ---- helpers ----------------------------------------------------------------------------------------------
    def run_state(self) -> RunState:
        """What a checkpoint holds of this run (trainer/run_state.py): saved and resumed through this view only."""
        return RunState(
            cfg=self.cfg,
            models=self.m,
            step_index=self.step_index,
            weight_version=self.weight_version,
            loader=self.loader,
            loader_reads_ahead=self.filter is not None,
            kl_ctl=self.experience.kl_ctl,
            reward_norm=self.scorer.reward_norm,
            evaluator=self.evaluator,
            restarts=self.restarts,
            guard=self.guard,
            producer=self.producer,
        )

    @contextmanager
    def timed(self, phase: str):
        self.phases.before(phase)  # the platform's tuning (on CPU: the cores go to the processes working in it)
        logging.getLogger(TRACE).info("step %d: %s", self.step_index + 1, phase)
        t0 = time.perf_counter()
        yield
        self.timings[phase] = self.timings.get(phase, 0.0) + time.perf_counter() - t0
