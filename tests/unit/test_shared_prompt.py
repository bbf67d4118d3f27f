"""Running each distinct prompt once (orlhf/workers/shared_prompt.py) gives the plain forward's logits and
gradients, on fewer positions; scoring keeps a prompt's rows in one micro-batch."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from orlhf.types import SequenceBatch
from orlhf.workers.batching import sort_by_length
from orlhf.workers.causal_lm import action_logits, model_logits
from orlhf.workers.shared_prompt import (
    MIN_COMMON,
    check_batches,
    common_head,
    prompt_groups,
    prompt_major_order,
    same_as_plain,
)

V, PAD = 48, 0


def _batch(prompts: list[list[int]], responses: list[list[int]]) -> SequenceBatch:
    """Left-padded prompts + right-padded responses, as rollouts_to_batch lays them out."""
    p, a = max(map(len, prompts)), max(map(len, responses))
    seq = torch.full((len(prompts), p + a), PAD)
    mask = torch.zeros(len(prompts), p + a, dtype=torch.long)
    for i, (q, r) in enumerate(zip(prompts, responses)):
        seq[i, p - len(q) : p], mask[i, p - len(q) : p] = torch.tensor(q), 1
        seq[i, p : p + len(r)], mask[i, p : p + len(r)] = torch.tensor(r), 1
    return SequenceBatch(seq, mask, mask[:, p:].bool())


def test_prompt_groups_by_tokens_and_padding():
    a, b = [5, 6, 7], [9, 7]
    batch = _batch([a, b, a, b, a, [5, 6, 8]], [[10, 11]] * 6)
    first, spread = prompt_groups(batch)
    # numbered by first appearance; [5, 6, 8] differs only in its last column, which the response pass runs per row
    assert first.tolist() == [0, 1] and spread.tolist() == [0, 1, 0, 1, 0, 0]
    # the same tokens at another padding offset are another prompt
    shifted = _batch([[9, 7], [4, 9, 7]], [[10], [10]])
    assert prompt_groups(shifted) is None
    assert prompt_groups(_batch([[5], [5]], [[1], [2]])) is None  # one prompt column: nothing to run ahead
    assert prompt_groups(_batch([[5, 6], [7, 6]], [[1], [2]])) is None  # all distinct


def test_sort_keeps_a_prompts_rows_together_by_its_longest_row():
    batch = _batch([[1, 2, 3], [4, 5], [1, 2, 3], [4, 5], [6, 7, 8, 9]], [[1], [1, 2, 3], [1, 2], [1], [1]])
    _, groups = prompt_groups(batch)
    # real lengths 4, 5, 5, 3, 5: groups {0, 2} longest 5, {1, 3} longest 5, {4} 5: ties by first appearance
    assert sort_by_length(batch, groups).tolist() == [0, 2, 1, 3, 4]
    assert sort_by_length(batch).tolist() == [3, 0, 1, 2, 4]  # without groups: by each row's own length


def test_prompt_major_order_shuffles_prompts_not_rows():
    prompts = [[i, i + 1, i + 2] for i in range(4, 40, 3)]  # 12 prompts x 4 samples, prompt-major
    batch = _batch([q for q in prompts for _ in range(4)], [[1, 2]] * 48)
    orders = [prompt_major_order(batch, torch.Generator().manual_seed(s)) for s in range(3)]
    for order in orders:
        assert sorted(order.tolist()) == list(range(48))
        blocks = order.view(12, 4)  # every 4 consecutive rows: one prompt's samples, in their order
        assert (blocks == blocks[:, :1] + torch.arange(4)).all() and (blocks[:, 0] % 4 == 0).all()
    assert orders[0].tolist() != orders[1].tolist()  # the prompts' order is random
    distinct = _batch([[5, 6], [7, 6], [8, 6]], [[1]] * 3)  # nothing shared: a plain row shuffle
    assert sorted(prompt_major_order(distinct, torch.Generator().manual_seed(0)).tolist()) == [0, 1, 2]


@pytest.fixture(scope="module")
def lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=V,
        max_position_embeddings=64,
        pad_token_id=PAD,
        initializer_range=0.5,
    )  # large weights: logits that differ clearly between positions
    model = LlamaForCausalLM(cfg).eval()
    model.config.use_cache = False  # as workers load it (causal_lm.load_causal_lm)
    return model


def _grpo_batch() -> SequenceBatch:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, V, (n,), generator=g).tolist() for n in (5, 3, 7)]
    rows = [q for q in prompts for _ in range(3)]
    responses = [torch.randint(4, V, (6 - (i % 4),), generator=g).tolist() for i in range(len(rows))]
    return _batch(rows, responses)


def _positions_seen(model, fn) -> tuple[torch.Tensor, int]:
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(i[0].numel()))
    try:
        out = fn()
    finally:
        hook.remove()
    return out, sum(seen)


def test_shared_forward_equals_plain_on_fewer_positions(lm):
    batch = _grpo_batch()
    with torch.no_grad():
        plain, n_plain = _positions_seen(lm, lambda: action_logits(lm, batch, 1.0))
        shared, n_shared = _positions_seen(lm, lambda: action_logits(lm, batch, 1.0, shared=True))
    real = batch.action_mask
    assert plain.shape == shared.shape
    assert (plain[real] - shared[real]).abs().max() < 1e-5
    assert float(plain[real].std()) > 0.5  # the check above compares logits that vary
    # 9 rows of 7 + 6 columns plain; 3 prompts x 6 columns, then 9 rows x 6 action columns shared
    assert n_plain == 9 * 13 and n_shared == 3 * 6 + 9 * 6


def _assert_same_gradients(lm, batch: SequenceBatch) -> None:
    """The shared forward's parameter gradients equal the plain forward's for a weighted sum of token log-probs."""
    weights = torch.randn(batch.action_mask.shape, generator=torch.Generator().manual_seed(1))

    def grads(shared: bool) -> dict:
        lm.zero_grad()
        logits, offset = model_logits(lm, batch, shared=shared)
        lp = torch.log_softmax(logits[:, offset : offset + batch.num_actions], -1)
        tok = lp.gather(-1, batch.sequences[:, -batch.num_actions :, None]).squeeze(-1)
        (tok * weights * batch.action_mask).sum().backward()
        return {n: p.grad.clone() for n, p in lm.named_parameters()}

    plain, shared = grads(False), grads(True)
    for name in plain:
        scale = 1.0 + float(plain[name].abs().max())
        assert (plain[name] - shared[name]).abs().max() <= 1e-5 * scale, name


def test_shared_forward_gradients_equal_plain(lm):
    _assert_same_gradients(lm, _grpo_batch())


def test_common_head_of_left_padded_prompts():
    batch = _batch([[7, 8, 9, 5], [7, 8, 9, 6, 4], [7, 8, 5]], [[1]] * 3)
    ids, mask = batch.sequences[:, :-1], batch.attention_mask[:, :-1]
    assert common_head(ids, mask) == 2  # 7 8, each at its own first real column
    assert common_head(ids[:1], mask[:1]) == 0  # one prompt: nothing in common with another
    holed = mask.clone()
    holed[1, 2] = 0  # a zero among a row's real columns: no head is read from it
    assert common_head(ids, holed) == 0


def _templated_batch() -> SequenceBatch:
    """3 prompts beginning with the same MIN_COMMON + 2 tokens (a chat template's system prompt), remainders of
    1, 3 and 4 tokens, 3 samples each, responses of 3-6 tokens."""
    g = torch.Generator().manual_seed(5)
    head = torch.randint(4, V, (MIN_COMMON + 2,), generator=g).tolist()
    prompts = [head + torch.randint(4, V, (n,), generator=g).tolist() for n in (1, 3, 4)]
    rows = [q for q in prompts for _ in range(3)]
    responses = [torch.randint(4, V, (6 - (i % 4),), generator=g).tolist() for i in range(len(rows))]
    return _batch(rows, responses)


def test_a_common_head_runs_once_with_the_plain_logits_and_gradients(lm):
    batch = _templated_batch()
    with torch.no_grad():
        plain, n_plain = _positions_seen(lm, lambda: action_logits(lm, batch, 1.0))
        shared, n_shared = _positions_seen(lm, lambda: action_logits(lm, batch, 1.0, shared=True))
    real = batch.action_mask
    assert (plain[real] - shared[real]).abs().max() < 1e-5 and float(plain[real].std()) > 0.5
    # plain: 9 rows x (14 prompt + 6 action columns); shared: the 10-token head once, the 3 prompts' remainders
    # but their last column (0, 2, 3: left-padded to 3), then 9 rows x 6 columns from each prompt's last token
    assert n_plain == 9 * 20 and n_shared == 10 + 3 * 3 + 9 * 6
    _assert_same_gradients(lm, batch)


def test_the_start_up_check_runs_the_common_head_pass(lm):
    """Its second batch takes the two-pass prompt: the head once (MIN_COMMON), then both prompts' remainders."""
    _, with_head = check_batches(V, torch.device("cpu"))
    with torch.no_grad():
        _, seen = _positions_seen(lm, lambda: action_logits(lm, with_head, 1.0, shared=True))
    assert seen == MIN_COMMON + 2 * 4 + 4 * 4  # remainders of 4 and 2 columns (left-padded to 4), 4 rows x 4


def test_the_start_up_check_accepts_the_real_forward_and_refuses_a_wrong_one(lm):
    plain = lambda b: action_logits(lm, b, 1.0)  # noqa: E731
    shared = lambda b: action_logits(lm, b, 1.0, shared=True)  # noqa: E731
    assert same_as_plain(plain, shared, V, torch.device("cpu"), float32=True)

    def off_by_one(b: SequenceBatch) -> torch.Tensor:  # positions one column late: what a broken cache would give
        out = shared(b)
        return torch.cat([out[:, :1], out[:, :-1]], 1)

    assert not same_as_plain(plain, off_by_one, V, torch.device("cpu"), float32=True)
    assert not same_as_plain(plain, lambda b: None, V, torch.device("cpu"), float32=True)


def test_value_model_outputs_through_the_last_column_equal_whole_rows(lm):
    from transformers import LlamaModel

    from orlhf.workers.critic import ValueModel, shared_values

    torch.manual_seed(1)
    head = torch.nn.Linear(lm.config.hidden_size, 1, bias=False)
    model = ValueModel(LlamaModel(lm.config).eval(), head).eval()
    batch = _grpo_batch()
    a = batch.num_actions
    with torch.no_grad():
        whole, n_whole = _positions_seen(model.backbone, lambda: model(batch.sequences, batch.attention_mask))
        critic = shared_values(model, batch)  # columns P-1 .. T-2: the critic's
        reward, n_shared = _positions_seen(model.backbone, lambda: shared_values(model, batch, through_last=True))
    assert critic.shape == (9, a) and reward.shape == (9, a + 1)
    assert (critic - whole[:, -a - 1 : -1]).abs().max() < 1e-5
    assert (reward - whole[:, -a - 1 :]).abs().max() < 1e-5
    assert n_whole == 9 * 13 and n_shared == 3 * 6 + 9 * 7


def test_no_cache_means_no_shared_forward_and_the_check_says_no(lm):
    """transformers trains without a cache under gradient checkpointing: the shared forward then reports that it
    did not run (None), so the start-up check refuses it instead of passing on the plain forward's numbers."""
    from orlhf.workers.causal_lm import shared_action_logits

    batch = _grpo_batch()
    assert shared_action_logits(lm, batch) is not None
    lm.gradient_checkpointing_enable()
    lm.train()
    try:
        with torch.no_grad():
            assert shared_action_logits(lm, batch) is None
        assert not same_as_plain(
            lambda b: action_logits(lm, b, 1.0),
            lambda b: shared_action_logits(lm, b),
            V,
            torch.device("cpu"),
            float32=True,
        )
    finally:
        lm.gradient_checkpointing_disable()
        lm.eval()


def test_a_process_checks_each_model_once_and_keeps_the_verdict(lm, monkeypatch):
    """The reference hosted in the actor's rank process takes the actor's verdict (same class, config, precision):
    the check's forwards run once; another precision, kind or model is checked again, and a refusal is kept too."""
    from types import SimpleNamespace

    from orlhf.workers import shared_prompt

    monkeypatch.setattr(shared_prompt, "_verdicts", {})
    forwards = []

    def worker(model=lm, bf16=False):
        cfg = SimpleNamespace(shared_prompt=True, packing_samples=False, bf16=bf16, role="actor")
        return SimpleNamespace(
            cfg=cfg, zero3=False, world_size=1, engine=model, module=model, device=torch.device("cpu")
        )

    def plain(b):
        forwards.append(1)
        return action_logits(lm, b, 1.0)

    shared = lambda b: action_logits(lm, b, 1.0, shared=True)  # noqa: E731
    late = lambda b: torch.roll(shared(b), 1, dims=1)  # noqa: E731 - a broken cache's positions
    checks = len(check_batches(V, torch.device("cpu")))

    assert shared_prompt.worker_shares_prompts(worker(), plain, shared, kind="logits") and len(forwards) == checks
    assert shared_prompt.worker_shares_prompts(worker(), plain, shared, kind="logits") and len(forwards) == checks
    assert shared_prompt.worker_shares_prompts(worker(bf16=True), plain, shared, kind="logits")
    assert len(forwards) == 2 * checks
    assert not shared_prompt.worker_shares_prompts(worker(), plain, late, kind="broken")
    refused = len(forwards)
    assert refused > 2 * checks  # checked (it stops at the first batch that differs)
    assert not shared_prompt.worker_shares_prompts(worker(), plain, shared, kind="broken")  # the kept refusal
    assert len(forwards) == refused
    assert shared_prompt.worker_shares_prompts(worker(), plain, shared) and len(forwards) == refused + checks  # no kind
    other = type(lm)(lm.config.__class__(**{**lm.config.to_dict(), "num_hidden_layers": 1})).eval()
    assert shared_prompt.worker_shares_prompts(worker(other), plain, shared, kind="logits")
    assert len(forwards) == refused + 2 * checks
