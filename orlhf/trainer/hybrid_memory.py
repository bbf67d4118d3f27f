"""Hybrid mode (--colocate_all_models): who holds the shared devices' memory in each phase.

    before_generate   trainers offload their ZeRO-3 states (--deepspeed_enable_sleep; not the groups that generate the
                      rollouts themselves: RolloutBackend.generating_groups); engines wake their KV cache
    after_generate    engines sleep (free weights + KV cache; --vllm_enable_sleep); trainers reload their states
    before_sync       engines wake their weights only, so the sync has somewhere to write
    (the engines start asleep under --vllm_enable_sleep: the first wake-up, sync or generate, takes the weights)

Under --async_train the engines keep devices of their own and generate while the trainers train, so there is no
generation phase to free the trainers' memory in. --deepspeed_enable_sleep then means what OpenRLHF makes of it
there: the actor's and the critic's training states (optimizer states, fp32 masters, gradients) stay in host
memory except while that model trains, its parameters staying on the device for forwards and weight syncs; the two
train one after the other (`train`), so each trains on memory the other freed, and the frozen models' forwards of
the next batch, colocated with them, run beside smaller trainers. A checkpoint's save brings them back for itself
(DeepSpeedWorker.save_checkpoint).

On CPU there is no device memory to hand over: the flags are accepted (so GPU launch scripts run unchanged)
and the switch says once that it does nothing.
"""

from __future__ import annotations

import logging
from typing import Callable

from orlhf.workers.base import DeepSpeedWorker

log = logging.getLogger(__name__)


class SleepSwitch:
    def __init__(self, cfg, models):
        self.m = models
        on_gpu = cfg.runtime.device == "cuda"
        asked = cfg.vllm.enable_sleep or cfg.deepspeed.enable_sleep
        self.vllm = cfg.vllm.enable_sleep and on_gpu
        self.deepspeed = cfg.deepspeed.enable_sleep and on_gpu and not cfg.ppo.async_train
        self.apart = cfg.deepspeed.enable_sleep and on_gpu and cfg.ppo.async_train  # states off except in training
        # the vLLM backend's Bringup puts the engines to sleep before the trainers start: the first generation must
        # wake their weights too, not only the KV cache.
        self.weights_asleep = self.vllm
        if asked and not on_gpu:
            log.info(
                "--vllm_enable_sleep / --deepspeed_enable_sleep do nothing on CPU (no device memory to free); "
                "the run is otherwise the same"
            )

    def _trained(self) -> list:
        """The trained groups that sleep while rollouts are generated (not those that generate them: their states
        are what the generation runs on)."""
        generating = self.m.rollout.generating_groups
        return [g for g in (self.m.actor, self.m.critic) if g is not None and not any(g is x for x in generating)]

    def before_generate(self) -> None:
        if self.deepspeed:
            for call in [g.call(DeepSpeedWorker.offload_states) for g in self._trained()]:
                call.get()
        if self.vllm:
            self.m.rollout.wake_up(["weights", "kv_cache"] if self.weights_asleep else ["kv_cache"])
            self.weights_asleep = False

    def after_generate(self) -> None:
        if self.vllm:
            self.m.rollout.sleep()
            self.weights_asleep = True
        if self.deepspeed:
            for call in [g.call(DeepSpeedWorker.reload_states) for g in self._trained()]:
                call.get()

    def before_sync(self) -> None:
        if self.vllm and self.weights_asleep:
            self.m.rollout.wake_up(["weights"])
            self.weights_asleep = False

    def train(self, group, fn: Callable, *args):
        """The call of `fn` (a trained group's train_step) on `group`'s shards. Under --async_train with
        --deepspeed_enable_sleep: its states reloaded first, the call waited for, its states (not its parameters)
        offloaded after, so a second model's training starts only once this one freed its memory."""
        if not self.apart:
            return group.call_sharded(fn, *args)
        group.call(DeepSpeedWorker.reload_states).get()
        results = group.call_sharded(fn, *args).get()
        group.call(DeepSpeedWorker.offload_states, params=False).get()
        return _Done(results)


class _Done:
    """A call already waited for, read like a pending one."""

    def __init__(self, results: list):
        self.results = results

    def get(self) -> list:
        return self.results
