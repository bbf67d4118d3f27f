"""Hosts of their own on one machine: each a network namespace with one interface and address, joined by veth pairs
to a bridge in the root namespace, each running a Ray node.

    root namespace:  bridge <tag>br (no address: layer 2 only, so nothing is routed and no sysctl changes)
                       |-- <tag>v0 ==veth== <tag>e0 in namespace <tag>h0: 10.R.S.2/24, the Ray head
                       |-- <tag>v1 ==veth== <tag>e1 in namespace <tag>h1: 10.R.S.3/24, a Ray worker node
                       `-- ...

Unlike ray.cluster_utils.Cluster (several raylets on one address), an address here is reachable only where the
bridge carries it: 127.0.0.1 is each host's own, and cutting a host's link (`cut`) leaves its processes alive but
unreachable, a network partition. Every name starts with `tag` (orlhfmh + a random suffix), so a failed teardown's
leftovers are recognisable. `close()` undoes everything in reverse order (processes in the namespaces, the
namespaces, the links, the bridge, /etc/netns/<ns>), whatever failed on the way there.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

PREFIX = "orlhfmh"  # every name this module creates starts with it
RAY = str(Path(sys.executable).parent / "ray")
GCS_PORT = 6380
# A node that misses 4 health checks in a row, 2 s apart, each unanswered for 3 s, is dead: within ~20 s (Ray's
# defaults take about a minute for a node cut off, whose checks time out instead of failing). Not faster: a loaded
# 2-core machine must not lose live nodes.
SYSTEM_CONFIG = '{"health_check_period_ms": 2000, "health_check_timeout_ms": 3000, "health_check_failure_threshold": 4}'


def can_build_hosts() -> Optional[str]:
    """None when this machine can build namespaced hosts, else why not, in one line."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "building hosts (ip netns, veth, bridge) needs root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res


@dataclass(eq=False)  # compared and hashed by identity: a host is itself
class Host:
    index: int
    ns: str  # its network namespace
    ip: str  # its address on the bridge's subnet
    iface: str  # its interface on the bridge (inside the namespace)
    veth: str  # the root namespace's end of that link: what `cut` takes down and whose counters count its traffic
    temp_dir: str  # prefix of Ray's temp dir of each node started here (<temp_dir>-<k>): as on a machine of its own
    rays: list = field(default_factory=list)  # the `ray start --block` processes started here

    def argv(self, *command: str) -> list[str]:
        """`command` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *command]

    def pids(self) -> list[int]:
        """Every process in this host's namespace."""
        return [int(p) for p in sh("ip", "netns", "pids", self.ns, check=False).stdout.split()]


class Hosts:
    """`n` hosts on one bridge. Use as a context manager, or call close() in a finally."""

    def __init__(self, n: int):
        self.tag = PREFIX + secrets.token_hex(2)
        self.bridge = self.tag + "br"
        subnet = f"10.{random.randint(64, 250)}.{random.randint(0, 255)}"  # namespaces' own: no clash possible
        self.hosts = [
            Host(
                i, f"{self.tag}h{i}", f"{subnet}.{i + 2}", f"{self.tag}e{i}", f"{self.tag}v{i}", f"/tmp/{self.tag}-{i}"
            )
            for i in range(n)
        ]
        self._undo: list = []  # what close() runs, last first
        # Every process of this cluster: Ray's token authentication (on by default for `ray start --head`) with a
        # token of its own, so that nothing else on the machine joins it, nor it anything else.
        self.env = {
            **os.environ,
            "PATH": f"{Path(RAY).parent}:{os.environ['PATH']}",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(16),
        }

    def __enter__(self) -> "Hosts":
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the network -------------------------------------------------------------------------------------------------
    def build(self) -> None:
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        self._undo.append(("ip", "link", "del", self.bridge))
        sh("ip", "link", "set", self.bridge, "up")
        for h in self.hosts:
            sh("ip", "netns", "add", h.ns)
            self._undo.append(("netns", h))
            sh("ip", "link", "add", h.veth, "type", "veth", "peer", "name", h.iface)
            self._undo.append(("ip", "link", "del", h.veth))
            sh("ip", "link", "set", h.iface, "netns", h.ns)
            sh("ip", "link", "set", h.veth, "master", self.bridge)
            sh("ip", "link", "set", h.veth, "up")
            sh(*h.argv("ip", "addr", "add", f"{h.ip}/24", "dev", h.iface))
            sh(*h.argv("ip", "link", "set", h.iface, "up"))
            sh(*h.argv("ip", "link", "set", "lo", "up"))

    def add_dead_interface(self, host: Host, hostname_too: bool = True) -> str:
        """A second interface on `host` that reaches nothing (a veth whose other end is in a namespace of its own:
        a docker bridge, a management network), made its default route; with `hostname_too` the machine's
        hostname resolves to it inside `host` (/etc/netns/<ns>/hosts, which `ip netns exec` mounts over
        /etc/hosts). Returns its address."""
        lone, inner, outer = f"{self.tag}x{host.index}", f"{self.tag}d{host.index}", f"{self.tag}o{host.index}"
        address = f"172.31.{random.randint(0, 255)}.2"
        sh("ip", "netns", "add", lone)
        self._undo.append(("netns", Host(-1, lone, "", "", "", "")))
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        self._undo.append(("ip", "link", "del", inner))
        sh("ip", "link", "set", inner, "netns", host.ns)
        sh("ip", "link", "set", outer, "netns", lone)
        sh(*host.argv("ip", "addr", "add", f"{address}/24", "dev", inner))
        sh(*host.argv("ip", "link", "set", inner, "up"))
        sh(*host.argv("ip", "route", "add", "default", "via", address.rsplit(".", 1)[0] + ".1", "dev", inner))
        if hostname_too:
            folder = Path("/etc/netns") / host.ns
            folder.mkdir(parents=True, exist_ok=True)
            self._undo.append(("rmtree", folder))
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n{address} {socket.gethostname()}\n")
        return address

    def cut(self, host: Host) -> None:
        """Take `host`'s link down: its processes live on, nothing reaches them, they reach nothing."""
        sh("ip", "link", "set", host.veth, "down")

    def mend(self, host: Host) -> None:
        sh("ip", "link", "set", host.veth, "up")

    def link_bytes(self, host: Host) -> int:
        """Bytes through `host`'s link so far, both ways (the root end's counters)."""
        stats = Path("/sys/class/net") / host.veth / "statistics"
        return sum(int((stats / f"{way}_bytes").read_text()) for way in ("rx", "tx"))

    # ---- Ray ---------------------------------------------------------------------------------------------------------
    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        """The Ray head's GCS address (reachable from every host, and from inside the head's namespace)."""
        return f"{self.head.ip}:{GCS_PORT}"

    def start_ray(self, host: Host, num_cpus: int) -> None:
        """A Ray node on `host` (the head: the first on hosts[0]), advertising `host.ip`; returns once it is in the
        cluster."""
        common = ["--block", "--node-ip-address", host.ip, "--num-cpus", str(num_cpus), "--disable-usage-stats"]
        # Each node its own temp dir: one that ended may leave its socket files behind (a raylet declared dead)
        temp_dir, name = f"{host.temp_dir}-{len(host.rays)}", f"{host.ns}-{len(host.rays)}"
        common += ["--temp-dir", temp_dir, "--node-name", name]
        if host is self.head and not host.rays:
            argv = [RAY, "start", "--head", "--port", str(GCS_PORT), "--include-dashboard", "false"]
            argv += ["--system-config", SYSTEM_CONFIG]
        else:
            argv = [RAY, "start", "--address", self.address]
        log = open(f"{host.temp_dir}.log", "a")
        self._undo.append(("rmtree", Path(temp_dir)))
        if not host.rays:
            self._undo.append(("rmtree", Path(f"{host.temp_dir}.log")))
        proc = subprocess.Popen(
            host.argv(*argv, *common), env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        host.rays.append(proc)
        self.wait_for_node(host, name)

    def wait_for_node(self, host: Host, name: str, timeout_s: float = 120) -> None:
        """Until the cluster lists node `name` alive (asked from inside the head's namespace, by a driver that polls
        the head: one connection, not one per poll)."""
        script = (
            "import sys, time, ray\n"
            "ray.init(address=sys.argv[1], log_to_driver=False, configure_logging=False)\n"
            "deadline = time.monotonic() + float(sys.argv[3])\n"
            "alive = lambda: any(m['NodeName'] == sys.argv[2] and m['Alive'] for m in ray.nodes())\n"
            "while not alive() and time.monotonic() < deadline:\n"
            "    time.sleep(0.5)\n"
            "sys.exit(0 if alive() else 1)\n"
        )
        argv = self.head.argv(sys.executable, "-c", script, self.address, name, str(timeout_s))
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s + 60, env=self.env)
        if res.returncode != 0:
            log = Path(f"{host.temp_dir}.log").read_text()[-3000:]
            raise RuntimeError(f"the Ray node {name} did not join:\n{log}\n{res.stderr[-2000:]}")

    def kill(self, host: Host) -> None:
        """Kill every process on `host` at once (a crashed machine); its network stays."""
        for pid in host.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---- teardown ----------------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Undo everything, last first; each step whatever the others did."""
        self._stop_processes(self.hosts)  # first, so nothing holds a namespace or writes into a temp dir meanwhile
        for step in reversed(self._undo):
            try:
                if step[0] == "netns":
                    self._stop_processes([step[1]])
                    sh("ip", "netns", "del", step[1].ns, check=False)
                elif step[0] == "rmtree":
                    path = Path(step[1])
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
                else:
                    sh(*step, check=False)
            except Exception as e:  # noqa: BLE001 - go on with the rest; the leftovers check names what stayed
                print(f"teardown step {step}: {e}", file=sys.stderr)
        self._undo = []
        etc = Path("/etc/netns")
        if etc.is_dir() and not any(etc.iterdir()):
            etc.rmdir()

    @staticmethod
    def _stop_processes(hosts: list[Host], grace_s: float = 1.0) -> None:
        """SIGTERM to every process in the hosts' namespaces, SIGKILL to what is left after `grace_s`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in [p for h in hosts for p in h.pids()]:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace_s
            while any(h.pids() for h in hosts) and time.monotonic() < deadline:
                time.sleep(0.2)
        for proc in [p for h in hosts for p in h.rays]:  # reaped: no zombie of ours left
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def leftovers(self) -> list[str]:
        """Names of this instance's namespaces and links that still exist (empty after close())."""
        names = sh("ip", "netns", "list", check=False).stdout.split()
        names += [line.split(":")[1].strip().split("@")[0] for line in sh("ip", "-o", "link").stdout.splitlines()]
        return sorted(n for n in names if n.startswith(self.tag))
