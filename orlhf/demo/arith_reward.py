"""Reward of the real-model demo's arithmetic task: 1.0 when the response's last integer is the answer, else 0.0.

A rule anyone can check: the model may show its working ("42 + 7 = 49") or answer bare ("49"), but the last
number it writes within the token budget must be the sum. `orlhf make-demo --real DIR` copies this file to
DIR/reward_func.py (--remote_rm_url); labels are the rows' "answer" field (--label_key answer).
"""

import re

import torch

_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str):
    """The last integer written in `text` (as written, e.g. "049" stays "049"), or None."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> torch.Tensor:
    """(B,) 0/1: queries[i] is prompts[i] + response i; labels[i] the answer as a string."""
    scores = [float(last_integer(q[len(p) :]) == str(label).strip()) for q, p, label in zip(queries, prompts, labels)]
    return torch.tensor(scores)
