"""The demo's reward: the share of the response's words that belong to a target category (colors by default).

This file is also a template for your own rule-based reward. orlhf loads any python file that defines

    reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> torch.Tensor  # float32, (B,)

- queries[i]: the decoded prompt + response of sample i (the prompt exactly as the model saw it).
- prompts[i]: the decoded prompt of sample i, so `queries[i][len(prompts[i]):]` is the response.
- labels[i]: the dataset's label column for that row ("" when the dataset has none).
It returns one scalar reward per sample, higher is better. It runs in the trainer's process: keep it pure
(no state between calls) and cheap (it is called once per rollout batch). It imports nothing from orlhf, so
you can copy it anywhere.

Why this signal: a randomly initialised tiny model emits a near-uniform mix of its ~1000 tokens, and ~40 of
them are color words, so it starts at a low but nonzero reward (about 0.05) and can climb to 1.0 by learning
to say only color words. That is learnable in minutes of PPO on a laptop CPU, so the demo shows the curve go
up without any downloads.
"""

import re

import torch

# One word belongs to one category only (no "orange" the fruit), so the label picks an unambiguous target.
CATEGORIES: dict[str, frozenset[str]] = {
    "colors": frozenset(
        "red blue green yellow orange purple pink brown black white gray gold silver cyan teal navy maroon olive "
        "lime violet indigo beige tan coral crimson amber ivory magenta turquoise lavender scarlet azure bronze "
        "copper emerald ruby jade khaki lilac ochre".split()
    ),
    "animals": frozenset(
        "cat dog cow pig horse sheep goat duck hen fox wolf bear lion tiger mouse rat frog toad fish bird owl crow "
        "hawk eagle deer moose bat bee ant snake shark whale seal otter rabbit camel zebra monkey panda koala".split()
    ),
    "numbers": frozenset(
        "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    ),
    "food": frozenset(
        "bread rice soup cake pie milk cheese egg apple banana grape pear cherry lemon melon mango berry carrot "
        "potato tomato onion bean corn pea nut honey butter jam tea coffee juice salad pasta pizza cookie candy "
        "sugar salt pepper steak".split()
    ),
}
DEFAULT_LABEL = "colors"  # used when a label is missing, empty or not a category name

# Special tokens (<s>, </s>, <pad>, <unk>) may survive decoding when the trainer keeps them; they are not words.
_SPECIAL = re.compile(r"<[^<>\s]*>")
# Words are runs of letters: punctuation and stray byte tokens separate words but are not counted as words.
_WORD = re.compile(r"[a-z]+")


def response_of(query: str, prompt: str | None) -> str:
    """The response part of a query: what follows the prompt, or the whole query if it does not start with it."""
    if prompt and query.startswith(prompt):
        return query[len(prompt) :]
    return query


def words_of(text: str) -> list[str]:
    return _WORD.findall(_SPECIAL.sub(" ", text.lower()))


def target_share(response: str, label: str | None = None) -> float:
    """Fraction of the response's words in the label's category; 0.0 for a response with no words."""
    targets = CATEGORIES.get((label or "").strip().lower(), CATEGORIES[DEFAULT_LABEL])
    words = words_of(response)
    if not words:
        return 0.0
    return sum(w in targets for w in words) / len(words)


def reward_func(queries: list[str], prompts: list[str] | None = None, labels: list[str] | None = None) -> torch.Tensor:
    """Rewards in [0, 1], float32, shape (len(queries),). See the module docstring for the contract."""
    n = len(queries)
    prompts = list(prompts) if prompts is not None else [None] * n
    labels = list(labels) if labels is not None else [None] * n
    if len(prompts) != n or len(labels) != n:
        raise ValueError(
            f"reward_func got {n} queries, {len(prompts)} prompts and {len(labels)} labels; "
            "pass one prompt and one label per query"
        )
    scores = [target_share(response_of(q, p), lab) for q, p, lab in zip(queries, prompts, labels)]
    return torch.tensor(scores, dtype=torch.float32)
