"""A trainer and a vLLM engine in two plain processes (no Ray), joined by orlhf's real gloo weight-sync group.

    parent (pytest)                      trainer process                      engine process
      build tiny model folders            PolicyWorker (ZeRO-3, world 1)       vLLM LLM in-process (fp32 or bf16, eager)
      Rig.call("trainer", ...)  ------->  update weights, log-probs             prompt log-probs
      Rig.sync()                ------->  send_weights  --gloo broadcast-->    orlhf_receive_weights

Both processes live for the whole test module and load one model family after another, so each family costs
one DeepSpeed init and one vLLM start (in-process). Commands go over a pipe as (method name, args); the
sync starts both sides at once, as WeightSync does with Ray.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import traceback
from pathlib import Path
from typing import Optional

import torch

HIDDEN, LAYERS, HEADS = 64, 2, 2  # CPU attention needs head_dim >= 32


def _family_configs(vocab: int, ids: dict) -> dict:
    """family -> (transformers config class name, kwargs). Tiny: 2 layers, hidden 64."""
    common = dict(vocab_size=vocab, max_position_embeddings=128, **ids)
    dense = dict(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=1,
        **common,
    )
    return {
        "llama": ("LlamaConfig", dict(dense, tie_word_embeddings=False)),
        "llama_tied": ("LlamaConfig", dict(dense, tie_word_embeddings=True)),
        "qwen2": ("Qwen2Config", dict(dense, tie_word_embeddings=False)),
        "qwen3": ("Qwen3Config", dict(dense, head_dim=32, tie_word_embeddings=True)),
        "mistral": ("MistralConfig", dict(dense, tie_word_embeddings=False)),
        "phi3": ("Phi3Config", dict(dense, tie_word_embeddings=False)),
        "gemma2": (
            "Gemma2Config",
            dict(dense, head_dim=32, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=32),
        ),
        "gemma3": ("Gemma3TextConfig", dict(dense, head_dim=32, final_logit_softcapping=30.0, sliding_window=32)),
        "gpt2": (
            "GPT2Config",
            dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=128, vocab_size=vocab, **ids),
        ),
        "qwen2_moe": (
            "Qwen2MoeConfig",
            dict(
                dense,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                num_experts=4,
                num_experts_per_tok=2,
                decoder_sparse_step=1,
                tie_word_embeddings=False,
            ),
        ),
        "mixtral": (
            "MixtralConfig",
            dict(dense, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
        ),
        "qwen3_moe": (
            "Qwen3MoeConfig",
            dict(
                dense,
                head_dim=32,
                moe_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                tie_word_embeddings=False,
            ),
        ),
    }


FAMILIES = list(_family_configs(8, {}))


def build_models(root: Path, families: list[str], seed: int = 0) -> dict[str, str]:
    """One HF folder per family (random weights + the demo's BPE tokenizer). Returns family -> folder."""
    import transformers
    from transformers import AutoModelForCausalLM

    from orlhf.demo.builder import _build_tokenizer

    tok = _build_tokenizer(random.Random(seed))
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    configs = _family_configs(len(tok), ids)
    out = {}
    for family in families:
        cls_name, kw = configs[family]
        config = getattr(transformers, cls_name)(**kw)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = root / family
        model.save_pretrained(path)
        tok.save_pretrained(path)
        out[family] = str(path)
    return out


# ---------------------------------------------------------------- the trainer process


class TrainerSide:
    """A PolicyWorker at world size 1 (its own gloo default group): ZeRO-3, as a group of several ranks runs, or
    another stage (a one-rank group's default is no ZeRO in fp32, worker_config.zero_stage_of)."""

    def __init__(self):
        self.worker = None

    def load(
        self,
        path: str,
        bf16: bool = False,
        temperature: float = 1.0,
        lr: float = 1e-2,
        zero_stage: int = 3,
        lora_rank: int = 0,
    ) -> None:
        from orlhf.config.worker_config import role_config
        from orlhf.config.worker_slices import LoraSlice
        from orlhf.workers import PolicyWorker

        lora = LoraSlice(rank=lora_rank, alpha=2 * lora_rank) if lora_rank else None

        cfg = role_config(
            "actor",
            model_path=path,
            device="cpu",
            zero_stage=zero_stage,
            micro_forward_batch_size=8,
            bf16=bf16,
            temperature=temperature,
            learning_rate=lr,
            train_batch_size=4,
            micro_train_batch_size=4,
            total_optimizer_steps=4,
            lora=lora,
        )
        self.worker = PolicyWorker(cfg)
        self.worker.init()

    def metas(self, packed=None):
        return self.worker.weight_groups_meta(packed)

    def save_merged(self, out_dir: str) -> None:
        """--lora_save_merged's export: the adapter merged into a plain HF folder."""
        self.worker.save_hf_merged(out_dir)

    def base_log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        """log_probs with the LoRA adapter off (the reference a LoRA run scores)."""
        from orlhf.types import SequenceBatch

        attn = torch.ones_like(sequences)
        return self.worker.base_log_probs(SequenceBatch(sequences, attn, attn[:, 1:].bool()))

    def join(self, host: str, port: int) -> None:
        self.worker.init_weight_sender(host, port, 2, "gloo")

    def send(self, expected: int) -> int:
        return self.worker.send_weights(expected)

    def send_delta(self, bucket_sizes: list[int], dtype: str, full: bool) -> int:
        """--vllm_sync_delta's send: the bytes broadcast."""
        return self.worker.send_weights_delta(bucket_sizes, dtype, full)

    def log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        """(B, T-1): log p(token_t | tokens_<t) for t >= 1 (every position scored)."""
        from orlhf.types import SequenceBatch

        attn = torch.ones_like(sequences)
        return self.worker.log_probs(SequenceBatch(sequences, attn, attn[:, 1:].bool()))

    def train_step(self, sequences: torch.Tensor, seed: int = 0) -> float:
        """One PPO step on fixed sequences with random advantages: a real optimizer step."""
        from orlhf.types import Experience

        attn = torch.ones_like(sequences)
        old = self.log_probs(sequences)
        adv = torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))
        stats = self.worker.train_step(
            Experience(sequences, attn, attn[:, 1:].bool(), action_log_probs=old, advantages=adv)
        )
        return stats.grad_norm

    def perturb(self, seed: int, scale: float = 0.02) -> int:
        """Add seeded noise to every trained parameter (ZeRO-3: gathered, modified on rank 0, re-partitioned; below
        stage 3 GatheredParameters does nothing). With LoRA: the adapter's, as training moves only them."""
        import deepspeed

        g = torch.Generator().manual_seed(seed)
        params = [p for _, p in self.worker.module.named_parameters() if p.requires_grad]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
            for p in params:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
        return len(params)

    def unload(self) -> None:
        self.worker = None
        import gc

        gc.collect()


# ---------------------------------------------------------------- the engine process


class EngineSide:
    """vLLM in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), orlhf's worker extension loaded."""

    def __init__(self):
        self.llm = None

    def load(self, path: str, bf16: bool = False, temperature: float = 1.0) -> None:
        from vllm import LLM

        from orlhf.rollout.engine import EXTENSION
        from orlhf.rollout.engine_config import engine_dtype, engine_logprobs_mode

        self.llm = LLM(
            model=path,
            dtype=engine_dtype(bf16, "cpu"),
            logprobs_mode=engine_logprobs_mode(temperature),
            enforce_eager=True,
            max_model_len=128,
            seed=0,
            kv_cache_memory_bytes=64 * 2**20,
            worker_extension_cls=EXTENSION,
            enable_prefix_caching=False,
        )

    def join(self, host: str, port: int) -> int:
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        return self.llm.collective_rpc(Ext.orlhf_init_sync_group.__name__, args=(host, port, 1, 2, "gloo"))[0]

    def packed(self):
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        return self.llm.collective_rpc(Ext.orlhf_packed_modules.__name__)[0]

    def receive(self, metas, buckets) -> int:
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        n = self.llm.collective_rpc(Ext.orlhf_receive_weights.__name__, args=(metas, buckets))[0]
        self.llm.reset_prefix_cache()
        return n

    def stale_packs(self) -> list[str]:
        """The engine's modules its last reload left with stale pre-packed weights (orlhf_stale_packs)."""
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        return self.llm.collective_rpc(Ext.orlhf_stale_packs.__name__)[0]

    def not_loaded(self) -> list[str]:
        """The engine's weights its last reload found no tensor for (orlhf_not_loaded)."""
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        return self.llm.collective_rpc(Ext.orlhf_not_loaded.__name__)[0]

    def receive_delta(self, metas, buckets, dtype: str) -> int:
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        n = self.llm.collective_rpc(Ext.orlhf_receive_delta.__name__, args=(metas, buckets, dtype))[0]
        self.llm.reset_prefix_cache()
        return n

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the engine's model as vLLM holds it (after its repacking), copied."""

        def read(worker):
            model = worker.model_runner.get_model()
            named = list(model.named_parameters()) + list(model.named_buffers())
            return {n: t.detach().clone() for n, t in named}

        return self.llm.collective_rpc(read)[0]

    def log_probs(self, sequences: torch.Tensor) -> torch.Tensor:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        seqs = sequences.tolist()
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        return torch.tensor(
            [[lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], s[1:])] for s, o in zip(seqs, outs)]
        )

    def sample(
        self, prompts: list[list[int]], new_tokens: int, seed: int = 0, temperature: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled continuations as a run samples them: (sequences (B, P + new_tokens), the engine's log-probs of
        the sampled tokens (B, new_tokens)). Fixed length (EOS ignored), so rows stack."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        # ignore_eos, not min_tokens: min_tokens masks EOS out of the distribution, and processed log-probs (at a
        # temperature != 1) would be of that masked distribution
        params = SamplingParams(
            max_tokens=new_tokens, ignore_eos=True, logprobs=0, temperature=temperature, seed=seed, detokenize=False
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        lps = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        return torch.tensor(seqs), torch.tensor(lps)

    def break_sync(self, kind: Optional[str]) -> None:
        """Make this engine's next syncs break as real ones once did (tests of the sync guard), or mend them (None).

        "unfixed": vLLM's reload without orlhf's fix-ups (rollout/reload_fixes.py): a tied head keeps its step-0
        packed copy, CPU MoE experts are read raw as pre-packed ones. "drop:<prefix>": the synced tensors whose
        names start with <prefix> are not loaded (a missed layer keeps its old weights)."""
        from orlhf.rollout import reload_fixes
        from orlhf.rollout.worker_ext import WeightSyncExtension as Ext

        real = self.__dict__.setdefault("_real", (reload_fixes.refreshed_after_reload, Ext._orlhf_reload))
        reload_fixes.refreshed_after_reload, Ext._orlhf_reload = real
        if kind == "unfixed":
            reload_fixes.refreshed_after_reload = lambda model: contextlib.nullcontext()
        elif kind is not None and kind.startswith("drop:"):
            prefix = kind.removeprefix("drop:")
            Ext._orlhf_reload = lambda ext, weights: real[1](
                ext, ((n, t) for n, t in weights if not n.startswith(prefix))
            )

    def unload(self) -> None:
        import gc

        from vllm.distributed import cleanup_dist_env_and_memory

        self.break_sync(None)

        if self.llm is None:
            return
        del self.llm
        self.llm = None
        gc.collect()
        cleanup_dist_env_and_memory()


def _serve(side: str, conn, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
    )
    obj = TrainerSide() if side == "trainer" else EngineSide()
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            conn.send(("ok", getattr(obj, method)(*args)))
        except BaseException as e:  # the parent re-raises it with the child's traceback
            conn.send(("error", f"{side}.{method}: {e!r}\n{traceback.format_exc()}"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Rig:
    """The parent's handle on both processes."""

    def __init__(self, timeout_s: float = 300.0):
        import multiprocessing as mp

        self.ctx, self.timeout_s = mp.get_context("spawn"), timeout_s
        self._spawn()

    def _spawn(self) -> None:
        self.conns, self.procs = {}, []
        for side in ("trainer", "engine"):
            parent, child = self.ctx.Pipe()
            proc = self.ctx.Process(target=_serve, args=(side, child, free_port()), daemon=True)
            proc.start()
            self.conns[side], self.procs = parent, self.procs + [proc]

    def _restart(self) -> None:
        """After a failure one side may be stuck in a broadcast: start both afresh for the next test."""
        for proc in self.procs:
            proc.kill()
            proc.join(timeout=30)
        self._spawn()

    def start(self, side: str, method: str, *args) -> None:
        self.conns[side].send((method, args))

    def wait(self, side: str):
        conn = self.conns[side]
        if not conn.poll(self.timeout_s):
            self._restart()
            raise TimeoutError(f"{side} did not answer in {self.timeout_s} s")
        status, value = conn.recv()
        if status == "error":
            self._restart()
            raise RuntimeError(value)
        return value

    def call(self, side: str, method: str, *args):
        self.start(side, method, *args)
        return self.wait(side)

    def load(
        self,
        path: str,
        bf16: bool = False,
        temperature: float = 1.0,
        zero_stage: int = 3,
        lora_rank: int = 0,
        engine_path: Optional[str] = None,
        lr: float = 1e-2,
    ) -> None:
        """Both sides load the same folder (in parallel) in fp32, or bf16 as --bf16 runs them, set up for
        --temperature as a run sets them up, the trainer under `zero_stage` (with a LoRA adapter of `lora_rank`);
        then join a fresh sync group, planned as WeightSync plans it (the engine's fused-module map first).
        engine_path: another folder for the engine (engines that differ from the trainer before any sync)."""
        self.start("trainer", "load", path, bf16, temperature, lr, zero_stage, lora_rank)
        self.start("engine", "load", engine_path or path, bf16, temperature)
        self.wait("trainer"), self.wait("engine")
        from orlhf.rollout.weight_sync import plan_buckets

        packed = self.call("engine", "packed")
        self.metas, self.buckets = plan_buckets(self.call("trainer", "metas", packed), 256 * 2**20)
        port = free_port()
        self.start("engine", "join", "127.0.0.1", port)
        self.start("trainer", "join", "127.0.0.1", port)
        self.wait("trainer"), self.wait("engine")

    def sync(self) -> int:
        self.start("engine", "receive", self.metas, self.buckets)
        self.start("trainer", "send", len(self.metas))
        received, sent = self.wait("engine"), self.wait("trainer")  # an engine error would leave the trainer stuck
        assert sent == received == len(self.metas), (sent, received, len(self.metas))
        return sent

    def sync_delta(self, full: bool, bf16: bool) -> int:
        """--vllm_sync_delta's sync (full: every tensor whole); returns the bytes the trainer broadcast."""
        dtype = "bfloat16" if bf16 else "float32"
        self.start("engine", "receive_delta", self.metas, self.buckets, dtype)
        self.start("trainer", "send_delta", [len(b) for b in self.buckets], dtype, full)
        received, sent = self.wait("engine"), self.wait("trainer")
        assert received == len(self.metas), (received, len(self.metas))
        return sent

    def unload(self) -> None:
        self.start("trainer", "unload")
        self.start("engine", "unload")
        self.wait("trainer"), self.wait("engine")

    def close(self) -> None:
        for conn in self.conns.values():
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
