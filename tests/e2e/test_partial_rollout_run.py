"""--async_train --partial_rollout end to end on the demo: real Ray, DeepSpeed and vLLM.

Responses of up to 64 tokens in segments of 8, so the weight sync after each step lands in the middle of the next
batch's generation: samples then hold tokens of two weight versions. Checked: some samples crossed a sync and their
batch counts as stale (staleness from the oldest token, so the sync guard does not judge it as on-policy), the first
batch (no sync before it) passes the guard, and every metric stays finite. The segment logic itself is unit-tested
(tests/unit/test_partial_rollout.py).

The run stops after 2 steps (--stop_after_steps, the same stop as a SIGTERM's) and is resumed: its checkpoint keeps
the batch generated ahead, whose tokens came from the weights before and after step 2's sync, and the resumed run
trains it as it was (stale by one version), not generated again from the restored weights (stale by none).
"""

import json
import math

import pytest

from orlhf.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.ray, pytest.mark.vllm]


def test_async_partial_rollout_crosses_syncs_with_finite_metrics_and_the_guard_on(ray_local, tmp_path):
    save = tmp_path / "run"
    flags = ["--async_train", "--partial_rollout", "--partial_rollout_tokens", "8", "--generate_max_len", "64"]
    for more in (["--stop_after_steps", "2"], ["--load_checkpoint"]):
        with pytest.raises(SystemExit) as exit_:
            main(["train-ppo", "--save_path", str(save), "--device", "cpu", "--max_samples", "256", "--num_episodes",
                  "1"] + flags + more)  # fmt: skip
        assert exit_.value.code == 0
    rows = [json.loads(line) for line in open(save / "metrics.jsonl")]
    assert len(rows) == 4
    for r in rows:
        assert {"token_staleness_mean", "token_staleness_max", "crossed_sync_frac"} <= set(r)
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float) and k != "engine_logprob_gap")
        assert 0 <= r["token_staleness_mean"] <= r["token_staleness_max"] <= r["staleness"] <= 1  # queue size 1
        if r["crossed_sync_frac"] > 0:  # tokens of two versions: the batch is stale by its oldest token
            assert r["staleness"] >= 1 and r["token_staleness_max"] >= 1 > r["token_staleness_mean"]
    assert rows[0]["staleness"] == 0 and rows[0]["crossed_sync_frac"] == 0  # no sync before the first batch
    assert rows[0]["engine_logprob_gap"] < 1e-3  # checked by the guard (on by default), and it passed
    assert max(r["crossed_sync_frac"] for r in rows[1:]) > 0  # syncs really landed mid-generation
    # each batch after the first began before the previous step's sync; step 3's too, kept by the checkpoint
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1] and rows[2]["generation_weight_version"] == 1
