"""--router_replay R3 on vLLM-CPU: the experts each computed token was routed to, recorded in the engine.

vLLM returns routed experts (CompletionOutput.routed_experts, (positions, layers, top_k)) only through its model
runner V2 (vllm/config/vllm.py `VllmConfig._verify_aux_output_compatibility` refuses the option otherwise, and
`use_v2_model_runner` turns V2 off without Triton), and the CPU install has no Triton: its workers run the V1 runner
(vllm/v1/worker/cpu_model_runner.py over gpu_model_runner.py), which has no routed-experts capture. The routers
themselves do call a capture hook on CPU too (vllm/model_executor/layers/fused_moe/router/base_router.py
`BaseRouter._select_experts` calls `capture_fn(topk_ids)`, and CPURouter is a BaseRouter). So here:

    install(llm)   in the engine's process (vLLM-CPU runs its engine core in-process):
                   every router's capture_fn writes its layer's (tokens, top_k) rows into the step's buffer;
                   the runner's execute_model is wrapped so that the rows of a step are put, after its forward, at
                   (request, position) from the runner's own batch layout (input_batch.req_ids, the step's scheduled
                   token counts and `positions`); llm.generate is wrapped to attach each finished request's rows
                   to its CompletionOutput.routed_experts, as vLLM's own capture would
    rows           (P + R - 1, layers, top_k) int16 for a prompt of P tokens and R sampled ones: every token that
                   went through the model (the last sampled one never does); -1 where a layer has no router

Prefix caching would skip the cached prompt tokens' forward (no rows for them): validation refuses it with R3 on
CPU. Child requests of n > 1 are found by vLLM's id scheme (f"{index}_{parent}", each with a "-<suffix>" the input
processor adds).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


class RoutingStore:
    """Rows per request, filled step by step."""

    def __init__(self, layers: int, top_k: int):
        self.layers, self.top_k = layers, top_k
        self.rows: dict[str, np.ndarray] = {}  # internal request id -> (positions, layers, top_k) int16
        self.step: torch.Tensor | None = None  # (tokens, layers, top_k) of the forward in flight

    def begin_step(self, tokens: int) -> None:
        self.step = torch.full((tokens, self.layers, self.top_k), -1, dtype=torch.int16)

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self.step is None:  # a forward outside execute_model (warm-up, profiling)
            return
        n = min(self.step.shape[0], topk_ids.shape[0])  # the forward may pad past the scheduled tokens
        self.step[:n, layer] = topk_ids[:n].to(torch.int16)

    def end_step(self, req_ids: list[str], counts: list[int], positions: np.ndarray) -> None:
        """Put the step's rows at each request's positions (requests in the runner's batch order)."""
        step, self.step = self.step, None
        start = 0
        for rid, n in zip(req_ids, counts):
            if n:
                pos = positions[start : start + n]
                self._held(rid, int(pos.max()) + 1)[pos] = step[start : start + n].numpy()
            start += n

    def _held(self, rid: str, need: int) -> np.ndarray:
        """The request's rows, grown (doubling) to hold `need` positions."""
        held = self.rows.get(rid)
        if held is None or held.shape[0] < need:
            size = max(need, 2 * (0 if held is None else held.shape[0]))
            grown = np.full((size, self.layers, self.top_k), -1, np.int16)
            if held is not None:
                grown[: held.shape[0]] = held
            held = self.rows[rid] = grown
        return held

    def take(self, internal_id: str, length: int) -> np.ndarray | None:
        held = self.rows.pop(internal_id, None)
        return None if held is None else held[:length]


def install(llm: Any) -> RoutingStore:
    """Bind the capture to the engine's routers and runner, and attach rows to generate's outputs."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    (runner,) = llm.collective_rpc(_model_runner)  # in-process: the runner object itself
    hf = llm.llm_engine.model_config.hf_text_config
    store = RoutingStore(hf.num_hidden_layers, hf.num_experts_per_tok)
    bind_routed_experts_capturer(runner.model, store)  # each router: capture_fn = partial(store.capture, layer)
    runner.execute_model = _wrap_execute(runner, runner.execute_model, store)
    llm.generate = _wrap_generate(llm.generate, store)
    log.info("--router_replay R3: the engine records routed experts (%d layers x top-%d)", store.layers, store.top_k)
    return store


def _model_runner(worker) -> Any:
    return worker.model_runner


def _wrap_execute(runner, execute, store: RoutingStore):
    @functools.wraps(execute)
    def execute_model(scheduler_output, *args, **kwargs):
        total = scheduler_output.total_num_scheduled_tokens
        store.begin_step(total)
        try:
            return execute(scheduler_output, *args, **kwargs)
        finally:
            if total and store.step is not None:
                batch = runner.input_batch
                req_ids = list(batch.req_ids[: batch.num_reqs])
                counts = [scheduler_output.num_scheduled_tokens.get(r, 0) for r in req_ids]
                positions = runner.positions[:total].cpu().numpy()
                store.end_step(req_ids, counts, positions)
            store.step = None

    return execute_model


def _wrap_generate(generate, store: RoutingStore):
    @functools.wraps(generate)
    def generate_with_routing(*args, **kwargs):
        outputs = generate(*args, **kwargs)
        for out in outputs:
            for c in out.outputs:
                c.routed_experts = _take(store, out.request_id, c.index, len(out.outputs) > 1, out, c)
        store.rows.clear()  # rows of requests that never finished (aborted) go with the call
        return outputs

    return generate_with_routing


def _take(store: RoutingStore, ext_id: str, index: int, children: bool, out, completion) -> np.ndarray | None:
    prefix = f"{index}_{ext_id}-" if children else f"{ext_id}-"
    found = [rid for rid in store.rows if rid.startswith(prefix)]
    if len(found) != 1:
        return None
    length = len(out.prompt_token_ids) + len(completion.token_ids) - 1
    return store.take(found[0], max(length, 0))
