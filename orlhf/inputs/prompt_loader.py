"""PromptLoader: the prompts of a run as shuffled batches, one per PPO step, resumable.

The order depends only on (seed, episode): a run resumed from PromptLoader.state_dict() yields the same batches an
uninterrupted run would have.
"""

from __future__ import annotations

from typing import Iterator

from orlhf.inputs.errors import DataError
from orlhf.inputs.prompts import Prompt


class PromptLoader:
    """Batches of exactly batch_size prompts, num_episodes passes, each pass in its own shuffled order.

    The last partial batch of an episode is dropped (as OpenRLHF's drop_last=True dataloader): every PPO step
    sees the same number of prompts. Iterating resumes from the current position; state_dict() after receiving
    k batches points at batch k+1, so a checkpoint taken after training on a batch resumes with the next one.
    """

    def __init__(self, prompts: list[Prompt], batch_size: int, num_episodes: int, seed: int):
        if len(prompts) < batch_size:
            raise DataError(
                f"{len(prompts)} usable prompts but --rollout_batch_size {batch_size}: lower "
                "--rollout_batch_size or add prompts (see the prompt summary for skipped ones)."
            )
        self.prompts, self.batch_size, self.num_episodes, self.seed = prompts, batch_size, num_episodes, seed
        self.episode = 0
        self.batch_in_episode = 0

    @property
    def steps_per_episode(self) -> int:
        return len(self.prompts) // self.batch_size

    @property
    def total_steps(self) -> int:
        return self.steps_per_episode * self.num_episodes

    @property
    def steps_done(self) -> int:
        return self.episode * self.steps_per_episode + self.batch_in_episode

    def order(self, episode: int) -> list[int]:
        """The prompt order of one episode: a permutation seeded by (seed, episode) alone."""
        import numpy as np

        rng = np.random.default_rng([self.seed & 0xFFFFFFFFFFFFFFFF, episode])  # SeedSequence wants ints >= 0
        return rng.permutation(len(self.prompts)).tolist()

    def __iter__(self) -> Iterator[list[Prompt]]:
        while self.episode < self.num_episodes:
            order = self.order(self.episode)
            while self.batch_in_episode < self.steps_per_episode:
                start = self.batch_in_episode * self.batch_size
                self.batch_in_episode += 1  # before yielding: the batch counts as consumed once handed out
                yield [self.prompts[i] for i in order[start : start + self.batch_size]]
            self.episode, self.batch_in_episode = self.episode + 1, 0

    def __len__(self) -> int:
        return self.total_steps

    def state_dict(self) -> dict:
        episode, batch = self.episode, self.batch_in_episode
        if batch >= self.steps_per_episode:  # the end of an episode is the start of the next
            episode, batch = episode + 1, 0
        return {
            "episode": episode,
            "batch_in_episode": batch,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_prompts": len(self.prompts),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue where `state` was taken. The data, batch size and seed must match, or the order would not."""
        now = {"seed": self.seed, "batch_size": self.batch_size, "num_prompts": len(self.prompts)}
        then = {k: state.get(k) for k in now}
        if then != now:
            raise DataError(
                f"the checkpoint's prompt loader had {then}, this run has {now}; resume with the same "
                "--prompt_data, --max_samples, --prompt_max_len, --rollout_batch_size and --seed."
            )
        if not 0 <= state["batch_in_episode"] < self.steps_per_episode or state["episode"] < 0:
            raise DataError(
                f"corrupt prompt loader state {state}: batch_in_episode must be in "
                f"[0, {self.steps_per_episode}) and episode >= 0."
            )
        self.episode, self.batch_in_episode = int(state["episode"]), int(state["batch_in_episode"])
