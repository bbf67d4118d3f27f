"""LoRA on a trained model (peft): the adapter, the reference as the base weights, what the engines load, exports.

    model --apply_lora--> peft model: only lora_A / lora_B train (the critic's value head trains whole)
    reference log-probs:  the actor's own forward inside adapter_off(model): its base weights, no second copy
    weight sync:          per decoder layer, the adapted modules (and the ones vLLM fuses with them: q/k/v into
                          qkv_proj, gate/up into gate_up_proj) as W + scaling * B @ A, in the base model's names
    export:               the adapter in PEFT's format (PeftModel.from_pretrained loads it); merged on request
    QLoRA (--load_in_4bit): the frozen base in bitsandbytes NF4 on the GPU; syncs send every quantized module
                          dequantized (merged where adapted), so the engines run the weights the trainer runs

Why merged weights and not vLLM's own LoRA loading: the engines then run the plain model they were started with
(no LoRA kernels, no max_lora_rank, no adapter id on every request), the sync reuses the full fine-tuning path
(NCCL | gloo | CUDA IPC, layerwise reload), and only the adapted modules move: a subset of the layers' weights,
never the embeddings or the head. vLLM's layerwise reload keeps the modules a sync leaves out as they are, but a
fused module must get all of its parts, or the parts not sent would be left uninitialised: hence the siblings.

Names: peft's parameters are "base_model.model.<hf name>" with ".base_layer" inside an adapted module, and the
adapter's own "...q_proj.lora_A.default.weight". plain_name() strips both; merged tensors leave under the plain
names, through the same checkpoint-name conversion as full weights (workers/hf_names.py).
"""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch import nn

from orlhf.workers.full_weights import LAYER_PREFIX  # parameters of one decoder layer share its prefix
from orlhf.workers.hf_names import meta_group, to_checkpoint_names

if TYPE_CHECKING:
    from orlhf.config.worker_slices import LoraSlice

log = logging.getLogger("orlhf.workers")

ADAPTER = "default"  # peft's name of the one adapter
_ADAPTER_PART = re.compile(r"\.lora_(?:A|B)\." + ADAPTER + r"\.")


class LoraTargetError(ValueError):
    """--target_modules names nothing LoRA can adapt in the model (a user error: exit 2 before anything starts)."""


# ---- building ----


def linear_module_names(model: nn.Module) -> list[str]:
    """Full names of the Linear (and GPT-2 Conv1D) layers inside the model (all-linear: every one but the output
    head, which an untied model may name in --target_modules as lm_head)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if _is_linear(m) and m is not head]


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def check_targets(model: nn.Module, targets: "str | tuple[str, ...]", flag: str = "--target_modules") -> None:
    """Raise LoraTargetError when names in `targets` match no adaptable layer of `model` (peft's rule: a module's
    full name equals the name or ends with "." + name): every such name in one message, which then lists the
    model's Linear layers by short name."""
    if targets == "all-linear":
        if not linear_module_names(model):
            raise LoraTargetError(f"{flag} all-linear: the model has no Linear layer to adapt")
        return
    short = sorted({n.rsplit(".", 1)[-1] for n in linear_module_names(model)})
    modules = dict(model.named_modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    problems = []
    for target in targets:
        hits = [n for n in modules if n == target or n.endswith("." + target)]
        if not hits:
            problems.append(f"{flag} {target}: no module of the model has that name")
        elif any(modules[n] is head for n in hits) and _tied(model):
            problems.append(
                f"{flag} {target} is the output head, which this model ties to its input embeddings: an adapter "
                "on it would untie them, and the engines tie them again"
            )
        elif not any(_is_linear(modules[n]) for n in hits):
            problems.append(f"{flag} {target} is a {type(modules[hits[0]]).__name__}, not a Linear layer")
    if problems:
        raise LoraTargetError(
            f"{'; '.join(problems)}. Its Linear layers: {' '.join(short)} (all-linear takes them all); LoRA here "
            "adapts Linear layers inside the model."
        )


def check_folder_targets(path: str, targets: "str | tuple[str, ...]", causal_lm: bool = True) -> None:
    """check_targets on the model in `path` built on the meta device (shapes only, no weights read): a wrong
    --target_modules fails before any rank starts. The critic's backbone is the folder's AutoModel."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = (AutoModelForCausalLM if causal_lm else AutoModel).from_config(config)
    check_targets(model, targets)


def _tied(model: nn.Module) -> bool:
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def apply_lora(model: nn.Module, lora: "LoraSlice", causal_lm: bool = True) -> nn.Module:
    """`model` with a LoRA adapter (peft's get_peft_model, OpenRLHF's LoraConfig): every parameter but the
    adapter's is frozen. Called on every rank with the same seed, so the adapter starts identical everywhere."""
    from peft import LoraConfig, TaskType, get_peft_model

    check_targets(model, lora.target_modules)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM if causal_lm else None,
        r=lora.rank,
        lora_alpha=lora.alpha,
        target_modules=lora.target_modules if lora.target_modules == "all-linear" else list(lora.target_modules),
        lora_dropout=lora.dropout,
        bias="none",
    )
    peft_model = get_peft_model(model, config)
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in peft_model.parameters() if p.requires_grad)
    total = sum(getattr(p, "ds_numel", p.numel()) for p in peft_model.parameters())
    log.info(
        "LoRA rank %d, alpha %d on %d modules: %.3fM of %.2fM parameters train",
        lora.rank,
        lora.alpha,
        len(adapted_modules(peft_model)),
        trainable / 1e6,
        total / 1e6,
    )
    return peft_model


def adapted_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{peft module name: LoRA layer} of `model` (empty without an adapter)."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


@contextmanager
def adapter_off(model: nn.Module) -> Iterator[None]:
    """Forwards inside run the base weights alone (every LoRA layer bypassed): the reference policy. Flips peft's
    per-layer switch only; trainable flags and optimizer state are left alone."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m._disable_adapters = was


# ---- names and merging (pure) ----


def plain_name(peft_name: str) -> str:
    """peft's parameter name -> the base model's ("base_model.model.model.layers.0.q_proj.base_layer.weight" ->
    "model.layers.0.q_proj.weight"); inside a value model the prefix sits after the backbone's name."""
    return peft_name.replace("base_model.model.", "", 1).replace(".base_layer.", ".")


def lora_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, fan_in_fan_out: bool = False) -> torch.Tensor:
    """The adapter's weight update scaling * B @ A: (out, r) @ (r, in) -> (out, in), transposed for Conv1D
    (fan_in_fan_out) layers, computed in float32 (peft's get_delta_weight)."""
    delta = (b.float() @ a.float()) * scaling
    return delta.T if fan_in_fan_out else delta


def merge_group(
    group: list[tuple[str, torch.Tensor]], adapters: dict[str, tuple[float, bool]]
) -> list[tuple[str, torch.Tensor]]:
    """One group of (peft name, full tensor) -> (plain name, tensor) with each adapted weight merged:
    W + scaling * B @ A in W's dtype. `adapters`: {peft module name: (scaling, fan_in_fan_out)}. The adapter's
    own tensors are consumed; everything else passes through renamed. Works on meta tensors too (shapes only)."""
    tensors = dict(group)
    out = []
    for name, t in group:
        if _ADAPTER_PART.search(name):
            continue
        module = name.rsplit(".", 1)[0]
        if name.endswith(".base_layer.weight") and module.removesuffix(".base_layer") in adapters:
            owner = module.removesuffix(".base_layer")
            scaling, fan_in_fan_out = adapters[owner]
            a = tensors[f"{owner}.lora_A.{ADAPTER}.weight"]
            b = tensors[f"{owner}.lora_B.{ADAPTER}.weight"]
            t = (t.float() + lora_delta(a, b, scaling, fan_in_fan_out)).to(t.dtype)
        out.append((plain_name(name), t))
    return out


def adapter_scalings(model: nn.Module) -> dict[str, tuple[float, bool]]:
    """{peft module name: (scaling, fan_in_fan_out)} of every LoRA layer."""
    return {
        n: (float(m.scaling[ADAPTER]), bool(getattr(m, "fan_in_fan_out", False)))
        for n, m in adapted_modules(model).items()
    }


# ---- what a weight sync sends ----


@dataclass
class SyncPlan:
    """The parameters a LoRA sync gathers, per decoder layer, and the adapters to merge them with."""

    groups: list[list[tuple[str, nn.Parameter]]]  # (peft name, parameter), whole modules, layer by layer
    adapters: dict[str, tuple[float, bool]]
    whole_layers: bool  # no fused-module map from the engine: every parameter of each adapted layer goes


def sync_plan(model: nn.Module, packed: Optional[dict[str, list[str]]]) -> SyncPlan:
    """The modules a sync sends: every adapted one, plus the modules the engine fuses with one of them (`packed`:
    vLLM's packed_modules_mapping, {"qkv_proj": ["q_proj", "k_proj", "v_proj"], ...}), all their parameters. An
    engine model that declares no mapping gets the whole decoder layers that hold an adapter: safe, if larger."""
    adapted = adapted_modules(model)
    modules = dict(model.named_modules())
    # QLoRA: the trainer computes with the 4-bit weights, the engines hold the checkpoint's: every quantized module
    # goes (dequantized), adapted or not, so both run the same weights
    send = set(adapted) | {n for n, m in modules.items() if _is_4bit(getattr(m, "weight", None))}
    for name in adapted:
        parent, _, leaf = name.rpartition(".")
        for parts in (packed or {}).values():
            if leaf in parts:
                send.update(f"{parent}.{p}" for p in parts if f"{parent}.{p}" in modules)
    owned = set()
    for name in send:
        if name in adapted:
            layer = adapted[name]
            owned.update(f"{name}.base_layer.{p}" for p, _ in layer.base_layer.named_parameters(recurse=False))
            owned.update(f"{name}.lora_{ab}.{ADAPTER}.weight" for ab in "AB")
        else:
            owned.update(f"{name}.{p}" for p, _ in modules[name].named_parameters(recurse=False))
    layers_with_adapter = {m.group(1) for n in adapted if (m := LAYER_PREFIX.match(n + "."))}
    groups: dict[str, list] = {}
    for name, p in model.named_parameters():
        match = LAYER_PREFIX.match(name)
        layer = match.group(1) if match else ""
        if name in owned or (packed is None and layer in layers_with_adapter):
            groups.setdefault(layer, []).append((name, p))
    return SyncPlan(list(groups.values()), adapter_scalings(model), packed is None)


def merged_groups(
    worker, plan: SyncPlan, to_cpu: bool = True, all_ranks: bool = False
) -> Iterator[list[tuple[str, Optional[torch.Tensor]]]]:
    """The sync's tensors, one decoder layer at a time, in checkpoint names (what engines load): the contract of
    DeepSpeedWorker.named_full_weights (collective under ZeRO-3; None tensors off rank 0 unless all_ranks), with
    adapted weights merged and only the plan's modules. Merged tensors are new, so there is no copy=False."""
    import deepspeed

    hf_model = base_hf_model(worker.module)
    for group in plan.groups:
        params = [p for _, p in group]
        ctx = deepspeed.zero.GatheredParameters(params) if worker.zero3 else nullcontext()
        with ctx:
            if worker.rank == 0 or all_ranks:
                full = [(n, _full(p).to("cpu" if to_cpu else p.device)) for n, p in group]
                yield to_checkpoint_names(hf_model, merge_group(full, plan.adapters))
            else:
                yield [(n, None) for n, _ in to_checkpoint_names(hf_model, merge_group(_meta(group), plan.adapters))]


def merged_groups_meta(worker, plan: SyncPlan) -> list[list[tuple[str, str, tuple]]]:
    """(checkpoint name, dtype, full shape) per group, exactly as merged_groups yields them. Local, no gather."""
    hf_model = base_hf_model(worker.module)
    return [
        [
            (n, str(t.dtype), tuple(t.shape))
            for n, t in to_checkpoint_names(hf_model, merge_group(_meta(g), plan.adapters))
        ]
        for g in plan.groups
    ]


def _meta(group: list[tuple[str, nn.Parameter]]) -> list[tuple[str, torch.Tensor]]:
    """hf_names.meta_group, with a 4-bit weight's real shape and compute dtype (its quant state) for its bytes."""
    return [
        (n, torch.empty(tuple(p.quant_state.shape), dtype=p.quant_state.dtype, device="meta")) if _is_4bit(p) else m
        for (n, p), m in zip(group, meta_group(group))
    ]


def _is_4bit(p) -> bool:
    """A bitsandbytes 4-bit weight (--load_in_4bit): packed NF4 bytes plus a quant state."""
    return p is not None and type(p).__name__ == "Params4bit"


def _full(p: nn.Parameter) -> torch.Tensor:
    """A parameter's full tensor: gathered ZeRO data as is, a 4-bit weight dequantized to its compute dtype."""
    if _is_4bit(p):
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(p.data, p.quant_state).to(p.quant_state.dtype)
    return p.data.detach()


def base_hf_model(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (the one whose names and conversions the engines know)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ---- exports ----


def save_adapter(model: nn.Module, state: dict[str, torch.Tensor], out_dir: str) -> None:
    """The adapter in PEFT's format (adapter_config.json + adapter_model.safetensors, loadable with
    PeftModel.from_pretrained on the base model). `state`: the full state in peft names (gathered: under ZeRO-3
    the module's own tensors are empty shards)."""
    model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)


def merged_state(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's state (plain runtime names) with the adapter merged in: what save_pretrained of the base
    model takes for a plain HF folder."""
    return dict(merge_group(list(state.items()), adapter_scalings(model)))
