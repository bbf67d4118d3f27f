"""The rollout backend table (config/rollout_backends.py) is the one place a backend is declared: a third backend
registered there alone is chosen by --rollout_backend, validated, laid out, planned, started by the factory and
trained with; --vllm_num_engines 0 resolves to the trainer backend in config/ only."""

from contextlib import ExitStack

import pytest

from orlhf.config import rollout_backends
from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.config.rollout_backends import ON_ENGINES, OUTSIDE, BackendSpec
from orlhf.config.train_config import ConfigError
from orlhf.config.validation import validate
from orlhf.distributed.layout import described_nodes
from orlhf.launch.bringup import run_layout
from orlhf.launch.plan import render
from orlhf.rollout.backend import backend_class
from orlhf.trainer.controller import Controller
from orlhf.trainer.models import Models
from orlhf.types import TurnParams, TurnResult
from tests.unit.rollout_stand_in import StandInRollout, three_tokens
from tests.unit.test_controller_guard import Actor, Loader, Rewards, Tokenizer

STAND_IN = "tests.unit.rollout_stand_in:StandInRollout"


def config(tmp_path, **flags):
    cfg = resolve_device(build_config({"save_path": str(tmp_path), **flags}, set(flags)), "cpu")
    validate(cfg, set(flags), local_packages=False)
    return cfg


@pytest.fixture
def stand_in(monkeypatch):
    """The one place a third backend is registered: a row of the table."""
    spec = BackendSpec(cls=STAND_IN, engine="standin", memory=ON_ENGINES, how="--rollout_backend stand-in")
    monkeypatch.setitem(rollout_backends.BACKENDS, "stand-in", spec)
    return spec


def test_num_engines_0_resolves_to_the_trainer_backend_once(tmp_path):
    assert config(tmp_path).rollout_name == "vllm"
    cfg = config(tmp_path, vllm_num_engines=0)
    assert cfg.rollout_name == "trainer" and cfg.rollout.in_actor and cfg.num_engines == 0
    assert backend_class(cfg).__name__ == "ActorRollout"
    assert run_layout(cfg).engine is None and not run_layout(cfg).engines


def test_a_registered_backend_is_validated_laid_out_planned_and_run(tmp_path, stand_in):
    batches = dict(rollout_batch_size=2, train_batch_size=2, micro_train_batch_size=1, advantage_estimator="reinforce")
    cfg = config(
        tmp_path,
        rollout_backend="stand-in",
        vllm_num_engines=2,
        init_kl_coef=0.0,
        max_engine_logprob_gap=0.0,
        **batches,
    )
    assert cfg.rollout is stand_in and cfg.num_engines == 2 and backend_class(cfg) is StandInRollout
    layout = run_layout(cfg)
    assert layout.engine == "standin" and [p.name for p in layout.pools][-2:] == ["standin0", "standin1"]
    text, ok = render(cfg, layout, described_nodes(1, 8, "cpu", None, None), "described")
    assert ok and "standin0" in text and "standin (each)" in text and "standin engine" in text

    log, actor = [], Actor([])
    with ExitStack() as stack:  # the run's start-up steps, in order, through the backend's factory
        bringup = backend_class(cfg).bringup(cfg)
        launched = bringup.launch(None, stack, None)
        bringup.before_models(launched)
        rollout = bringup.connect(launched, actor, None, stack, log.append)
    assert bringup.steps == ("start_models",) and launched is None and isinstance(rollout, StandInRollout)
    rollout.log = actor.log = log
    models = Models(actor=actor, ref=None, rollout=rollout)
    ctl = Controller(cfg, models, Loader(), Tokenizer(), metrics=None, reward_source=Rewards())
    ctl.metrics = type("M", (), {"log": lambda *a: None})()
    ctl.fit()
    assert log.count("sync") == 2 and log.count("train_step") == 2


def test_a_backend_without_engines_places_none_and_refuses_engine_flags(tmp_path, monkeypatch):
    spec = BackendSpec(cls=STAND_IN, engine=None, memory=OUTSIDE, how="--rollout_backend remote")
    monkeypatch.setitem(rollout_backends.BACKENDS, "remote", spec)
    cfg = config(tmp_path, rollout_backend="remote", async_train=True)  # generation elsewhere: it may overlap
    layout = run_layout(cfg)
    assert cfg.num_engines == 0 and layout.engine is None and not layout.engines
    text, ok = render(cfg, layout, described_nodes(1, 8, "cpu", None, None), "described")
    assert ok and "engine" not in text.split("memory estimate")[1].split("memory per process")[0]
    with pytest.raises(ConfigError, match="--enforce_eager: sets up vLLM engines, and with --rollout_backend remote"):
        config(tmp_path, rollout_backend="remote", enforce_eager=True)
    with pytest.raises(ConfigError, match="--router_replay R3 .* the backend records none"):
        config(tmp_path, rollout_backend="remote", router_replay="R3")


def test_an_unknown_backend_in_a_config_built_in_code_is_named(tmp_path):
    with pytest.raises(ConfigError, match="--rollout_backend sglang: not a rollout backend; use one of vllm, trainer"):
        config(tmp_path, rollout_backend="sglang")


def test_the_contracts_defaults_serve_agents_turns_through_generate():
    """A backend that writes only generate and load_weights still serves agents: one generate call per turn."""
    seen = []

    def generate(prompts, sampling):
        seen.append((prompts, sampling.seed, sampling.max_new_tokens, sampling.n))
        return three_tokens(prompts, sampling)

    rollout = StandInRollout(generate)
    assert len(rollout) == 1 and rollout.turn_params is TurnParams and rollout.generating_groups == ()
    turns = rollout.generate_turns(0, [([1, 2], TurnParams(seed=3, max_tokens=4)), ([9], TurnParams(seed=4))])
    assert turns.result() == [TurnResult([5, 6, 7], [-1.0] * 3, "stop", 0)] * 2
    assert seen == [([[1, 2]], 3, 4, 1), ([[9]], 4, 16, 1)]
    refused = rollout.generate_turns(0, [([1], TurnParams(seed=1, stop=["\n"]))])
    with pytest.raises(ValueError, match="sampling_params.stop = \\['\\\\n'\\]: the stand-in rollout backend samples"):
        refused.result()
