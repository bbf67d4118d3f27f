"""Loading an HF model for a worker: dtype and attention kernels, partitioned at load under ZeRO-3.

with hf_zero3_loading(ds_config):                 transformers builds the model inside deepspeed.zero.Init
    model = from_pretrained(causal_lm_class(cfg), path, cfg)    (each rank holds only its shard)

A vision-language model (config.json has a vision_config) loads through AutoModelForImageTextToText, the rest
through AutoModelForCausalLM. --freeze_visual_encoder then leaves only its language model and LM head trainable
(freeze_visual_encoder), before DeepSpeed builds the optimizer from the parameters that still need gradients.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch import nn

from orlhf.config.worker_config import WorkerConfig
from orlhf.workers.attention import SDPA_FP32, attn_implementation

log = logging.getLogger("orlhf.workers")


@contextmanager
def hf_zero3_loading(config: dict):
    """While loading an HF model: partition at load under ZeRO-3 (HfDeepSpeedConfig alive), plain otherwise.

    transformers keeps only a weak global reference to the HfDeepSpeedConfig; it is set for this load and
    cleared after it, so a later non-ZeRO-3 load in the same process is not partitioned by mistake.
    """
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    keep_alive = _hf_deepspeed_config(config) if config["zero_optimization"]["stage"] == 3 else None
    try:
        yield
    finally:
        del keep_alive
        unset_hf_deepspeed_config()


class _ZeRO3LoadMarker:
    """What transformers reads from its HfDeepSpeedConfig (`is_zero3()` and `config`) when loading a model.

    transformers' HfDeepSpeedConfig refuses to start without the `accelerate` package, which nothing else here
    needs; this stand-in makes from_pretrained wrap model creation in deepspeed.zero.Init all the same.
    """

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return self.config["zero_optimization"]["stage"] == 3


def _hf_deepspeed_config(config: dict):
    import importlib.util

    from transformers.integrations.deepspeed import HfDeepSpeedConfig, set_hf_deepspeed_config

    if importlib.util.find_spec("accelerate") is not None:
        return HfDeepSpeedConfig(config)
    marker = _ZeRO3LoadMarker(config)
    set_hf_deepspeed_config(marker)
    return marker


def hf_load_kwargs(cfg: WorkerConfig) -> dict:
    """from_pretrained kwargs shared by every role: dtype and attention kernels; with --load_in_4bit (QLoRA, a
    trained role with an adapter) the frozen weights as bitsandbytes NF4 with double quantization, computing in
    bfloat16 (OpenRLHF's BitsAndBytesConfig)."""
    kw = {
        "dtype": torch.bfloat16 if cfg.bf16 else torch.float32,
        "attn_implementation": attn_implementation(cfg),  # workers/attention.py
    }
    if cfg.experts_implementation is not None:  # MoE families (transformers' from_pretrained kwarg)
        kw["experts_implementation"] = cfg.experts_implementation
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.load_in_4bit:
        from transformers import BitsAndBytesConfig

        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        kw["device_map"] = {"": torch.cuda.current_device()}  # bitsandbytes quantizes as the weights reach the GPU
    return kw


def model_class(auto_cls, cfg: WorkerConfig):
    """The class that loads `cfg`'s model: Liger's AutoLigerKernelForCausalLM in place of AutoModelForCausalLM with
    --use_liger_kernel (as OpenRLHF's Actor: it patches the model type's modules with Liger's Triton kernels, then
    loads through AutoModelForCausalLM), else `auto_cls` itself. Value-head models load as before (OpenRLHF has no
    Liger there either; worker_config sets use_liger_kernel for the actor and the reference only)."""
    if not cfg.use_liger_kernel or auto_cls.__name__ != "AutoModelForCausalLM":
        return auto_cls
    if cfg.device != "cuda":
        raise ValueError("--use_liger_kernel needs CUDA GPUs (Liger's kernels are Triton's); drop it on --device cpu.")
    try:
        from liger_kernel.transformers import AutoLigerKernelForCausalLM
    except ImportError as e:
        from orlhf.config.validation import LIGER_MISSING

        raise ImportError(LIGER_MISSING) from e
    return AutoLigerKernelForCausalLM


def from_pretrained(auto_cls, path: str, cfg: WorkerConfig, **kwargs):
    """auto_cls.from_pretrained with our kwargs (Liger's class with --use_liger_kernel: model_class); falls back to
    eager attention for models without SDPA."""
    auto_cls = model_class(auto_cls, cfg)
    kw = {**hf_load_kwargs(cfg), **kwargs}
    try:
        return auto_cls.from_pretrained(path, **kw)
    except ValueError as e:
        if kw["attn_implementation"] not in ("sdpa", SDPA_FP32) or "sdpa" not in str(e).lower():
            raise
        log.warning("%s does not support SDPA attention; using eager", path)
        return auto_cls.from_pretrained(path, **{**kw, "attn_implementation": "eager"})


def is_vision_language(config) -> bool:
    """Whether an HF config is a vision-language model's (it carries a vision tower's config)."""
    return getattr(config, "vision_config", None) is not None


def causal_lm_class(cfg: WorkerConfig):
    """The auto class that loads cfg's model with its LM head: AutoModelForImageTextToText for a vision-language
    model, AutoModelForCausalLM otherwise. Image prompts (cfg.vision) need the former."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vlm = is_vision_language(AutoConfig.from_pretrained(cfg.model_path))
    if cfg.vision and not vlm:
        raise ValueError(
            f"--max_images_per_prompt > 0 needs a vision-language model, but {cfg.model_path}/config.json has no "
            "vision_config; pass such a model to --pretrain or drop --max_images_per_prompt."
        )
    return AutoModelForImageTextToText if vlm else AutoModelForCausalLM


def language_parts(model: nn.Module) -> list[nn.Module]:
    """A vision-language model's language model and LM head: what --freeze_visual_encoder leaves trainable.

    The language model is what transformers' get_decoder() finds (Idefics3: model.text_model, Qwen2-VL:
    model.language_model), else the module named language_model or text_model; the head is the output
    embeddings (the top-level model's lm_head)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model or decoder is getattr(model, "base_model", None):
        names = ("language_model", "text_model")
        decoder = next((m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in names), None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise ValueError(
            f"--freeze_visual_encoder: no language model or LM head found in {type(model).__name__}; "
            "drop the flag to train the whole model."
        )
    return [decoder, head]


def freeze_visual_encoder(model: nn.Module) -> list[str]:
    """requires_grad=False on every parameter outside the language model and the LM head (the vision tower and
    the projector); returns their names. The optimizer then holds no state for them and weight syncs skip them."""
    keep = {id(p) for part in language_parts(model) for p in part.parameters()}
    frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in keep]
    if not keep or not frozen:  # a decoder that is the whole model would freeze nothing, silently
        raise ValueError(
            f"--freeze_visual_encoder: {type(model).__name__}'s language model holds all its parameters or none; "
            "drop the flag to train the whole model."
        )
    for _, p in frozen:
        p.requires_grad_(False)
    return [n for n, _ in frozen]
