"""distributed/heartbeat.on_one_thread: an actor class whose constructor and exported methods all run on one thread
of its own (vLLM's CPU engine keeps per-thread state from its start), while the kept health method runs where it is
called; a method calling another runs it directly (no wait on its own thread)."""

import threading

from orlhf.distributed.endpoints import endpoint
from orlhf.distributed.heartbeat import on_one_thread


class Worker:
    """Says which thread runs what."""

    def __init__(self, x: int):
        self.x, self.init_thread = x, threading.get_ident()

    @endpoint
    def where(self) -> int:
        return threading.get_ident()

    @endpoint
    def nested(self) -> int:
        return self.where()

    @endpoint
    def fail(self) -> None:
        raise ValueError("raised on its thread")

    @endpoint
    def pid(self) -> int:
        return threading.get_ident()


def test_init_and_methods_share_one_thread_and_the_health_method_stays_where_called():
    w = on_one_thread(Worker)(3)
    here = threading.get_ident()
    assert w.x == 3 and w.init_thread != here
    assert w.where() == w.init_thread == w.nested()
    assert w.pid() == here
    assert type(w).__name__ == "Worker" and isinstance(w, Worker)
    try:
        w.fail()
    except ValueError as e:
        assert "raised on its thread" in str(e)
    else:
        raise AssertionError("the error did not come back")
