"""The VLM demo's reward: does the response name the colour of the shape in the image (the row's label)?

A reward function file as orlhf/demo/reward.py describes (that file has the contract):

    reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> torch.Tensor  # float32, (B,)

Scores, per response:
    1.0  it names the label's colour and no other colour ("red", "it is red. red")
    0.1  it names a colour, but a wrong one or several ("blue", "red or blue")
    0.0  it names no colour
The small credit for any colour word gives a randomly initialised model, which rarely says one, a first step to
climb; only the right colour alone scores full marks, so the optimum needs the image. It imports nothing from
orlhf, so you can copy it anywhere.
"""

import re

import torch

COLOURS = frozenset(["red", "green", "blue", "yellow", "purple", "orange", "white", "black"])  # orlhf/demo/vlm.py
RIGHT, OTHER_COLOUR, NO_COLOUR = 1.0, 0.1, 0.0

# Special tokens (<|im_end|>, <|image_pad|>, ...) may survive decoding; they are not words.
_SPECIAL = re.compile(r"<\|?[^<>\s]*\|?>")
_WORD = re.compile(r"[a-z]+")


def response_of(query: str, prompt: str | None) -> str:
    """The response part of a query: what follows the prompt, or the whole query if it does not start with it."""
    if prompt and query.startswith(prompt):
        return query[len(prompt) :]
    return query


def colour_score(response: str, label: str) -> float:
    named = {w for w in _WORD.findall(_SPECIAL.sub(" ", response.lower())) if w in COLOURS}
    if not named:
        return NO_COLOUR
    return RIGHT if named == {label.strip().lower()} else OTHER_COLOUR


def reward_func(queries: list[str], prompts: list[str] | None = None, labels: list[str] | None = None) -> torch.Tensor:
    """Rewards in [0, 1], float32, shape (len(queries),). See the module docstring for the scores."""
    n = len(queries)
    prompts = list(prompts) if prompts is not None else [None] * n
    if labels is None or len(labels) != n or len(prompts) != n:
        raise ValueError(
            f"reward_func got {n} queries, {len(prompts)} prompts and {'no' if labels is None else len(labels)} "
            "labels; pass one prompt and one label (the image's colour, --label_key label) per query"
        )
    for label in labels:
        if (label or "").strip().lower() not in COLOURS:
            raise ValueError(f"reward_func: label {label!r} is not one of the demo's colours {sorted(COLOURS)}")
    scores = [colour_score(response_of(q, p), lab) for q, p, lab in zip(queries, prompts, labels)]
    return torch.tensor(scores, dtype=torch.float32)
