"""What crosses a process boundary. Every payload is a dataclass with its shapes in comments.

Conventions (OpenRLHF's):
    B   samples in the batch
    T   sequence length: prompt (left-padded) + response (right-padded)
    A   action positions = the last A tokens of `sequences` (the response part, padded to the longest response)
Log-probs, values, advantages etc. are per action: shape (B, A), aligned with `action_mask`. The log-prob of
token t is predicted from tokens < t, so sequences[:, -A:] are the actions and logits[:, -A-1:-1] score them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields, replace
from typing import Optional, TypeVar

import torch

R = TypeVar("R", bound="Rows")


@dataclass(frozen=True)
class SamplingSpec:
    """What one generation call samples; the same for vLLM's engines and any other generator (the HF
    `generate` of benchmarks/hybrid_engine_baseline.py)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 1024
    n: int = 1  # samples per prompt (--n_samples_per_prompt)
    max_len: Optional[int] = None  # --max_len: prompt + response at most this many tokens
    seed: int = 0  # per-step seed: each request gets a seed derived from (seed, prompt index)
    # token ids a response must not contain, kept out by a logit bias of -100 in the engines (vision-language models:
    # the image placeholder ids, which the trainer's forward would replace with image features). The engines'
    # log-probs are taken before the bias, so they stay the policy's own.
    banned_token_ids: tuple[int, ...] = ()


@dataclass
class TurnParams:
    """An agent turn's sampling parameters where no vLLM engine samples (--rollout_backend trainer): the fields of
    vLLM's SamplingParams that agents read and set, with its defaults, so an agent written for vLLM runs unchanged on
    a machine without vLLM. What the trainer's sampler cannot honour (stop strings, top_k, min_p, min_tokens) is
    refused by name when a turn asks for it (workers/generation.py check_turn_params)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    stop: Optional[list] = None
    stop_token_ids: Optional[list] = None
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True


@dataclass
class TurnResult:
    """One agent turn's generation, token in, token out: what RolloutBackend.generate_turns returns per request and
    the agent runner (rollout/executor.py) turns into vLLM's RequestOutput for the agent."""

    token_ids: list[int]  # (T,) the new tokens
    logprobs: list[float]  # (T,) the sampler's log-prob of each new token
    finish_reason: Optional[str]  # "stop" (EOS or a stop token/string), "length" (max_tokens), as vLLM says it
    weight_version: int  # the weights that sampled the turn (the controller's count of syncs)
    routed_experts: Optional[torch.Tensor] = None  # (N, L, K) int16: --router_replay R3's experts of the turn's
    #   prompt and new tokens (N of them), as Rollout.routed_experts; None where the backend records none


def request_seed(seed: int, prompt_index: int) -> int:
    """A stable per-request seed, so a run is reproducible whatever the engine count or split."""
    digest = hashlib.sha256(f"{seed}:{prompt_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def continuation_seed(prompt_seed: int, sample: int, segment: int) -> int:
    """The seed of one sample's continuation (--partial_rollout, rollout/partial.py): from its prompt's request_seed,
    its number among the prompt's samples and the segment it starts, so no two continuations share a stream."""
    digest = hashlib.sha256(f"{prompt_seed}:{sample}:{segment}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@dataclass(frozen=True)
class GenerationRequest:
    """One engine request with its own length and seed: `n` samples after `ids` (a prompt, or with
    --partial_rollout a prompt and the response so far). The rollouts come back with prompt_index = `key`."""

    key: int  # the caller's row key
    ids: list[int]  # (P,) token ids to continue
    n: int
    max_tokens: int
    seed: int
    images: tuple = ()  # vision-language prompts: the prompt's images as encoded files (bytes), in prompt order


def max_new_tokens(sampling: SamplingSpec, prompt_len: int) -> int:
    """--generate_max_len, and with --max_len at most what is left after this prompt (validation keeps it >= 1)."""
    if sampling.max_len is None:
        return sampling.max_new_tokens
    return max(1, min(sampling.max_new_tokens, sampling.max_len - prompt_len))


@dataclass
class Rollout:
    """One sampled response from a vLLM engine (token ids, not text: the trainers score exactly these)."""

    prompt_index: int  # position of the prompt in the step's prompt batch (results come back in this order)
    prompt_ids: list[int]  # (P,) prompt token ids, unpadded
    response_ids: list[int]  # (R,) generated ids, including EOS when `finished`
    logprobs: list[float]  # (R,) the engine's log-prob of each generated token (diagnostics, off-policy checks)
    finished: bool  # True when the response ended with EOS, False when cut at --generate_max_len
    engine: int = 0  # which engine generated it
    weight_version: int = 0  # actor weight version the engine held (with token_versions: the oldest token's)
    # Multi-turn agents (--agent_func_path; orlhf/rollout/executor.py). response_ids then holds every token after
    # the prompt: the model's turns and the environment's feedback between them.
    action_mask: Optional[list[int]] = None  # (R,) 1 on the model's own tokens, 0 on feedback; None: all are
    reward: Optional[float] = None  # the agent's reward for the episode (its turns' rewards summed)
    score: Optional[float] = None  # the agent's `scores` (for filtering and pass@k; defaults to reward)
    extra_logs: dict = field(default_factory=dict)  # the agent's last extra_logs, floats, logged as agent/<key>
    # (R,) --partial_rollout: the weight version each response token was sampled with (a sample continued across a
    # weight sync holds two or more); None when the whole response came from one engine call
    token_versions: Optional[list[int]] = None
    # vision-language prompts: the prompt's image tensors from the model's processor (pixel_values, ...), set by the
    # executor in the driver and shared by the prompt's samples; None for a text prompt
    vision: Optional[dict] = None
    # (N, L, K) int16 --router_replay R3: the experts the engine routed each of the first N tokens of prompt +
    # response to, per decoder layer (-1 where a layer has no router); N = P + R - 1 (the last sampled token never
    # went through the model). None when not recorded.
    routed_experts: Optional[torch.Tensor] = None


class VisionRows:
    """Per-row vision inputs of a batch (vision-language models, --max_images_per_prompt > 0): for each row, the
    model processor's tensors for its prompt's images (pixel_values, and what the family adds: pixel_attention_mask,
    image_grid_thw, ...), or None for a row without images. Rows sharing a prompt share its dict (no copy).
    A forward gets them merged: each key's tensors concatenated along dim 0 over the rows that have images, which
    is how the processors batch them (one leading row per prompt, or one per image patch group)."""

    def __init__(self, rows: list[Optional[dict[str, torch.Tensor]]]):
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __repr__(self) -> str:
        return f"VisionRows({sum(r is not None for r in self.rows)} of {len(self.rows)} rows with images)"

    def split(self, sizes: list[int]) -> list["VisionRows"]:
        out, start = [], 0
        for n in sizes:
            out.append(VisionRows(self.rows[start : start + n]))
            start += n
        return out

    def index(self, idx: torch.Tensor) -> "VisionRows":
        return VisionRows([self.rows[i] for i in idx.tolist()])

    @staticmethod
    def cat(parts: list["VisionRows"]) -> "VisionRows":
        return VisionRows([r for p in parts for r in p.rows])

    def merged(self, device: Optional[torch.device] = None) -> dict[str, torch.Tensor]:
        """{key: the rows' tensors concatenated along dim 0} over the rows with images ({} when none has any)."""
        present = [r for r in self.rows if r is not None]
        if not present:
            return {}
        return {k: torch.cat(_same_image_count([r[k] for r in present]), dim=0).to(device) for k in present[0]}


def _same_image_count(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-prompt tensors laid out (1, images, ...) (Idefics3's pixel_values and pixel_attention_mask) padded with
    all-zero images to the most images any prompt has, as the processor pads a batch itself (the model skips
    all-zero images); tensors of any other layout unchanged."""
    if len(parts) < 2 or any(p.dim() < 3 or p.shape[0] != 1 for p in parts):
        return parts
    n = max(p.shape[1] for p in parts)
    return [p if p.shape[1] == n else torch.cat([p, p.new_zeros(1, n - p.shape[1], *p.shape[2:])], 1) for p in parts]


class Rows:
    """Row-wise operations of a batch dataclass (SequenceBatch, Experience) over its tensor fields, batch dim 0.

    Tensor fields (and VisionRows fields) are split, indexed and concatenated by row; None fields stay None in every
    part; other fields (weight_version) are carried over as they are (cat: the first part's). Sequence-length dims
    must already agree across cat's parts (pad before merging).
    """

    sequences: torch.Tensor
    action_mask: torch.Tensor

    @property
    def num_actions(self) -> int:
        return self.action_mask.shape[1]

    def __len__(self) -> int:
        return self.sequences.shape[0]

    def split(self: R, sizes: list[int]) -> list[R]:
        """Split along the batch dim into chunks of the given sizes (order kept)."""
        chunks = {name: torch.split(v, sizes, dim=0) for name, v in self._tensors().items()}
        chunks.update({name: v.split(sizes) for name, v in self._vision().items()})
        return [replace(self, **{name: c[i] for name, c in chunks.items()}) for i in range(len(sizes))]

    def index(self: R, idx: torch.Tensor) -> R:
        """Rows `idx` (B',) of every tensor field, e.g. a shuffle before splitting into train batches."""
        rows = {name: v[idx] for name, v in self._tensors().items()}
        rows.update({name: v.index(idx) for name, v in self._vision().items()})
        return replace(self, **rows)

    @classmethod
    def cat(cls: type[R], parts: list[R]) -> R:
        """The parts' rows, in order."""
        first = parts[0]
        rows = {name: torch.cat([getattr(p, name) for p in parts], dim=0) for name in first._tensors()}
        rows.update({name: VisionRows.cat([getattr(p, name) for p in parts]) for name in first._vision()})
        return replace(first, **rows)

    def _tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}

    def _vision(self) -> dict[str, VisionRows]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), VisionRows)}

    def vision_inputs(self) -> dict[str, torch.Tensor]:
        """The model's vision keyword arguments for this batch's rows ({} for a text batch), on its device."""
        vision = getattr(self, "vision", None)
        return {} if vision is None else vision.merged(self.sequences.device)


@dataclass
class SequenceBatch(Rows):
    """Token sequences to score (reference, reward, critic, policy forward)."""

    sequences: torch.Tensor  # (B, T) long: prompt left-padded, response right-padded
    attention_mask: torch.Tensor  # (B, T) long/bool: 1 on real tokens
    action_mask: torch.Tensor  # (B, A) bool: 1 on real response tokens (incl. EOS)
    vision: Optional[VisionRows] = None  # (B,) vision-language models: each row's image tensors (VisionRows)
    # (B, T, L, K) int16 --router_replay: each token's experts per decoder layer, the actor's forwards route to them
    # (-1: none recorded, the trainer routes that token itself); None when off
    routing: Optional[torch.Tensor] = None


@dataclass
class Experience(Rows):
    """One PPO training batch: sequences plus everything the losses need. Built by trainer/experience.py."""

    sequences: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T)
    action_mask: torch.Tensor  # (B, A) bool
    # (B, A) float: log pi_old(a|s), the policy that generated (recomputed). None when the step is a single pass
    # (TrainConfig.single_pass): pi_old is then the current policy and the actor uses its own detached log-probs.
    action_log_probs: Optional[torch.Tensor]
    advantages: torch.Tensor  # (B, A) float
    returns: Optional[torch.Tensor] = None  # (B, A) float: critic targets (gae only)
    values: Optional[torch.Tensor] = None  # (B, A) float: V_old(s), for the clipped value loss (gae only)
    base_action_log_probs: Optional[torch.Tensor] = None  # (B, A): reference log-probs, for --use_kl_loss
    # (B, A) float: the engines' sampling log-probs, sent with --enable_vllm_is_correction (the actor's loss weights
    # tokens by pi_old / pi_engine, or GSPO's ratio uses them) and when action_log_probs is None (the actor then
    # reports the engine/trainer mismatch, engine_logprob_gap, from its training forward).
    rollout_log_probs: Optional[torch.Tensor] = None
    weight_version: int = 0  # actor weight version the engines generated with (async staleness bookkeeping)
    vision: Optional[VisionRows] = None  # (B,) vision-language models: each row's image tensors (VisionRows)
    routing: Optional[torch.Tensor] = None  # (B, T, L, K) int16 --router_replay, as SequenceBatch.routing

    def as_sequence_batch(self) -> SequenceBatch:
        return SequenceBatch(self.sequences, self.attention_mask, self.action_mask, self.vision, self.routing)


@dataclass
class TrainStats:
    """Means over one train_step call's micro-batches (one rank; the controller averages ranks)."""

    loss: float  # policy loss (actor) or value loss (critic)
    lr: float
    grad_norm: float = 0.0
    clip_frac: float = 0.0  # share of action tokens whose ratio (or value) was clipped
    approx_kl: float = 0.0  # mean (log pi_old - log pi) on action tokens: how far this step moved
    entropy: float = 0.0  # actor only: mean per-token entropy of the policy (a loss term with --entropy_loss_coef)
    kl_loss: float = 0.0  # actor only, with --use_kl_loss
    micro_steps: int = 0
    kl_coef: float = 0.0  # actor only: the KL-loss coefficient this step used (--use_kl_loss)
    clip_frac_low: float = 0.0  # actor: share of tokens clipped at 1 - eps_low (A < 0)
    clip_frac_high: float = 0.0  # actor: share of tokens clipped at 1 + eps_high (A > 0)
    is_cut_frac: float = 0.0  # actor, IS correction: share of tokens whose weight was truncated or masked
    extra: dict = field(default_factory=dict)
