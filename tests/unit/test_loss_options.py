"""OpenRLHF 0.11.2's loss options in orlhf: the IS correction's level / mode / gating, the actor's loss aggregation,
the unbiased KL gradient. Each is checked against 0.11.2's own numbers, its refusals against validation, its dotted
names against the command line.

Golden numbers: computed once with OpenRLHF 0.11.2's code (the PyPI wheel openrlhf-0.11.2, models/loss.py
PolicyLoss.forward and aggregate_loss, models/utils.py compute_approx_kl) in float64 on the inputs below, the
gradient taken with respect to log pi. The first IS case is also derived by hand in its comment.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch

from orlhf.algo.kl import approx_kl
from orlhf.algo.losses import IsCorrection, LossNorm, aggregate, policy_loss_terms
from orlhf.cli import main
from orlhf.config.flags import build_config
from orlhf.config.resolve import resolve_device
from orlhf.config.train_config import ConfigError
from orlhf.config.worker_config import role_config, worker_config
from orlhf.workers.critic import CriticWorker
from orlhf.workers.policy import _is_cut_share


def probs(*rows):
    return torch.tensor(rows, dtype=torch.float64).log()


# Two sequences of 3 and 2 tokens (the third slot of row 1 is padding).
PI_OLD = probs([0.5, 0.9, 0.2], [0.6, 0.3, 1.0])
PI_ENGINE = probs([0.4, 0.95, 0.5], [0.1, 0.35, 1.0])  # w = pi_old / pi_engine = 1.25 .947 .4 / 6 .857
PI = [[0.55, 0.85, 0.25], [0.5, 0.33, 0.7]]  # ratio pi / pi_old = 1.1 .944 1.25 / .833 1.1
ADV = torch.tensor([[1.0, -0.5, 2.0], [-1.0, 0.5, 0.3]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def policy(agg, spec=None, eps_high=0.2, norm=None):
    """(aggregated loss, d loss / d log pi, IS cut mask) of orlhf's policy loss on the inputs above."""
    lp = probs(*PI).requires_grad_()
    t = policy_loss_terms(lp, PI_OLD, ADV, MASK, 0.2, eps_high, rollout_log_probs=PI_ENGINE, is_correction=spec)
    loss = aggregate(t.loss, MASK, agg, norm)
    loss.backward()
    return loss.item(), lp.grad, t.is_cut


# (level, mode, gating, thresholds, 0.11.2 token-mean loss, its seq-mean-token-mean loss, token-mean gradient,
#  0.11.2's is_filter_ratio). Every combination 0.11.2 accepts with a correction on.
IS_CASES = [
    # Hand: PPO per-token loss (eps 0.2): -1.1, 0.4722, -2.4 (clipped at 1.2) / 0.8333, -0.55. icepop keeps w in
    # [0.9, 2]: tokens 1 and 2 of row 0 (w 1.25, .947), so loss = (-1.1 x 1.25 + 0.4722 x .947) / 5 = -0.18553;
    # gradient -r A w / 5: -1.1 x 1.25 / 5 = -0.275, 0.944 x 0.5 x .947 / 5 = 0.08947; 3 of 5 tokens cut.
    ("token", "mask", "ratio", (0.9, 2.0), -0.1855263158, -0.1546052626,
     [[-0.275, 0.0894736842, 0.0], [0.0, 0.0, 0.0]], 0.6),
    ("token", "clip", "ratio", (0.9, 2.0), -0.3831929825, -0.2216885962,
     [[-0.275, 0.0894736842, 0.0], [0.3333333333, -0.099, 0.0]], 0.6),
    ("token", "mask", "binary_kl", (0.0, 0.018), -0.0048120301, -0.0432957390,
     [[0.0, 0.0894736842, 0.0], [0.0, -0.0942857143, 0.0]], 0.6),
    ("token", "mask", "tv", (0.0, 0.2), -0.2798120301, -0.2724624049,
     [[-0.275, 0.0894736842, 0.0], [0.0, -0.0942857143, 0.0]], 0.4),
    ("seq", "mask", "ratio", (0.5, 2.0), -0.3775263158, -0.3146052621,
     [[-0.275, 0.0894736842, 0.0], [0.0, 0.0, 0.0]], 0.5),
    ("seq", "mask", "binary_kl", (0.0, 0.3), 0.5281879699, 0.8175375894,
     [[-0.275, 0.0894736842, 0.0], [1.0, -0.0942857143, 0.0]], 0.0),
    ("seq", "mask", "tv", (0.0, 0.2), -0.3775263158, -0.3146052621,
     [[-0.275, 0.0894736842, 0.0], [0.0, 0.0, 0.0]], 0.5),
]  # fmt: skip


@pytest.mark.parametrize("level, mode, gating, thr, token_loss, seq_loss, grad, filtered", IS_CASES)
def test_is_correction_matches_openrlhf_0112(level, mode, gating, thr, token_loss, seq_loss, grad, filtered):
    spec = IsCorrection(level, mode, gating, thr)
    loss, g, cut = policy("token_mean", spec)
    assert loss == pytest.approx(token_loss, abs=1e-9)
    assert g.tolist() == [pytest.approx(row, abs=1e-9) for row in grad]
    assert policy("seq_mean", spec)[0] == pytest.approx(seq_loss, abs=1e-8)
    assert _is_cut_share(cut, MASK, level) == pytest.approx(filtered)


def test_the_v0110_names_are_points_of_the_0112_space():
    assert IsCorrection.named("tis") == IsCorrection("token", "clip", "ratio")
    assert IsCorrection.named("icepop", (0.9, 2.0)) == IsCorrection("token", "mask", "ratio", (0.9, 2.0))
    assert IsCorrection.named("seq-mask-tis").name == "seq-mask-tis"
    assert IsCorrection("seq", "mask", "tv", (0.0, 0.1)).name == "seq/mask/tv"


def test_actor_loss_aggregation_matches_openrlhf_0112():
    # 0.11.2 PolicyLoss(eps 0.2 / 0.28) with dp_size 2 and the step's 8 tokens / 4 sequences; orlhf: the same as a
    # LossNorm. Hand (token-mean): per-token -1.1, .4722, -2.5 (1.25 < 1.28: not clipped) / .8333, -.55: sum
    # -2.8444 / 8 x 2 = -0.71111.
    norm = LossNorm(tokens=8.0, seqs=4.0, scale=2.0)
    loss, g, _ = policy("token_mean", eps_high=0.28, norm=norm)
    assert loss == pytest.approx(-0.7111111111, abs=1e-9)
    assert g.tolist() == [pytest.approx([-0.275, 0.1180555556, -0.625]), pytest.approx([0.2083333333, -0.1375, 0.0])]
    # seq-mean-token-mean: (row 0's mean + row 1's mean) / 4 x 2
    loss, g, _ = policy("seq_mean", eps_high=0.28, norm=norm)
    assert loss == pytest.approx(-0.4504629616, abs=1e-8)
    assert g.tolist() == [
        pytest.approx([-0.1833333327, 0.0787037034, -0.4166666653], abs=1e-8),
        pytest.approx([0.2083333323, -0.1374999993, 0.0], abs=1e-8),
    ]


# 0.11.2 compute_approx_kl(log pi, log pi_ref, log pi_old, estimator, unbiased_gradient) then aggregate_loss
# (token mean): (value, gradient). The unbiased gradient is the same for the three estimators.
UNBIASED = [[0.1333499, 0.01145132, -0.21886718], [-0.09796445, 0.11017058, 0.0]]
KL_CASES = [
    ("k1", False, -0.05914392, [[0.2, 0.2, 0.2], [0.2, 0.2, 0.0]]),
    ("k1", True, -0.05914392, UNBIASED),
    ("k2", False, 0.17337906, [[0.12122717, 0.01212492, -0.17509376], [-0.11755734, 0.10015507, 0.0]]),
    ("k2", True, 0.17337906, UNBIASED),
    ("k3", False, 0.19939442, [[0.0909091, 0.01176471, -0.28000003], [-0.16000001, 0.07878789, 0.0]]),
    ("k3", True, 0.19939441, UNBIASED),
]


@pytest.mark.parametrize("estimator, unbiased, value, grad", KL_CASES)
def test_kl_loss_and_its_unbiased_gradient_match_openrlhf_0112(estimator, unbiased, value, grad):
    # Hand, first token: pi .55, ref .3, pi_old .5: w = 1.1, log r = ln(.55 / .3) = .60614 -> 1.1 x .60614 / 5 = .13335
    lp = probs(*PI).requires_grad_()
    ref = probs([0.3, 0.8, 0.6], [0.9, 0.2, 0.5])
    kl = aggregate(approx_kl(lp, ref, estimator, PI_OLD, unbiased), MASK)
    kl.backward()
    assert kl.item() == pytest.approx(value, abs=1e-7)  # 0.11.2 works in float32 here
    assert lp.grad.tolist() == [pytest.approx(row, abs=1e-7) for row in grad]


# ---------------------------------------------------------------- validation


def problems(**flags) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build_config(flags, explicit=set(flags))
    return err.value.problems


def refused(fragments, **flags):
    found = problems(**flags)
    assert any(all(f in p for f in fragments) for p in found), found


@pytest.mark.parametrize(
    "flags, fragments",
    [  # what OpenRLHF 0.11.2's PolicyLoss refuses
        (dict(is_correction_level="seq", is_correction_mode="clip"), ["--is_correction_mode clip", "level token"]),
        (
            dict(is_correction_level="token", is_correction_mode="clip", is_correction_gating="tv"),
            ["--is_correction_mode clip", "--is_correction_gating ratio"],
        ),
        (dict(is_correction_level="token", is_correction_gating="binary_kl"), ["binary_kl", "0 HIGH", "0.5 5.0"]),
        (
            dict(is_correction_level="seq", is_correction_gating="tv", vllm_is_truncated_threshold=(0.1, 0.2)),
            ["--is_correction_gating tv", "--vllm_is_truncated_threshold 0 HIGH"],
        ),
    ],
)
def test_combinations_openrlhf_0112_refuses_are_refused(flags, fragments):
    refused(fragments, **flags)


@pytest.mark.parametrize(
    "flags, fragments",
    [  # the two spellings asking for different corrections
        (
            dict(enable_vllm_is_correction=True, vllm_is_correction_type="icepop", is_correction_level="seq"),
            ["--vllm_is_correction_type icepop", "--is_correction_level seq", "different"],
        ),
        (dict(enable_vllm_is_correction=True, is_correction_level="off"), ["--is_correction_level off", "different"]),
        # tis is token *clip*; the new flags alone mean mask
        (
            dict(enable_vllm_is_correction=True, is_correction_level="token"),
            ["tis is --is_correction_level token --is_correction_mode clip"],
        ),
        # flags that would do nothing
        (dict(is_correction_mode="clip"), ["--is_correction_mode clip does nothing", "--is_correction_level"]),
        (dict(is_correction_gating="ratio"), ["--is_correction_gating ratio does nothing"]),
        (
            dict(policy_loss_type="gspo", is_correction_level="token", is_correction_mode="clip"),
            ["--is_correction_mode clip", "--policy_loss_type gspo"],
        ),
        (dict(kl_unbiased_gradient=True), ["--kl_unbiased_gradient", "--use_kl_loss"]),
    ],
)
def test_conflicting_or_idle_spellings_are_refused(flags, fragments):
    refused(fragments, **flags)


def actor_loss_slice(**flags):
    cfg = build_config(flags, explicit=set(flags))
    cfg = resolve_device(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, pretrain="model")), "cpu")
    return worker_config(cfg, "actor").loss


def test_accepted_spellings_reach_the_actor():
    # The two spellings agreeing: fine, one correction.
    same = actor_loss_slice(enable_vllm_is_correction=True, is_correction_level="token", is_correction_mode="clip")
    assert same.is_spec == IsCorrection.named("tis")
    assert actor_loss_slice(is_correction_level="seq").is_correction == "seq-mask-tis"
    tv = actor_loss_slice(
        is_correction_level="token", is_correction_gating="tv", vllm_is_truncated_threshold=(0.0, 0.1)
    )
    assert tv.is_spec == IsCorrection("token", "mask", "tv", (0.0, 0.1))
    assert actor_loss_slice(policy_loss_type="gspo", is_correction_level="seq").is_level == "seq"
    assert actor_loss_slice().is_spec is None
    kl = actor_loss_slice(use_kl_loss=True, kl_unbiased_gradient=True)
    assert kl.kl_unbiased_gradient and kl.use_kl_loss
    # --actor_loss_agg_mode: the policy term only; the KL and entropy terms keep --loss_agg_mode (0.11.2: token mean)
    agg = actor_loss_slice(actor_loss_agg_mode="seq-mean-token-mean")
    assert (agg.loss_agg_mode, agg.kl_entropy_agg_mode) == ("seq_mean", "token_mean")
    agg = actor_loss_slice(actor_loss_agg_mode="token_mean", loss_agg_mode="seq_mean")
    assert (agg.loss_agg_mode, agg.kl_entropy_agg_mode) == ("token_mean", "seq_mean")


# ---------------------------------------------------------------- the command line


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    return exit_.value.code, capsys.readouterr().err


def test_the_0112_dotted_names_parse(capsys, no_training):
    from orlhf.config.resolve import resolve_demo

    argv = [
        "train-ppo",
        "--device",
        "cpu",
        "--advantage_estimator",
        "gae",
        "--algo.advantage.is_correction_level",
        "seq",
        "--algo.advantage.is_correction_mode",
        "mask",
        "--algo.advantage.is_correction_gating",
        "binary_kl",
        "--algo.advantage.is_correction_threshold",
        "0",
        "0.05",
        "--actor.loss_agg_mode",
        "seq-mean-token-mean",
        "--algo.kl.use_loss",
        "--algo.kl.unbiased_gradient",
    ]
    code, err = run(argv, capsys)
    assert code == 0, err
    cfg = resolve_demo(no_training[-1])
    p = cfg.ppo
    assert (p.is_correction_level, p.is_correction_mode, p.is_correction_gating) == ("seq", "mask", "binary_kl")
    assert p.vllm_is_truncated_threshold == (0.0, 0.05) and p.kl_unbiased_gradient and p.is_correction_enabled
    actor, critic = worker_config(cfg, "actor").loss, worker_config(cfg, "critic").loss
    assert actor.is_spec == IsCorrection("seq", "mask", "binary_kl", (0.0, 0.05)) and actor.kl_unbiased_gradient
    assert actor.loss_agg_mode == "seq_mean" and critic.loss_agg_mode == "token_mean"  # the critic keeps its own


def test_the_0110_names_keep_working(capsys, no_training):
    argv = ["train-ppo", "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "icepop"]
    code, err = run([*argv, "--algo.advantage.is_correction_threshold", "0.4", "4"], capsys)
    assert code == 0, err
    p = no_training[-1].ppo
    assert p.is_correction_choice() == ("token", "mask", "ratio") and p.vllm_is_truncated_threshold == (0.4, 4.0)


def test_a_refused_0112_combination_exits_2_naming_the_flags(capsys):
    code, err = run(
        ["train-ppo", "--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode", "clip"],
        capsys,
    )
    assert code == 2 and "--is_correction_mode clip" in err and "--is_correction_level token" in err
    code, err = run(
        ["train-ppo", "--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_level", "token"], capsys
    )
    assert code == 2 and "--enable_vllm_is_correction" in err and "different IS corrections" in err


# ---------------------------------------------------------------- the logged value loss


def test_the_logged_value_loss_is_the_aggregate_optimized():
    # values 0, returns 1 on row 0 (3 tokens) and 3 on row 1 (1 token), no clip: per-token 0.5 (v - R)^2 = 0.5 / 4.5.
    # token mean (0.5 x 3 + 4.5) / 4 = 1.5; sequence mean (0.5 + 4.5) / 2 = 2.5
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    returns = torch.tensor([[1.0] * 3, [3.0, 0.0, 0.0]])
    exp = SimpleNamespace(values=None, returns=returns, action_mask=mask)  # the Experience fields _loss reads
    for mode, want in (("token_mean", 1.5), ("seq_mean", 2.5)):
        cfg = role_config("critic", model_path="m", device="cpu", loss_agg_mode=mode, value_clip=None)
        worker = SimpleNamespace(cfg=cfg, shared_prompt_train=False, _action_values=lambda mb, _: torch.zeros(2, 3))
        loss, stats = CriticWorker._loss(worker, exp, LossNorm(tokens=4.0, seqs=2.0))
        assert stats["loss"] == pytest.approx(want) and loss.item() == pytest.approx(want)


def test_is_cut_share_counts_sequences_at_seq_level():
    # rows: all cut, none cut, empty (no real token): 1 of 2 real sequences; token level: 3 of 5 real tokens
    cut = torch.tensor([[True, True, True], [False, False, False], [False, False, False]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    assert _is_cut_share(cut, mask, "seq") == 0.5 and _is_cut_share(cut, mask, "token") == pytest.approx(0.6)
    assert math.isfinite(_is_cut_share(cut, torch.zeros_like(mask), "seq"))
