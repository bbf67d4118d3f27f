"""What the multi-process worker tests share: a tiny Llama saved to disk, a free port, ranks spawned as processes."""

import socket
from pathlib import Path

import torch


def save_tiny_llama(root: Path, vocab: int) -> Path:
    """A 1-layer Llama (hidden 32, seeded) saved as root/lm; returns that folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=vocab,
            max_position_embeddings=32,
            pad_token_id=0,
        )
    ).save_pretrained(root / "lm")
    return root / "lm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_group() -> None:
    """The last step of a spawned rank: wait for the others, then close the gloo group, so no rank exits (and
    closes its sockets) while a peer is still inside a collective with it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _run_rank(rank: int, rank_main, world: int, port: int, *args) -> None:
    import os

    from orlhf.cpu.rank_actor import tune_rank_process

    os.environ.update(  # one gloo group of `world` processes on this machine
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
        HF_HUB_OFFLINE="1",
    )

    tune_rank_process()  # as a CPU run's rank process does before its worker's init()
    rank_main(rank, world, port, *args)
    leave_group()


def spawn_ranks(rank_main, world: int, *args) -> None:
    """rank_main(rank, world, port, *args) in `world` fresh processes (one gloo group: its rendezvous variables set
    before rank_main runs), waited for; each rank leaves the group together with the others when rank_main
    returns."""
    import torch.multiprocessing as mp

    mp.start_processes(
        _run_rank, args=(rank_main, world, free_port(), *args), nprocs=world, join=True, start_method="spawn"
    )
