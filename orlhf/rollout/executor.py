"""Where rollouts come from: an executor turns a prompt batch into Rollouts.

    SingleTurnExecutor   (default)            engines.generate(prompt ids) once; the reward source scores later
    AgentRunner          (--agent_func_path)  every sample its own agent episode (agent.py), all concurrently:

        asyncio.gather(episode(sample j) for j in prompts x n_samples_per_prompt)
          episode: executor.execute(prompt, label, params, max_length, tokenizer, EngineHandle(j))
                   EngineHandle.generate(ids, params) --queue--> EngineClient(engine of j)
          EngineClient: while the engine runs one batch, the requests of every agent that is ready queue up; the
                        next engine call takes them all (one slow environment never holds the batch back);
                        rollout/agent_engine.py, with what the agent sees (EngineHandle, RequestOutput)
        -> Rollout(prompt ids | response = actions and feedback, action_mask 1 on actions, reward from the agent)

Invariants: samples stay in prompt-major order (sample k of prompt i is row i * n + k); sample j's turn t samples
with a seed derived from (step seed, j, t) unless the agent sets one, so a run is reproducible whatever the
timing of the environments; an agent's exception or bad result stops the step with an AgentError naming the
file, the sample and the key.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional

from orlhf.inputs.user_files import import_failure, import_file, user_frames
from orlhf.rollout.agent import AgentError, AgentExecutorBase, AgentStepError, as_float
from orlhf.rollout.agent_engine import EngineClient, EngineHandle
from orlhf.rollout.partial import TurnGate, grow_routing, turn_versions
from orlhf.types import Rollout


class SingleTurnExecutor:
    """Generate once per sample; rewards come from the run's reward source.

    With image prompts (a vision-language model; `vision` set): the engines get each prompt's template ids and its
    images, with the image placeholder ids banned from responses; each rollout gets the trainer's (processor's)
    prompt ids, checked equal to the engine's own expansion, and its prompt's image tensors (vision.tensors)."""

    def __init__(self, engines, vision=None):
        self.engines = engines
        self.vision = vision  # inputs.vision.VisionPrompts, or None for a text model

    def generate(self, prompts: list, sampling) -> list[Rollout]:
        if self.vision is None or not any(q.images for q in prompts):
            return self.engines.generate([q.ids for q in prompts], sampling)
        sampling = replace(sampling, banned_token_ids=tuple(self.vision.banned_token_ids))
        ids = [q.engine_ids if q.engine_ids is not None else q.ids for q in prompts]
        rollouts = self.engines.generate(ids, sampling, images=[q.images for q in prompts])
        tensors = [self.vision.tensors(q) for q in prompts]  # once per prompt, shared by its samples
        for r in rollouts:
            q = prompts[r.prompt_index]
            if r.prompt_ids != q.ids:
                raise ValueError(
                    f"prompt row {q.index + 1}: the vLLM engine expanded its image placeholders to "
                    f"{len(r.prompt_ids)} tokens, the model's processor to {len(q.ids)}: the engine and the trainer "
                    "would see different prompts. Check that the model folder's processor settings "
                    "(preprocessor_config.json) are the ones the model was saved with."
                )
            r.vision = tensors[r.prompt_index]
        return rollouts


@dataclass
class _Job:
    index: int  # row in the step's batch
    prompt_index: int
    prompt: Any  # inputs.prompts.Prompt: text, ids, label
    engine: int
    extra: dict = field(default_factory=dict)


class AgentRunner:
    """--agent_func_path: every sample one concurrent agent episode; rollouts carry the agent's rewards."""

    def __init__(
        self,
        path: str,
        engines,
        tokenizer,
        max_length: int,
        timeout_s: float = 600.0,
        call: Optional[Callable[[int, list], Any]] = None,
    ):
        self.path, self.engines, self.tokenizer, self.max_length = str(path), engines, tokenizer, max_length
        self.timeout_s = timeout_s
        self.executor = load_agent_executor(self.path)
        # call(engine index, requests) -> concurrent Future; the run's engines by default (tests may pass a fake).
        self.call = call or engines.generate_turns
        self.num_engines = len(engines) if engines is not None else 1
        # --partial_rollout (async): between two engine calls a waiting weight sync runs (rollout/partial.py TurnGate)
        self.between: Optional[Callable[[], object]] = None
        self.sync_waiting: Callable[[], bool] = lambda: False

    def generate(self, prompts: list, sampling) -> list[Rollout]:
        """All prompts x sampling.n samples, prompt-major; blocks until every episode is done."""
        return asyncio.run(self._run(prompts, sampling))

    async def _run(self, prompts: list, sampling) -> list[Rollout]:
        SamplingParams = turn_params_class(self.engines)
        gate = TurnGate(self.between, self.sync_waiting)
        clients = [EngineClient(lambda reqs, i=i: self.call(i, reqs), gate) for i in range(self.num_engines)]
        servers = [asyncio.create_task(c.serve()) for c in clients]
        jobs = [
            _Job(j, i, q, 0)
            for j, (i, q) in enumerate((i, q) for i, q in enumerate(prompts) for _ in range(sampling.n))
        ]
        for job in jobs:  # contiguous blocks per engine: a prompt's samples share an engine (prefix cache)
            job.engine = job.index * self.num_engines // len(jobs)
        params = SamplingParams(
            n=1, temperature=sampling.temperature, top_p=sampling.top_p, max_tokens=sampling.max_new_tokens, logprobs=0
        )
        try:
            episodes = [self._episode(job, sampling, clients[job.engine], params) for job in jobs]
            rollouts = await asyncio.wait_for(asyncio.gather(*episodes), self.timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"agent episodes of {self.path} did not finish in {self.timeout_s:.0f} s "
                "(--ray_timeout_s); an environment's step may be stuck"
            ) from None
        finally:
            for s in servers:
                s.cancel()
        return list(rollouts)

    async def _episode(self, job: _Job, sampling, client: EngineClient, params) -> Rollout:
        handle = EngineHandle(client, self.tokenizer, job.prompt.ids, sampling.seed, job.index)
        where = (
            f"{self.path}: sample {job.index} (prompt {job.prompt_index} of the batch, "
            f"sample {job.index % sampling.n + 1} of {sampling.n})"
        )
        try:
            out = await self.executor.execute(
                prompt=job.prompt.text,
                label=job.prompt.label,
                sampling_params=copy.deepcopy(params),
                max_length=self.max_length,
                hf_tokenizer=self.tokenizer,
                llm_engine=handle,
            )
            rollout = episode_to_rollout(out, job.prompt_index, job.engine)
        except AgentStepError as e:
            raise AgentError(f"{where}: {e}. Fix the agent in {self.path}.") from e
        except AgentError as e:
            raise AgentError(f"{where}: {e}") from e
        except Exception as e:
            raise AgentError(
                f"{where}: {type(e).__name__}: {e}\n{user_frames(e, self.path)}\nFix the agent in {self.path}."
            ) from e
        rollout.weight_version = min(handle.weight_versions, default=0)
        if handle.routed is not None:  # the rows of the episode's tokens, as far as they agree with what was routed
            tokens = [*rollout.prompt_ids, *rollout.response_ids]
            _, rollout.routed_experts = grow_routing(handle.routed_ids, handle.routed, tokens, None)
        if self.between is not None:  # --partial_rollout: a sync may have landed between two turns
            ranges = [(int(a), int(b)) for a, b in out["action_ranges"]]
            rollout.token_versions = turn_versions(
                ranges, len(rollout.prompt_ids), len(rollout.response_ids), handle.weight_versions
            )
        rollout.finished = handle.finish_reason == "stop"
        rollout.extra_logs["turns"] = float(handle.turns)
        return rollout


def episode_to_rollout(out: Any, prompt_index: int, engine: int) -> Rollout:
    """An execute() result dict (OpenRLHF's keys) -> Rollout; AgentStepError naming the key when unusable."""
    if not isinstance(out, dict):
        raise AgentStepError(f"AgentExecutor.execute returned a {type(out).__name__}, not a dict")
    for key in ("observation_tokens", "action_ranges", "reward"):
        if key not in out:
            raise AgentStepError(f"AgentExecutor.execute returned no {key!r} key (it returned keys {sorted(out)})")
    tokens = [int(t) for t in out["observation_tokens"]]
    ranges = [(int(s), int(e)) for s, e in out["action_ranges"]]
    start = ranges[0][0] if ranges else len(tokens)
    prev = start
    for s, e in ranges:
        if not prev <= s <= e <= len(tokens):
            raise AgentStepError(
                f"AgentExecutor.execute returned 'action_ranges' {ranges}: ranges must be in "
                f"order, not overlap and lie within the {len(tokens)} observation_tokens"
            )
        prev = e
    mask = [0] * (len(tokens) - start)
    for s, e in ranges:
        mask[s - start : e - start] = [1] * (e - s)
    lps = out.get("rollout_log_probs")
    if lps is not None and len(lps) != len(tokens):
        raise AgentStepError(
            f"AgentExecutor.execute returned {len(lps)} 'rollout_log_probs' for {len(tokens)} "
            "observation_tokens: give one per token (0.0 on non-action tokens)"
        )
    reward = as_float(out["reward"])
    if reward is None:
        raise AgentStepError(f"AgentExecutor.execute returned 'reward' = {out['reward']!r}: expected a number")
    score = as_float(out.get("scores")) if out.get("scores") is not None else reward
    extra = {k: as_float(v) for k, v in (out.get("extra_logs") or {}).items()}
    return Rollout(
        prompt_index=prompt_index,
        prompt_ids=tokens[:start],
        response_ids=tokens[start:],
        logprobs=[float(x) for x in lps[start:]] if lps is not None else [0.0] * len(mask),
        finished=True,
        engine=engine,
        action_mask=mask,
        reward=reward,
        score=reward if score is None else score,
        extra_logs={k: v for k, v in extra.items() if v is not None},
    )


def load_agent_executor(path: str) -> AgentExecutorBase:
    """Import the user's file and build its AgentExecutor(); AgentError saying what to fix otherwise."""
    if not Path(path).is_file():
        raise AgentError(f"--agent_func_path {path}: no such file")
    try:
        module = import_file(path, "orlhf_agent")
    except (Exception, SystemExit) as e:
        hint = (
            " An OpenRLHF agent file needs its import changed to `from orlhf.rollout.agent import "
            "AgentInstanceBase, MultiTurnAgentExecutor`."
            if "openrlhf" in str(e)
            else ""
        )
        raise AgentError(f"{import_failure(e, path)}{hint}") from e
    cls = getattr(module, "AgentExecutor", None)
    if not (isinstance(cls, type) and issubclass(cls, AgentExecutorBase)):
        raise AgentError(
            f"{path} must define `class AgentExecutor(MultiTurnAgentExecutor)` (or a subclass of "
            "orlhf.rollout.agent.AgentExecutorBase) whose __init__ passes your AgentInstance class"
        )
    try:
        return cls()
    except Exception as e:
        raise AgentError(f"{path}: AgentExecutor() raised {type(e).__name__}: {e}\n{user_frames(e, path)}") from e


def agent_scores(rollouts: list[Rollout]) -> Optional[list[float]]:
    """The agents' rewards, one per rollout, or None when the rollouts are single-turn (no agent reward)."""
    if not rollouts or rollouts[0].reward is None:
        return None
    return [r.reward for r in rollouts]


def agent_reward_result(rollouts: list[Rollout]):
    """rewards.RewardResult of the agents' episodes, or None for single-turn rollouts: `rewards` (the turns'
    rewards summed) train, `scores` (the last `scores` a step returned, else that sum) are what --dynamic_filtering
    compares, as OpenRLHF splits them (its MultiTurnAgentExecutor returns both; its filter reads scores)."""
    import torch

    from orlhf.inputs.rewards import RewardResult

    rewards = agent_scores(rollouts)
    if rewards is None:
        return None
    scores = [r.reward if r.score is None else r.score for r in rollouts]
    return RewardResult(
        rewards=torch.tensor(rewards, dtype=torch.float32), scores=torch.tensor(scores, dtype=torch.float32)
    )


def agent_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """Means of the agents' extra_logs (turns included) over the batch, as agent/<key>."""
    keys = sorted({k for r in rollouts for k in r.extra_logs})
    out = {}
    for k in keys:
        vals = [r.extra_logs[k] for r in rollouts if k in r.extra_logs]
        out[f"agent/{k}"] = sum(vals) / len(vals)
    return out


def turn_params_class(rollout) -> type:
    """The class of the sampling parameters agents get: the rollout backend's (RolloutBackend.turn_params: orlhf's
    TurnParams where the actor's ranks sample, so agents run on machines without vLLM), else vLLM's SamplingParams
    (`rollout` None: a test's stand-in call)."""
    if rollout is not None and rollout.turn_params is not None:
        return rollout.turn_params
    from vllm import SamplingParams

    return SamplingParams


def make_executor(
    agent_func_path: Optional[str], engines, tokenizer, max_length: int, timeout_s: float = 600.0, vision=None
):
    """vision: inputs.vision.VisionPrompts for a vision-language model's image prompts (single-turn only: agents
    with images are refused by the config's validation)."""
    if agent_func_path:
        return AgentRunner(agent_func_path, engines, tokenizer, max_length, timeout_s)
    return SingleTurnExecutor(engines, vision)
