"""--router_replay: the actor's mixture-of-experts routers follow recorded experts instead of choosing their own.

    R3  the vLLM engines record the experts each token of a sampled sequence went to (Rollout.routed_experts); the
        batch carries them (SequenceBatch.routing, (B, T, L, K)) and the actor's old-log-prob and training forwards
        route every recorded token to them: the trainer scores the samples with the network that sampled them
    R2  the actor's old-log-prob forward records its own routing (`recording`), which travels with the experience to
        the training forwards: every optimizer step of a batch routes its tokens as the first forward did

A forward hook on each router (transformers' <Family>TopKRouter, whose output is (logits, weights, experts)) changes
its output while a forward runs inside `routed(model, batch, pick)`:
    experts  the recorded ones where a token has them (all K >= 0), else the router's own choice
    weights  the trainer's own: softmax(logits) taken at those experts, renormalized over them as the family does
             (inputs/model_files.py REPLAYED_MOE_FAMILIES), in the router's dtype. Only the choice of experts is
             replayed; the gate weights and their gradient stay the trainer's, as in verl's and slime's replay.
`pick` takes from any (b, T, ...) tensor the tokens the forward runs, the way the call takes its input ids from
batch.sequences (plain: all; packed: the real ones; the shared-prompt passes: their columns), so the targets follow
every forward path. A backward that recomputes a forward (gradient checkpointing) gets the last forward's targets.

Statistics of the replayed forwards (`take_stats`): of the tokens whose outputs score the response (the last prompt
token and every response token but the last), those with recorded experts, and those among them whose experts the
routers would have chosen otherwise in some layer (what the replay changed).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator, Optional

import torch
from torch import nn

from orlhf.inputs.model_files import REPLAYED_MOE_FAMILIES
from orlhf.types import SequenceBatch
from orlhf.workers.shared_prompt import prompt_groups

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass
class _Forward:
    """What the hooks read during one forward call (N: the tokens the routers see)."""

    targets: Optional[torch.Tensor] = None  # (N, L, K) replay: recorded experts, -1 where none
    counted: Optional[torch.Tensor] = None  # (N,) bool: tokens scoring the response (the statistics count these)
    slots: Optional[torch.Tensor] = None  # (N,) record: where each token's row goes in RouterReplay.recording
    differ: Optional[torch.Tensor] = None  # (N,) bool: the router's own choice differs in some layer
    have: Optional[torch.Tensor] = None  # (N,) bool: the token has recorded experts


class RouterReplay:
    """The hooks on one model's routers (module docstring). `mode`: "R2" or "R3" (--router_replay)."""

    def __init__(self, model: nn.Module, mode: str):
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        rule = REPLAYED_MOE_FAMILIES.get(config.model_type)
        if rule is None:
            raise ValueError(
                f"--router_replay: {config.model_type} is not a mixture-of-experts family orlhf replays "
                f"({', '.join(REPLAYED_MOE_FAMILIES)})"
            )
        self.mode = mode
        self.renorm = rule == "always" or bool(getattr(config, "norm_topk_prob", False))
        self.layers, self.top_k = config.num_hidden_layers, config.num_experts_per_tok
        self.routers = [(int(LAYER.search(n).group(1)), m) for n, m in model.named_modules() if _is_router(n, m)]
        if not self.routers:
            raise ValueError(f"--router_replay: no router found in the {config.model_type} model")
        for layer, module in self.routers:
            module.register_forward_hook(self._hook(layer))
        self._now: Optional[_Forward] = None
        self._last: Optional[_Forward] = None  # for a backward's recompute
        self.recording: Optional[torch.Tensor] = None  # (slots, L, K) int16 while R2 records
        self.recorded: Optional[torch.Tensor] = None  # (B, T, L, K) int16: R2's last recording
        self.differ, self.counted = 0, 0

    # ---- one forward call ----
    @contextmanager
    def forward(self, picked: torch.Tensor, counted: torch.Tensor) -> Iterator[None]:
        """picked: the forward's tokens' rows of batch.routing (replay) or their slots (record); counted: which of
        them score the response."""
        if self.recording is not None:
            now = _Forward(slots=picked.reshape(-1).to(self.recording.device, torch.long))
        else:
            now = _Forward(targets=picked.reshape(-1, self.layers, self.top_k), counted=counted.reshape(-1))
        self._now = now
        try:
            yield
        finally:
            self._now, self._last = None, now
            if now.differ is not None:
                have = now.have & now.counted.to(now.have.device)
                self.differ += int((now.differ & have).sum())
                self.counted += int(have.sum())

    def take_stats(self) -> dict[str, float]:
        """{routing_differ_sum, routing_tokens} since the last call (module docstring)."""
        out = {"routing_differ_sum": float(self.differ), "routing_tokens": float(self.counted)}
        self.differ, self.counted = 0, 0
        return out

    @contextmanager
    def recording_into(self, batch: SequenceBatch) -> Iterator[SequenceBatch]:
        """R2's first forward: yields `batch` whose routing holds each token's slot, and fills
        `recorded` (B, T, L, K) int16 with the experts the routers chose (-1 where no forward ran a token: padding,
        and the last column under the shared-prompt forward, whose output scores nothing)."""
        b, t = batch.sequences.shape
        device = batch.sequences.device
        self.recording = torch.full((b * t, self.layers, self.top_k), -1, dtype=torch.int16, device=device)
        slots = torch.arange(b * t, device=device).view(b, t, 1, 1)
        try:
            yield replace(batch, routing=slots)
            self.recorded = _spread_prompts(self.recording.view(b, t, self.layers, self.top_k).cpu(), batch)
        finally:
            self.recording = None

    # ---- the hook ----
    def _hook(self, layer: int) -> Callable:
        def hook(module: nn.Module, args, out):
            now = self._now
            if now is None and torch._C._current_graph_task_id() != -1:  # a backward recomputing the last forward
                now = self._last
            if now is None:
                return None
            logits, weights, experts = out
            if now.slots is not None:
                self.recording[now.slots, layer] = experts.to(torch.int16)
                return None
            return self._replay(now, layer, logits, weights, experts)

        return hook

    def _replay(self, now: _Forward, layer: int, logits, weights, experts):
        target = now.targets[:, layer].to(experts.device, torch.long)  # (N, K)
        if target.shape != experts.shape:
            raise RuntimeError(
                f"--router_replay: layer {layer}'s router sees {tuple(experts.shape)} tokens x experts, the recorded "
                f"ones are {tuple(target.shape)}: the targets do not follow this forward's tokens"
            )
        have = (target >= 0).all(-1)  # (N,)
        chosen = torch.where(have[:, None], target, experts)
        w = torch.softmax(logits.float(), dim=-1).gather(1, chosen)
        if self.renorm:
            w = w / w.sum(-1, keepdim=True)
        w = torch.where(have[:, None], w.to(weights.dtype), weights)
        if torch._C._current_graph_task_id() == -1:  # counted once, not again in a recompute
            differ = (experts.sort(-1).values != target.sort(-1).values).any(-1) & have
            now.differ = differ if now.differ is None else now.differ | differ
            now.have = have if now.have is None else now.have | have
        return logits, w, chosen


def _spread_prompts(recorded: torch.Tensor, batch: SequenceBatch) -> torch.Tensor:
    """The shared-prompt forward runs a prompt's columns once, for the first row that has it: the rows that share it
    get that row's experts there (the same tokens under the same weights)."""
    groups = prompt_groups(batch)
    if groups is None:
        return recorded
    _, spread = groups
    head = recorded[:, : batch.sequences.shape[1] - batch.num_actions - 1]  # (B, P-1, L, K)
    index = spread.cpu().view(-1, 1, 1, 1).expand_as(head).long()
    best = torch.full((int(spread.max()) + 1, *head.shape[1:]), -1, dtype=head.dtype)
    best = best.scatter_reduce(0, index, head, "amax")  # a row that ran it holds the experts, the others -1
    recorded[:, : head.shape[1]] = best[spread.cpu()]
    return recorded


def _is_router(name: str, module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and LAYER.search(name) is not None


def replay_of(model: nn.Module) -> Optional[RouterReplay]:
    """The RouterReplay installed on `model` (a DeepSpeed engine or the model it wraps), or None."""
    return getattr(getattr(model, "module", model), "router_replay", None)


def install(model: nn.Module, mode: str) -> nn.Module:
    """Hooks on `model`'s routers (the module DeepSpeed then wraps: replay_of finds them through the engine)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft wraps the HF model
    model.router_replay = RouterReplay(base, mode)
    return model


@contextmanager
def routed(model: nn.Module, batch: SequenceBatch, pick: Callable[[torch.Tensor], torch.Tensor] = lambda x: x):
    """Run a forward of `model` inside: its routers follow batch.routing on the tokens `pick` takes from a (b, T, ...)
    tensor, as the forward takes its input ids from batch.sequences. Nothing changes without a RouterReplay on the
    model or recorded experts in the batch."""
    replay = replay_of(model)
    if replay is None or batch.routing is None:
        yield
        return
    scoring = torch.zeros(batch.sequences.shape, dtype=torch.bool, device=batch.sequences.device)
    scoring[:, -batch.num_actions - 1 : -1] = batch.action_mask.bool()  # the tokens whose outputs score the actions
    with replay.forward(pick(batch.routing), pick(scoring)):
        yield
