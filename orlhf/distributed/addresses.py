"""The address a process offers its peers in every rendezvous: DeepSpeed's MASTER_ADDR, the weight-sync group's
store, and the connections gloo and NCCL open themselves. One choice per process, made before any of them starts:

    --socket_ifname SPEC (else GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME as set)  ->  the interface matching SPEC
    else                                          ->  the interface of this host's route to the Ray head
    outside a Ray cluster                         ->  loopback

Why the route to the head: it is the one network every host of the cluster shares by construction (its raylet
reached the head over it). The libraries' own guesses are host-local: gloo binds to what the hostname resolves to
(127.0.0.1 on many machines, a docker bridge or a management network on others) and advertises that to its peers,
which then wait on an address that is not there until their timeout; NCCL takes the first interface not named
docker* or lo*. A SPEC reads as NCCL_SOCKET_IFNAME does: comma-separated name prefixes, `^` before the list to
exclude them, `=` before it for exact names.

pin(spec) makes the choice in a rank or engine process and exports it (GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME, the
chosen interface by its exact name) so that DeepSpeed's default group, NCCL and vLLM follow it; local_address() and
gloo_group() then use it for orlhf's own groups.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import NamedTuple, Optional

CONNECT_S = 30.0  # one TCP handshake's wait: a reachable host answers within milliseconds, loaded or not
SPEC_ENV = "ORLHF_SOCKET_IFNAME"  # the driver's --socket_ifname, in each rank and engine process's environment
FLAG = "--socket_ifname"


class Endpoint(NamedTuple):
    ip: str
    interface: str
    how: str  # why this one, for messages: "--socket_ifname eth1", "the route to the Ray head 10.0.0.2"


class AddressError(RuntimeError):
    """No interface of this host fits the request, or a peer's rendezvous address cannot be reached from here; one
    line naming the address and the flag to set."""


_pinned: Optional[Endpoint] = None


def interfaces() -> dict[str, str]:
    """{interface name: its first IPv4 address} of this host (network namespace), in the system's order."""
    import psutil

    out = {}
    for name, addrs in psutil.net_if_addrs().items():
        ipv4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if ipv4:
            out[name] = ipv4[0]
    return out


def matches(spec: str, name: str) -> bool:
    """Whether interface `name` fits `spec`, read as NCCL_SOCKET_IFNAME is ("eth", "^docker,lo", "=eth0")."""
    exclude = spec.startswith("^")
    spec = spec[1:] if exclude else spec
    exact = spec.startswith("=")
    spec = spec[1:] if exact else spec
    hit = any(name == p if exact else name.startswith(p) for p in spec.split(",") if p)
    return hit != exclude


def route_source(head_ip: str) -> str:
    """The source address of this host's route to `head_ip` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in head_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((head_ip, 9))
        return s.getsockname()[0]


def head_ip() -> Optional[str]:
    """The Ray head's address as this process's Ray connection knows it; None outside a Ray cluster."""
    import ray

    if not ray.is_initialized():
        return None
    return ray.get_runtime_context().gcs_address.rsplit(":", 1)[0]


def choose(spec: Optional[str], head: Optional[str], ifaces: dict[str, str]) -> Endpoint:
    """The endpoint for `spec` (None: the route to `head`; no head either: loopback) among `ifaces`."""
    if spec:
        fit = [name for name in ifaces if matches(spec, name)]
        if not fit:
            listed = ", ".join(f"{n} {a}" for n, a in ifaces.items())
            raise AddressError(
                f"no interface of {socket.gethostname()} matches {FLAG} {spec} (it has {listed}): set {FLAG} to "
                "the interface the hosts reach each other on"
            )
        return Endpoint(ifaces[fit[0]], fit[0], f"{FLAG} {spec}")
    if head is None:
        return Endpoint("127.0.0.1", _owner("127.0.0.1", ifaces), "no Ray cluster: loopback")
    ip = route_source(head)
    return Endpoint(ip, _owner(ip, ifaces), f"the route to the Ray head {head}")


def _owner(ip: str, ifaces: dict[str, str]) -> str:
    for name, address in ifaces.items():
        if address == ip:
            return name
    return next((n for n, a in ifaces.items() if a.startswith("127.")), "lo")


def requested_spec(environ=os.environ) -> Optional[str]:
    """The interface request: the driver's --socket_ifname, else what the user (or pin, in a parent process) exported
    for gloo (exact names) or NCCL."""
    if environ.get(SPEC_ENV):
        return environ[SPEC_ENV]
    if environ.get("GLOO_SOCKET_IFNAME"):
        return "=" + environ["GLOO_SOCKET_IFNAME"]
    return environ.get("NCCL_SOCKET_IFNAME") or None


def spec_env(spec: Optional[str]) -> dict[str, str]:
    """The environment that carries --socket_ifname into a rank or engine process (read there by pin)."""
    return {SPEC_ENV: spec} if spec else {}


def pin(environ=os.environ) -> Endpoint:
    """Choose this process's endpoint once and export it for gloo and NCCL; later calls return the same one."""
    global _pinned
    if _pinned is None:
        chosen = choose(requested_spec(environ), head_ip(), interfaces())
        environ["GLOO_SOCKET_IFNAME"] = chosen.interface
        environ["NCCL_SOCKET_IFNAME"] = "=" + chosen.interface
        _pinned = chosen
    return _pinned


def local_address() -> str:
    """This process's rendezvous address (pin's choice)."""
    return pin().ip


def free_port() -> int:
    """A TCP port free on this host now (the OS picks it): a rendezvous or sync group's port."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def gloo_group(store, rank: int, world_size: int, timeout: timedelta):
    """A stateless ProcessGroupGloo over `store` whose connections use this process's endpoint: gloo would otherwise
    bind to what the hostname resolves to and advertise that to its peers."""
    from torch.distributed import ProcessGroupGloo

    options = ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [ProcessGroupGloo.create_device(hostname=local_address())]
    return ProcessGroupGloo(store, rank, world_size, options)


def reach(host: str, port: int, what: str, timeout_s: float) -> None:
    """Return once host:port (a group's store) accepts a TCP connection. Its listener may start after this call, so
    a refusal is tried again until `timeout_s`; an address that gives no answer or has no route fails at once with
    an AddressError, instead of the store's client retrying it until its timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=CONNECT_S).close()
            return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                why = f"nothing listened there for {timeout_s:.0f} s"
                break
            time.sleep(0.2)
        except OSError as e:  # no route, or no answer within CONNECT_S
            why = e.strerror or "no answer"
            break
    raise AddressError(
        f"{what} at {host}:{port} cannot be reached from {local_address()} ({why}): set {FLAG} to an interface the "
        "hosts reach each other on"
    )
