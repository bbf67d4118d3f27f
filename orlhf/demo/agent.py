"""The built-in multi-turn demo environment: say colors, be told your share, say colors again (3 turns).

Train it: `orlhf train-ppo --agent_func_path <this file> --generate_max_len 8` (demo model and prompts), or on
the files `orlhf make-demo DIR` writes (DIR/agent_func.py is a copy of this one).

This file is also a template for your own agent: it follows OpenRLHF's AgentInstance / AgentExecutor contract,
so an OpenRLHF agent file runs under orlhf once its import reads `from orlhf.rollout.agent import ...`.

    reset(states)  -> {"observation": the prompt}                      one AgentInstance per sample
    step(states)   -> rewards: this turn's color share / TURNS (the episode's rewards sum to the mean share)
                      scores: the episode's running total; done after TURNS turns
                      environment_feedback: the share, and the request for more (tokens the model reads but is
                      never trained on)

Why it is learnable: as the single-turn demo (orlhf/demo/reward.py), a random tiny model says a color word now
and then; the reward for each turn rises as it learns to say colors whatever the feedback between turns.
"""

from typing import Any

import torch

from orlhf.demo.reward import target_share
from orlhf.rollout.agent import AgentInstanceBase, MultiTurnAgentExecutor

TURNS = 3


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.total = 0.0

    async def reset(self, states: dict, **kwargs) -> dict:
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        share = target_share(states["action_text"], states["label"])
        self.turn += 1
        self.total += share / TURNS
        done = self.turn >= TURNS
        feedback = "" if done else f" good {round(share * 10)} say colors:"
        return {
            "rewards": torch.tensor(share / TURNS),  # summed over the turns by the executor
            "scores": torch.tensor(self.total),
            "environment_feedback": feedback,
            "done": done,
            "sampling_params": states["sampling_params"],  # unchanged for the next turn
            "extra_logs": {"turn_share": share},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
