"""N throwaway "hosts" on one Linux machine: network namespaces joined by a bridge.

Each host is a network namespace with ``lo`` up and one veth, ``eth0``, holding
its own address in a private test subnet (10.213.K.0/24, K from the pid). The
other ends of the veths hang on a bridge in a namespace of its own, so nothing
is added to the root namespace's links or routes, and packets can only reach the
test's own hosts: there is no way out. ``eth0`` has multicast on and a route for
224.0.0.0/4, so mDNS (224.0.0.251) crosses the bridge whichever way a program
picks its multicast interface (python-zeroconf's ``InterfaceChoice.All`` sets
it per socket and needs no route; ``InterfaceChoice.Default`` does).

``NetnsHosts(n, links=["1gbe", "1gbe", "wifi"])`` gives each host a link of that
profile instead (tests/kit/linkshape.py: latency, jitter, loss and rate, emulated in
userspace because the kernel has no netem): each host's ``eth0`` is then a TUN device
whose packets the emulator, a process in the bridge's namespace, delivers as the
links would. ``segments=[0, 1, 0, 1], uplink="1gbe"`` puts the hosts on segments
(two switches, two rooms) joined by an uplink of that profile, which a packet between
segments crosses too.

Needs root and iproute2. ``netns_available()`` says which is missing, for an assertion.
Everything is torn down on exit, on failure halfway through creation, and at
interpreter exit if a caller forgot: processes started through ``popen`` (and
any other process left inside the namespaces) are ended by id, then the
namespaces are deleted, which deletes their veths and the bridge.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import signal
import subprocess
import select
import sys
from dataclasses import dataclass
from pathlib import Path

from ringd.base.servecmd import serve_command

from devkit import REPO, linkshape
from devkit.procs import stop_group

# Every `ip` command is local configuration; one that takes longer is stuck.
IP_COMMAND_TIMEOUT_S = 10.0
# How long a process gets to exit after SIGTERM before SIGKILL.
PROCESS_STOP_TIMEOUT_S = 5.0
# The emulator creates its TUN devices and says so; a Python start takes well under this.
EMULATOR_START_TIMEOUT_S = 30.0
SUBNET = "10.213.{k}.0/24"  # private (RFC 1918), and only ever inside our namespaces
BRIDGE = "br0"
HOST_INTERFACE = "eth0"

_runs = itertools.count()


class NetnsError(RuntimeError):
    """An `ip` command failed; the message has the command and its stderr."""


def ip(*args: str) -> str:
    """Run `ip ARGS`; its stdout, or NetnsError with its stderr."""
    cmd = ["ip", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=IP_COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` took over {IP_COMMAND_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    name: str  # the network namespace
    ip: str  # its address on HOST_INTERFACE
    interface: str = HOST_INTERFACE


class NetnsHosts:
    """``with NetnsHosts(3) as net:`` three hosts on one bridge; see the module docstring."""

    def __init__(self, n: int, links: list | None = None, segments: list[int] | None = None, uplink=None):
        if links is not None and len(links) != n:
            raise ValueError(f"{len(links)} link profiles for {n} hosts; give one per host")
        if segments is not None and links is None:
            raise ValueError("segments are joined by emulated links; give links too")
        self.links = None if links is None else [_profile(x) for x in links]
        self.segments = segments
        self.uplink = None if uplink is None else _profile(uplink)
        if self.links is not None:
            linkshape.LinkModel(self.links, segments=segments, uplink=self.uplink)  # its errors, before any namespace exists
        self._emulator: subprocess.Popen | None = None
        if not 1 <= n <= 250:
            raise ValueError(f"{n} hosts; a /24 test subnet holds 1 to 250")
        run = next(_runs)
        pid = os.getpid()
        tag = f"ringd-{pid}-{run}"  # unique per process and per use
        k = (pid * 7 + run) % 254 + 1
        self.subnet = SUBNET.format(k=k)
        self.bridge_ns = f"{tag}-br"
        self.hosts = [Host(f"{tag}-{i}", f"10.213.{k}.{i + 1}") for i in range(n)]
        self._created: list[str] = []  # namespaces to delete, in creation order
        self._procs: list[subprocess.Popen] = []

    def __enter__(self) -> NetnsHosts:
        atexit.register(self.close)
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def exec_prefix(self, i: int) -> list[str]:
        """Prepend to a command to run it on host i."""
        return ["ip", "netns", "exec", self.hosts[i].name]

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start argv on host i; it is ended (by pid) when the hosts are torn down."""
        proc = subprocess.Popen(self.exec_prefix(i) + argv, start_new_session=True, **kwargs)
        self._procs.append(proc)
        return proc

    def serve(self, i: int, log: Path, **flags) -> subprocess.Popen:
        """``ringd serve`` with ``flags`` (serve_command's keywords) on host i, this checkout's code,
        its output written to ``log``."""
        with open(log, "w") as out:  # the daemon holds its own copy of the file
            return self.popen(i, serve_command(**flags), cwd=REPO, stdout=out, stderr=out)

    def close(self) -> None:
        """End our processes, delete our namespaces. Safe to call twice."""
        atexit.unregister(self.close)
        for proc in self._procs:
            _stop(proc)
        self._procs.clear()
        if self._emulator is not None:
            _stop(self._emulator)
            self._emulator = None
        for ns in reversed(self._created):
            self._end_processes_inside(ns)
            try:
                ip("netns", "del", ns)
            except NetnsError as e:
                print(f"netns cleanup: {e}", file=sys.stderr)
        self._created.clear()

    # --- internals ------------------------------------------------------------------

    def _add_namespace(self, ns: str) -> None:
        ip("netns", "add", ns)
        self._created.append(ns)
        ip("-n", ns, "link", "set", "lo", "up")

    def _create(self) -> None:
        br = self.bridge_ns
        self._add_namespace(br)
        # Snooping off: the bridge floods every multicast group to every port, so
        # nothing depends on IGMP timing.
        ip("-n", br, "link", "add", BRIDGE, "type", "bridge", "mcast_snooping", "0")
        ip("-n", br, "link", "set", BRIDGE, "up")
        if self.links is not None:
            self._create_shaped()
            return
        for i, host in enumerate(self.hosts):
            self._add_namespace(host.name)
            port = f"h{i}"
            # Created in the bridge's namespace with its peer born in the host's:
            # no interface ever appears in the root namespace.
            ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", host.interface, "netns", host.name)
            ip("-n", br, "link", "set", port, "master", BRIDGE, "up")
            ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", host.interface)
            ip("-n", host.name, "link", "set", host.interface, "multicast", "on", "up")
            ip("-n", host.name, "route", "add", "224.0.0.0/4", "dev", host.interface)

    def _create_shaped(self) -> None:
        br = self.bridge_ns
        names = [f"t{i}" for i in range(len(self.hosts))]
        prefix = self.hosts[0].ip.rsplit(".", 1)[0]
        argv = [sys.executable, str(Path(__file__).with_name("linkshape.py")), "--names", ",".join(names),
                "--links", linkshape.encode(self.links), "--prefix", prefix]
        if self.segments is not None:
            argv += ["--segments", ",".join(str(s) for s in self.segments)]
        if self.uplink is not None:
            argv += ["--uplink", linkshape.encode(self.uplink)]
        self._emulator = subprocess.Popen(
            ["ip", "netns", "exec", br, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True
        )
        ready, _, _ = select.select([self._emulator.stdout], [], [], EMULATOR_START_TIMEOUT_S)
        line = self._emulator.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            raise NetnsError(f"the link emulator did not start within {EMULATOR_START_TIMEOUT_S} s (said {line!r})")
        for name, host, link in zip(names, self.hosts, self.links):
            self._add_namespace(host.name)
            # The emulator holds the TUN's file; the device itself moves to the host.
            ip("-n", br, "link", "set", name, "netns", host.name)
            ip("-n", host.name, "link", "set", name, "name", host.interface)
            ip("-n", host.name, "addr", "add", f"{host.ip}/24", "dev", host.interface)
            ip("-n", host.name, "link", "set", host.interface, "mtu", str(link.mtu), "multicast", "on", "up")
            ip("-n", host.name, "route", "add", "224.0.0.0/4", "dev", host.interface)

    @staticmethod
    def _end_processes_inside(ns: str) -> None:
        # Processes the test started in the namespace some other way than popen.
        try:
            pids = [int(p) for p in ip("netns", "pids", ns).split()]
        except NetnsError:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _profile(link) -> linkshape.Profile:
    return linkshape.profile(link) if isinstance(link, str) else link


def _stop(proc: subprocess.Popen) -> None:
    stop_group(proc, PROCESS_STOP_TIMEOUT_S)  # the session popen started: the child and its children
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def netns_available() -> str | None:
    """None when NetnsHosts can run here, else what is missing (for an assertion's message).

    Only what a machine may lack is checked; a failure to build the namespaces on
    one that has it all is the test's failure (NetnsError, from NetnsHosts itself).
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux; this is {sys.platform}"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); .ci/run runs as root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` command is not installed; `apt-get install iproute2` (.ci/run installs it)"
    return None
