"""cpu/vllm_import.deferred_compile: torch.compile applied to a plain function builds torch's wrapper at the
function's first call, with the same arguments, once; anything else is compiled at once, as torch.compile does."""

import threading

import pytest
import torch

from orlhf.cpu import vllm_import


@pytest.fixture
def torch_compile_calls(monkeypatch):
    """torch.compile's calls, counted (torch's own does the work)."""
    calls = []
    real = torch.compile

    def counted(model=None, **options):
        calls.append((model, options))
        return real(model, **options)

    monkeypatch.setattr(vllm_import, "_torch_compile", counted)
    return calls


def scale_and_shift(x, s: float = 2.0):
    return x * s + 1


def test_a_function_compiles_at_its_first_call_once_with_the_same_arguments(torch_compile_calls):
    stand_in = vllm_import.deferred_compile(scale_and_shift, backend="eager", dynamic=True)
    assert torch_compile_calls == []  # nothing built at "import"
    assert stand_in.__name__ == "scale_and_shift" and stand_in.__wrapped__ is scale_and_shift
    x = torch.arange(6.0)
    assert torch.equal(stand_in(x), scale_and_shift(x))
    assert torch.equal(stand_in(x, s=3.0), scale_and_shift(x, 3.0))
    assert torch_compile_calls == [(scale_and_shift, {"backend": "eager", "dynamic": True})]


def test_the_decorator_form_defers_too(torch_compile_calls):
    @vllm_import.deferred_compile(backend="eager")
    def double(x):
        return 2 * x

    assert torch_compile_calls == []
    assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    assert len(torch_compile_calls) == 1 and torch_compile_calls[0][1] == {"backend": "eager"}


def test_threads_calling_first_together_compile_once(torch_compile_calls):
    stand_in = vllm_import.deferred_compile(scale_and_shift, backend="eager")
    start = threading.Barrier(4)
    results = []

    def call():
        start.wait()
        results.append(stand_in(torch.ones(2)))

    threads = [threading.Thread(target=call) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(torch_compile_calls) == 1
    assert all(torch.equal(r, torch.full((2,), 3.0)) for r in results) and len(results) == 4


def test_a_module_is_compiled_at_once(torch_compile_calls):
    layer = torch.nn.Linear(2, 2)
    compiled = vllm_import.deferred_compile(layer, backend="eager")
    assert torch_compile_calls == [(layer, {"backend": "eager"})]
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
