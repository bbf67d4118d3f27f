"""Typed remote calls: a group calls a worker method by reference, checked against what the worker exports.

    class PolicyWorker(DeepSpeedWorker):
        @endpoint
        def log_probs(self, batch): ...

    group = ActorGroup("actor", PolicyWorker, ...)        exports of PolicyWorker (and its bases) read here
    group.call_sharded(PolicyWorker.log_probs, batch)      checked before anything is sent: a method reference,
                                                           an export of this group's class, else a clear error
    engines.call(WeightSyncExtension.orlhf_ipc_begin)      one API for engines too (distributed/groups.py,
    rollout/engine.py)

Why references, not strings: go-to-definition works, a rename breaks where the reference is written (at import
or when the call is built, before any rank runs), and a method that was never meant to be called remotely
(no @endpoint) cannot be. Over Ray the call still travels as the method's name; only this module turns a
reference into that name. Pure Python (no Ray import): worker classes stay usable without Ray.
"""

from __future__ import annotations

from typing import Callable

_MARK = "__orlhf_endpoint__"


def endpoint(fn: Callable) -> Callable:
    """Export a worker method to its group (ActorGroup / EngineGroup). An override stays exported."""
    setattr(fn, _MARK, True)
    return fn


def exports(cls: type) -> dict[str, Callable]:
    """{name: the class's implementation} of every method exported by cls or one of its bases."""
    table = {}
    for klass in cls.__mro__:
        for name, fn in vars(klass).items():
            if getattr(fn, _MARK, False) and name not in table:
                table[name] = getattr(cls, name)
    return table


def check_exports(role: str, *classes: type) -> None:
    """At group build: the worker classes export something and no name is exported twice (engine + extension)."""
    seen: dict[str, type] = {}
    for cls in classes:
        names = exports(cls)
        if not names:
            raise TypeError(
                f"{role}: {cls.__qualname__} exports no methods; mark the ones its group calls with "
                "@endpoint (orlhf/distributed/endpoints.py)"
            )
        for name in names:
            if name in seen:
                raise TypeError(
                    f"{role}: {name} is exported by both {seen[name].__qualname__} and "
                    f"{cls.__qualname__}; a call could not tell which one it means"
                )
            seen[name] = cls


def method_name(role: str, cls: type, fn: Callable) -> str:
    """The name to send for `fn`, after checking it is an exported method of `cls` (or of one of its bases).

    Raises TypeError naming the group, the class and the fix: a string instead of a reference, a function that
    is not a method of cls (another role's worker), or a method that is not exported.
    """
    if isinstance(fn, str):
        raise TypeError(f"{role}: call {cls.__qualname__}.{fn} by reference, not by the string {fn!r}")
    name = getattr(fn, "__name__", None)
    if name is None or not any(vars(k).get(name) is fn for k in cls.__mro__):
        what = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"{role}: {what} is not a method of {cls.__qualname__}, the class this group runs")
    if name not in exports(cls):
        raise TypeError(
            f"{role}: {cls.__qualname__}.{name} is not exported to its group; mark it @endpoint "
            "(orlhf/distributed/endpoints.py) if it is meant to be called remotely"
        )
    return name
