"""Which cluster `orlhf plan` plans on (launch/plan.py): a live Ray cluster (--address: reads ray.nodes(), and each
GPU node's GPU memory with nvidia-smi in a task there; starts no model, creates no placement group), a described one
(--nodes N --gpus_per_node G [--gpu_memory_gb M]), or this machine (neither)."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Optional

from orlhf.config.train_config import TrainConfig
from orlhf.distributed.layout import Layout, NodeSpec, described_nodes, local_num_cpus
from orlhf.distributed.placement import live_nodes
from orlhf.distributed.ray_start import join_cluster
from orlhf.launch.plan_memory import GIB


@dataclass(frozen=True)
class ClusterArgs:
    """The plan command's own flags: a described cluster, or memory figures Ray cannot report."""

    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    gpu_memory_gb: Optional[float] = None  # GiB per GPU
    host_memory_gb: Optional[float] = None  # GiB per node


def resolve_cluster(cfg: TrainConfig, args: ClusterArgs) -> tuple[str, Optional[list[NodeSpec]], str]:
    """(device, nodes, what they are). nodes is None for this machine on cpu: its size follows the layout."""
    want = cfg.runtime.device
    if args.nodes is not None:
        device = "cuda" if want == "auto" else want
        nodes = described_nodes(args.nodes, args.gpus_per_node, device, args.gpu_memory_gb, args.host_memory_gb)
        mem = f" x {args.gpu_memory_gb:g} GiB" if args.gpu_memory_gb else ""
        return device, nodes, f"described: {args.nodes} nodes x {args.gpus_per_node} {_unit(device)}{mem}"
    if cfg.runtime.address:
        nodes = _live(cfg.runtime.address, args)
        device = want if want != "auto" else ("cuda" if any(n.capacity(True)["GPU"] for n in nodes) else "cpu")
        return device, nodes, f"live Ray cluster at {cfg.runtime.address}: {len(nodes)} nodes, free resources now"
    device = want if want != "auto" else _local_device()
    if device == "cpu":
        return device, None, "this machine (a local CPU Ray cluster sized for the layout)"
    if not _local_device() == "cuda":
        from orlhf.config.train_config import ConfigError

        raise ConfigError(
            [
                "--device cuda: this machine has no CUDA GPU to plan on. Describe the cluster (--nodes N "
                "--gpus_per_node G, and --gpu_memory_gb), or plan on a running one with --address."
            ]
        )
    return device, [_local_gpu_node(args)], "this machine"


def _unit(device: str) -> str:
    return "GPU" if device == "cuda" else "CPU slots"


def _live(address: str, args: ClusterArgs) -> list[NodeSpec]:
    import ray

    own = not ray.is_initialized()  # already connected (a driver, a test): read that cluster, leave it be
    if own:
        join_cluster(address, log_to_driver=False, logging_level="ERROR")
    try:
        nodes = live_nodes(args.gpu_memory_gb, read_gpu_memory=True)  # --gpu_memory_gb, else nvidia-smi's
    finally:
        if own:
            ray.shutdown()
    return [replace(n, host_memory_gb=args.host_memory_gb) for n in nodes] if args.host_memory_gb else nodes


def _host_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def _local_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _local_gpu_node(args: ClusterArgs) -> NodeSpec:
    import torch

    mem = args.gpu_memory_gb or torch.cuda.get_device_properties(0).total_memory / GIB
    return NodeSpec(
        "local",
        "127.0.0.1",
        float(torch.cuda.device_count()),
        float(os.cpu_count() or 1),
        mem,
        args.host_memory_gb or _host_gib(),
    )


def local_cpu_node(layout: Layout, args: ClusterArgs) -> NodeSpec:
    return NodeSpec("local", "127.0.0.1", 0.0, float(local_num_cpus(layout)), None, args.host_memory_gb or _host_gib())
