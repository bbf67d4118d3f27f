"""CUDA IPC weight hand-over between two processes through orlhf's own functions, no Ray and no vLLM.

    parent (trainer rank):  make_ipc_handles(named tensors, its GPU's UUID)  --spawn args-->
    child  (engine worker): receive_ipc(handles, names, its GPU's UUID, ...) -> private copies, synchronized
    parent: overwrites its tensors (as the sender frees its clone after the barrier) --> child's copies unchanged

The child would see zeros if receive_ipc handed vLLM views of the sender's memory, or returned with the copies
still queued on the stream.
"""

import io

import pytest
import torch

pytestmark = pytest.mark.gpu


def _engine_side(handles, names, to_parent, from_parent):
    """Child process: what WeightSyncExtension.orlhf_load_ipc does, with `load` keeping the tensors."""
    from orlhf.rollout.worker_ext import receive_ipc
    from orlhf.workers.weight_send import device_uuid

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    held: list = []
    held_bf16: list = []
    n = receive_ipc(handles, names, device_uuid(device), device, torch.float32, held.extend)
    receive_ipc(handles, names, device_uuid(device), device, torch.bfloat16, held_bf16.extend)
    to_parent.put(("loaded", n))
    from_parent.get(timeout=120)  # the sender has overwritten its tensors by now
    # As bytes: CPU tensors through a torch.multiprocessing queue travel as shared-memory handles that the parent
    # opens from this process after it has exited (ConnectionResetError, seen on the GPU machine).
    buf = io.BytesIO()
    torch.save(({k: t.cpu() for k, t in held}, {k: t.cpu() for k, t in held_bf16}), buf)
    to_parent.put(("copies", buf.getvalue()))


def test_ipc_handles_round_trip_between_processes():
    from orlhf.workers.weight_send import device_uuid, make_ipc_handles

    ctx = torch.multiprocessing.get_context("spawn")
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(0)
    named = [
        ("model.layers.0.mlp.up_proj.weight", torch.randn(512, 256, device=device, generator=g)),
        ("model.norm.weight", torch.randn(256, device=device, generator=g)),
    ]
    original = {k: t.cpu().clone() for k, t in named}
    handles = make_ipc_handles(named, device_uuid(device))
    to_parent, from_parent = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_engine_side, args=(handles, [k for k, _ in named], to_parent, from_parent))
    child.start()
    try:
        assert to_parent.get(timeout=180) == ("loaded", 2)
        for _, t in named:
            t.fill_(0.0)
        torch.cuda.synchronize()
        from_parent.put("go")
        tag, data = to_parent.get(timeout=120)
        f32, bf16 = torch.load(io.BytesIO(data))
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert tag == "copies" and child.exitcode == 0
    for k, t in original.items():
        assert torch.equal(f32[k], t), k
        assert torch.equal(bf16[k], t.to(torch.bfloat16)), k
