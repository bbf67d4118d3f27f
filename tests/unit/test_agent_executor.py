"""The agent executor's logic against a fake engine (pure logic; the real engines run in tests/e2e/test_agent.py).

The fake engine answers every request with the tokens of "red " (cut at max_tokens) and log-prob -0.25 each; the
tokenizer is one token per character, so expected token sequences can be written by hand.
"""

import concurrent.futures
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from orlhf.rollout.agent import AgentError
from orlhf.rollout.executor import AgentRunner, load_agent_executor
from orlhf.types import SamplingSpec, TurnResult

pytest.importorskip("vllm")


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """call(engine, requests) -> Future of [TurnResult]; records each call's params."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.calls = delay_s, []

    def __call__(self, engine: int, requests: list):
        self.calls.append([(list(ids), p.max_tokens, p.seed) for ids, p in requests])
        fut = concurrent.futures.Future()

        def answer():
            time.sleep(self.delay_s)
            out = [ord(c) for c in "red "]
            if fut.cancelled():  # the runner stopped early (an agent raised)
                return
            fut.set_result(
                [TurnResult(out[: p.max_tokens], [-0.25] * min(4, p.max_tokens), "length", 7) for _, p in requests]
            )

        threading.Thread(target=answer).start()
        return fut


AGENT = """
import asyncio, torch
from orlhf.rollout.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    {init}
    async def reset(self, states, **kwargs):
        return {{"observation": states["observation"]}}

    async def step(self, states, **kwargs):
        self.turn += 1
        if states["label"] == "slow":
            await asyncio.sleep(0.3)
        {body}
        return {{"rewards": torch.tensor(1.0), "scores": self.turn, "environment_feedback": "ok",
                "done": self.turn >= 2, "sampling_params": states["sampling_params"], "extra_logs": {{"t": self.turn}}}}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def write_agent(tmp_path, init="def __init__(self):\n        self.turn = 0", body="pass"):
    path = tmp_path / "my_agent.py"
    path.write_text(AGENT.format(init=init, body=body))
    return str(path)


def prompts(labels):
    return [SimpleNamespace(text="Q", ids=[ord("Q")], label=lab) for lab in labels]


def run(path, labels, n=1, max_new=3, max_length=20, engine=None):
    runner = AgentRunner(
        path, engines=None, tokenizer=CharTokenizer(), max_length=max_length, call=engine or FakeEngine()
    )
    spec = SamplingSpec(temperature=1.0, max_new_tokens=max_new, n=n, seed=5)
    return runner, runner.generate(prompts(labels), spec)


def test_two_turns_token_in_token_out(tmp_path):
    engine = FakeEngine()
    runner, (r,) = run(write_agent(tmp_path), ["x"], engine=engine)
    # Q | r e d (turn 1, max 3 tokens) | o k (feedback) | r e d (turn 2) | o k
    assert r.prompt_ids == [ord("Q")]
    assert r.response_ids == [ord(c) for c in "redokredok"]
    assert r.action_mask == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0]
    assert r.logprobs == [-0.25] * 3 + [0.0] * 2 + [-0.25] * 3 + [0.0] * 2
    assert (r.reward, r.score, r.weight_version) == (2.0, 2.0, 7)  # rewards summed; scores = the last one
    assert r.extra_logs == {"t": 2.0, "turns": 2.0}
    # turn 2 generates from the whole running sequence, tokens as they were (no re-tokenization)
    assert engine.calls[1][0][0] == [ord(c) for c in "Qredok"]


def test_episode_stops_at_the_length_budget(tmp_path):
    _, (r,) = run(write_agent(tmp_path), ["x"], max_new=3, max_length=6)
    # Q + red + ok = 6 tokens: no budget left for turn 2
    assert r.response_ids == [ord(c) for c in "redok"] and r.action_mask == [1, 1, 1, 0, 0]


def test_samples_are_prompt_major_with_distinct_reproducible_seeds(tmp_path):
    engine = FakeEngine()
    _, rollouts = run(write_agent(tmp_path), ["a", "b"], n=3, engine=engine)
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1]
    seeds = [s for call in engine.calls for _, _, s in call]
    assert len(set(seeds)) == len(seeds) == 12  # 6 samples x 2 turns
    engine2 = FakeEngine()
    run(write_agent(tmp_path), ["a", "b"], n=3, engine=engine2)
    assert sorted(seeds) == sorted(s for call in engine2.calls for _, _, s in call)


def test_a_slow_environment_does_not_hold_back_the_others(tmp_path):
    engine = FakeEngine(delay_s=0.02)
    t0 = time.perf_counter()
    runner, rollouts = run(write_agent(tmp_path), ["slow"] + ["x"] * 7, engine=engine)
    wall = time.perf_counter() - t0
    assert len(rollouts) == 8 and all(r.reward == 2.0 for r in rollouts)
    sizes = [len(c) for c in engine.calls]
    assert sizes[0] == 8  # every first turn in one engine call
    assert sizes[1] == 7  # the 7 fast agents' second turns go on without the slow one
    assert 0.6 <= wall < 1.5  # the slow agent's 2 x 0.3 s, not 8 agents' worth of waiting


def test_async_init_as_in_openrlhf_files(tmp_path):
    path = write_agent(tmp_path, init="async def __init__(self, *args, **kwargs):\n        self.turn = 0")
    _, (r,) = run(path, ["x"])
    assert r.reward == 2.0


def test_a_bad_step_names_the_file_sample_and_key(tmp_path):
    path = write_agent(
        tmp_path, body='if states["label"] == "bad": return {"rewards": 1.0, "environment_feedback": ""}'
    )
    with pytest.raises(AgentError) as e:
        run(path, ["x", "bad"], n=2)
    msg = str(e.value)
    assert path in msg and "sample 2 (prompt 1 of the batch, sample 1 of 2)" in msg and "'done'" in msg


def test_a_raising_step_names_the_file_sample_and_line(tmp_path):
    path = write_agent(tmp_path, body='if states["label"] == "bad": raise KeyError("answer")')
    with pytest.raises(AgentError) as e:
        run(path, ["bad"])
    msg = str(e.value)
    assert path in msg and "sample 0" in msg and "KeyError" in msg and 'raise KeyError("answer")' in msg


def test_bad_reward_type_names_the_key(tmp_path):
    path = write_agent(tmp_path, body='return {"rewards": "high", "environment_feedback": "", "done": True}')
    with pytest.raises(AgentError, match="'rewards'"):
        run(path, ["x"])


def test_openrlhf_import_line_gets_a_hint(tmp_path):
    path = tmp_path / "openrlhf_agent.py"
    path.write_text("from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n")
    with pytest.raises(AgentError, match="from orlhf.rollout.agent import"):
        load_agent_executor(str(path))


def test_file_without_agent_executor_is_refused(tmp_path):
    path = tmp_path / "empty_agent.py"
    path.write_text("x = 1\n")
    with pytest.raises(AgentError, match="class AgentExecutor"):
        load_agent_executor(str(path))


def test_the_demo_agent_loads_and_scores_colors():
    import asyncio
    from pathlib import Path

    import orlhf

    executor = load_agent_executor(str(Path(orlhf.__file__).parent / "demo" / "agent.py"))
    agent = executor.agent_instance_cls()
    out = asyncio.run(agent.step({"action_text": " red blue cat", "label": "colors", "sampling_params": None}))
    assert abs(float(out["rewards"]) - (2 / 3) / 3) < 1e-6 and not out["done"]


SCORED_AGENT = """
import torch
from orlhf.rollout.agent import AgentInstanceBase, MultiTurnAgentExecutor

class AgentInstance(AgentInstanceBase):
    made = 0  # instances are made in sample order: a group's n samples get consecutive numbers

    def __init__(self):
        self.k, AgentInstance.made = AgentInstance.made, AgentInstance.made + 1

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        # every episode earns 0.5 over two turns; its score says whether it solved the task
        score = {"solved": 1.0, "failed": 0.0}.get(states["label"], float(self.k % 2))
        return {"rewards": torch.tensor(0.25), "scores": score, "environment_feedback": "ok",
                "done": len(states["observation_text"]) > 4, "sampling_params": states["sampling_params"]}

class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""


def test_dynamic_filtering_keeps_groups_by_the_agents_scores_and_trains_on_their_rewards(tmp_path):
    """OpenRLHF's split: the filter reads `scores`, PPO the summed `rewards`. Every group here has reward mean 0.5
    (inside the (0, 1) range): filtering on rewards would keep the first prompt, "solved", whose samples all
    score 1 and so teach nothing. On scores only the "mixed" prompt (scores 0 and 1) is kept."""
    from orlhf.trainer.dynamic_filtering import DynamicFilter
    from orlhf.trainer.scoring import Scorer

    path = tmp_path / "scored_agent.py"
    path.write_text(SCORED_AGENT)
    runner = AgentRunner(str(path), engines=None, tokenizer=CharTokenizer(), max_length=20, call=FakeEngine())

    def generate(batch, seed):
        return runner.generate(batch, SamplingSpec(temperature=1.0, max_new_tokens=2, n=2, seed=seed))

    # the controller's own scoring of agent rollouts (no reward source: the agents score)
    score = lambda rollouts, batch: Scorer.rewards(None, rollouts, batch)  # noqa: E731
    flt = DynamicFilter(batch_prompts=1, n_samples=2, reward_range=(0.0, 1.0), generate=generate, score=score)
    filled = flt.fill(iter([prompts(["solved", "failed", "mixed"])]), step_index=0)
    assert [p.label for p in filled.prompts] == ["mixed"]
    assert filled.reward.rewards.tolist() == [0.5, 0.5]  # two turns of 0.25, summed: what PPO trains on
    assert sorted(filled.reward.scores.tolist()) == [0.0, 1.0]
    assert filled.info["dynamic_filtering_pass_rate"] == 100.0 / 3


def test_agents_run_without_vllm_where_the_actor_samples(tmp_path, monkeypatch):
    """--rollout_backend trainer: agents get orlhf's TurnParams (vLLM's fields) and never import vLLM, so a machine
    without vLLM runs them (before: `from vllm import SamplingParams` in every batch of episodes)."""
    from orlhf.rollout.actor_rollout import ActorRollout
    from orlhf.types import TurnParams

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError from here on
    engine = FakeEngine()

    class Actor:  # what the executor reads of the actor's rollout (rollout/actor_rollout.py)
        turn_params = ActorRollout.turn_params

        def __len__(self):
            return 1

    runner = AgentRunner(write_agent(tmp_path), engines=Actor(), tokenizer=CharTokenizer(), max_length=20, call=engine)
    (r,) = runner.generate(prompts(["x"]), SamplingSpec(temperature=1.0, max_new_tokens=3, n=1, seed=5))
    assert r.response_ids == [ord(c) for c in "redokredok"]
    assert engine.calls[0][0][1:] == (3, engine.calls[0][0][2]) and engine.calls[0][0][2] is not None  # seeded
    assert ActorRollout.turn_params is TurnParams
    vllm_runner = AgentRunner(
        write_agent(tmp_path), engines=None, tokenizer=CharTokenizer(), max_length=20, call=engine
    )
    with pytest.raises(ImportError):  # vLLM's engines: vLLM's SamplingParams, as before
        vllm_runner.generate(prompts(["x"]), SamplingSpec(max_new_tokens=3, seed=5))


class VersionedEngines:
    """Two engines answering "red " at the weight version they hold; the test's sync bumps it. A sync is asked once
    both first calls are in flight (each first call answers only then), and every sync records how many calls were
    in flight when it ran."""

    def __init__(self):
        self.version, self.in_flight, self.calls = 7, 0, 0
        self.sync_asked, self.syncs = False, []
        self.lock, self.both_started = threading.Lock(), threading.Event()

    def __call__(self, engine: int, requests: list):
        with self.lock:
            self.in_flight += 1
            self.calls += 1
            if self.calls == 2:  # a trainer step ended while the first turns generate
                self.sync_asked = True
                self.both_started.set()
            version = self.version
        fut = concurrent.futures.Future()

        def answer():
            assert self.both_started.wait(10)
            with self.lock:
                self.in_flight -= 1
            out = [ord(c) for c in "red "]
            fut.set_result(
                [
                    TurnResult(out[: p.max_tokens], [-0.25] * min(4, p.max_tokens), "length", version)
                    for _, p in requests
                ]
            )

        threading.Thread(target=answer).start()
        return fut

    def sync(self) -> bool:
        with self.lock:
            self.syncs.append(self.in_flight)
            self.sync_asked = False
            self.version += 1
        return True


def test_partial_rollout_lets_a_sync_in_between_two_turns_with_no_engine_call_in_flight(tmp_path):
    """--partial_rollout with agents: a sync asked during the first turns runs once both engines' calls are back and
    before any second turn starts; the second turns sample at the new version, and each token keeps its turn's."""
    engines = VersionedEngines()
    runner = AgentRunner(write_agent(tmp_path), None, CharTokenizer(), max_length=20, call=engines)
    runner.num_engines = 2  # samples 0-1 on engine 0, 2-3 on engine 1
    runner.between, runner.sync_waiting = engines.sync, lambda: engines.sync_asked
    rollouts = runner.generate(prompts(["a", "b"]), SamplingSpec(temperature=1.0, max_new_tokens=3, n=2, seed=5))
    assert engines.syncs == [0]  # one sync, with nothing in flight
    assert engines.calls == 4  # the two first turns, then the second turns (one call per engine each)
    for r in rollouts:  # Q | red (v7) ok | red (v8) ok
        assert r.weight_version == 7
        assert r.token_versions == [7] * 5 + [8] * 5
