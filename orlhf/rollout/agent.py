"""Multi-turn agents: OpenRLHF's AgentInstanceBase / MultiTurnAgentExecutor contract, token in, token out.

A user's file (--agent_func_path) defines

    class AgentInstance(AgentInstanceBase):        one environment per sample
        (async) __init__(self)
        async reset(self, states) -> {"observation": str}          states: {"observation": prompt, "label"}
        async step(self, states) -> {"rewards", "scores", "environment_feedback", "done", "sampling_params",
                                     "extra_logs"}                  states: {"observation_text", "action_text",
                                                                             "label", "sampling_params"}
    class AgentExecutor(MultiTurnAgentExecutor):
        def __init__(self): super().__init__(AgentInstance)

A file written for OpenRLHF runs here once its import line reads `from orlhf.rollout.agent import ...` instead of
`from openrlhf.utils.agent import ...`. A custom executor may override execute() (same signature and result dict
as OpenRLHF's) for full token-level control.

One episode (MultiTurnAgentExecutor.execute), in token ids throughout:

    tokens = the prompt's ids (or the tokenized observation, when reset changes it)
    loop:  action = await llm_engine.generate(tokens, params)        engine log-probs kept for every action token
           result = await step({observation_text, action_text, ...})
           tokens += action ids + tokenizer(environment_feedback)    feedback: context, never trained on
           until done, or no token of the length budget is left
    -> {"observation_tokens", "action_ranges", "rollout_log_probs", "reward", "scores", "extra_logs"}

Length budget: each turn generates at most the params' max_tokens (--generate_max_len, or what step returns in
sampling_params), and the whole episode at most max_length tokens (--prompt_max_len + --generate_max_len).
Where this departs from OpenRLHF: OpenRLHF gives every turn the whole remaining budget (its max_tokens is
overwritten each turn); a per-turn cap keeps short-turn environments short. rewards are summed over the turns
(OpenRLHF's total_reward); scores default to that sum.
"""

from __future__ import annotations

import copy
import inspect
import numbers
from abc import ABC, abstractmethod
from typing import Any


class AgentError(RuntimeError):
    """A user's agent file failed: the message names the file, the sample and what to fix."""


class AgentStepError(AgentError):
    """reset/step/execute returned something unusable; the message names the method and the key."""


class AgentInstanceBase(ABC):
    """One environment, bound to one sample. Subclasses define step (and usually reset)."""

    def __init__(self, *args, **kwargs):  # noqa: B027 (OpenRLHF's contract: a subclass may not define one)
        pass

    async def reset(self, states: dict, **kwargs) -> dict:
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs) -> dict:
        raise NotImplementedError("AgentInstance.step is not implemented")


class AgentExecutorBase(ABC):
    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError("AgentExecutor.execute is not implemented")


async def make_instance(cls: type) -> AgentInstanceBase:
    """cls() - or, for OpenRLHF files whose __init__ is `async def`, the instance with its __init__ awaited."""
    if inspect.iscoroutinefunction(cls.__init__):
        inst = cls.__new__(cls)
        await cls.__init__(inst)
        return inst
    return cls()


class MultiTurnAgentExecutor(AgentExecutorBase):
    """Runs one AgentInstance per sample through reset/step turns (see the module docstring)."""

    def __init__(self, agent_instance_cls: type):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"MultiTurnAgentExecutor needs a subclass of AgentInstanceBase, got {agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine, images=None):
        agent = await make_instance(self.agent_instance_cls)
        reset = await agent.reset({"observation": prompt, "label": label})
        observation = _get(reset, "observation", "reset", str)
        prompt_ids = getattr(llm_engine, "prompt_token_ids", None)  # orlhf's engine handle: the prompt as tokenized
        tokens = (
            list(prompt_ids) if observation == prompt and prompt_ids is not None else _encode(hf_tokenizer, observation)
        )
        action_ranges: list[tuple[int, int]] = []
        log_probs = [0.0] * len(tokens)
        total_reward, scores, extra_logs = 0.0, None, {}
        params = sampling_params
        while True:
            budget = max_length - len(tokens)
            if budget <= 0:
                break
            turn_params = copy.deepcopy(params)
            turn_params.max_tokens = min(params.max_tokens or budget, budget)
            out = (await llm_engine.generate(tokens, turn_params)).outputs[0]
            action = list(out.token_ids)
            action_ranges.append((len(tokens), len(tokens) + len(action)))
            log_probs += [lp[t].logprob for t, lp in zip(action, out.logprobs)]
            result = await agent.step(
                {
                    "observation_text": observation,
                    "action_text": out.text,
                    "label": label,
                    "sampling_params": turn_params,
                }
            )
            if not isinstance(result, dict):
                raise AgentStepError(
                    f"AgentInstance.step returned a {type(result).__name__}, not a dict with "
                    "rewards, environment_feedback and done"
                )
            total_reward += _get(result, "rewards", "step", float)
            if result.get("scores") is not None:
                scores = _get(result, "scores", "step", float)
            feedback = _get(result, "environment_feedback", "step", str)
            done = bool(_get(result, "done", "step", bool))
            extra_logs = result.get("extra_logs") or {}
            feedback_ids = _encode(hf_tokenizer, feedback) if feedback else []
            observation += out.text + feedback
            tokens += action + feedback_ids
            log_probs += [0.0] * len(feedback_ids)
            if result.get("sampling_params") is not None:
                params = result["sampling_params"]
            if done:
                break
        return {
            "prompt": prompt,
            "label": label,
            "observation_tokens": tokens,
            "action_ranges": action_ranges,
            "rollout_log_probs": log_probs,
            "reward": total_reward,
            "scores": total_reward if scores is None else scores,
            "extra_logs": extra_logs,
        }


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _get(result: Any, key: str, method: str, kind: type) -> Any:
    """result[key] checked to be usable as `kind`; AgentStepError naming the method and the key otherwise."""
    if not isinstance(result, dict):
        raise AgentStepError(f"AgentInstance.{method} returned a {type(result).__name__}, not a dict")
    if key not in result:
        raise AgentStepError(f"AgentInstance.{method} returned no {key!r} key (it returned keys {sorted(result)})")
    value = result[key]
    if kind is float:
        number = as_float(value)
        if number is None:
            raise AgentStepError(
                f"AgentInstance.{method} returned {key!r} = {value!r}: expected a number or a one-element tensor"
            )
        return number
    if kind is str and not isinstance(value, str):
        raise AgentStepError(f"AgentInstance.{method} returned {key!r} = {value!r}: expected a str")
    if kind is bool and as_float(value) is None:
        raise AgentStepError(f"AgentInstance.{method} returned {key!r} = {value!r}: expected True or False")
    return value


def as_float(value: Any) -> float | None:
    """A python number, numpy scalar or one-element tensor as float; None for anything else (or NaN)."""
    if hasattr(value, "numel") and hasattr(value, "item"):  # torch tensor
        if value.numel() != 1:
            return None
        value = value.item()
    elif hasattr(value, "item") and getattr(value, "size", 1) == 1:  # numpy scalar / 1-element array
        value = value.item()
    if isinstance(value, bool) or isinstance(value, numbers.Real):
        number = float(value)
        return None if number != number else number
    return None
