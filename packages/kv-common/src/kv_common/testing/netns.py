"""Test hosts on one machine: Linux network namespaces joined by a bridge.

    with TestNetwork() as net:
        prefill = net.add_host("prefill")            # its own namespace, address 10.213.N.11
        proc = prefill.start("prefill", "python -m ...", log_dir=tmp)
        prefill.slow(rate_mbit=300)                   # tbf on both ends of its link
        prefill.cut(); prefill.restore()              # link down / up: packets are dropped, not refused

Layout (a deployment in miniature; nothing leaves the machine):

* one bridge ``<prefix>br`` in the root namespace, holding the network's first address
  (``10.213.N.1/24``): the test process itself reaches every host's servers directly (HTTP clients,
  ``/metrics``, side-channel queries) without entering a namespace;
* one namespace per host, ``<prefix>-<name>``, with ``lo`` up (engines talk to themselves over
  loopback) and ``eth0``, one end of a veth pair whose other end ``<prefix>v<i>`` sits in the
  bridge, plus ``default dev eth0``: vLLM's host-IP helper (a UDP "connect" to 8.8.8.8, nothing is
  sent) then finds the host's own address, as on a real machine. Forwarding is not turned on, so
  no packet is routed beyond the bridge.

Needs root, ``ip`` and ``tc`` (iproute2). Where a namespace cannot be made, :class:`NetnsUnavailable`
says why: a test fails with the reason, it does not skip. Everything made carries the prefix
``kvn<pid>``: :meth:`TestNetwork.close` removes it (after a failed test too), and a new network
first sweeps what networks of dead pids left (a killed pytest).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["Host", "HostProcess", "NetnsUnavailable", "TestNetwork", "sweep_stale"]

PREFIX_RE = re.compile(r"^kvn(\d+)[a-z]?(?:-|br$|v\d+$)")
_SUBNETS = ipaddress.IPv4Network("10.213.0.0/16")
_IP_TIMEOUT_S = 20.0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a kernel without them)."""


def _run(*args: str, check: bool = True, timeout_s: float = _IP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout_s, check=False)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, args, proc.stdout, proc.stderr)
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _link_names() -> list[str]:
    out = _run("ip", "-o", "link", "show", check=False).stdout
    # "12: kvn77v0@if11: <...>" -> "kvn77v0"
    return [m.group(1) for m in re.finditer(r"^\d+:\s+([^:@\s]+)", out, re.M)]


def _kill_namespace_processes(ns: str) -> None:
    """Every process still inside ``ns`` (we started them all there): SIGKILL, then wait."""
    pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while pids and time.monotonic() < deadline:
        pids = [p for p in pids if _pid_alive(p) and not _is_zombie(p)]
        time.sleep(0.05)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _remove(namespaces: Sequence[str], links: Sequence[str]) -> None:
    for ns in namespaces:
        _kill_namespace_processes(ns)
        _run("ip", "netns", "delete", ns, check=False)  # takes its veth pair with it
    for link in links:
        _run("ip", "link", "delete", link, check=False)


def sweep_stale() -> list[str]:
    """Remove namespaces and links a network of a dead process left behind; their names."""
    stale_ns = [n for n in _netns_names() if (m := PREFIX_RE.match(n)) and not _pid_alive(int(m.group(1)))]
    _remove(stale_ns, [])
    stale_links = [n for n in _link_names() if (m := PREFIX_RE.match(n)) and not _pid_alive(int(m.group(1)))]
    _remove([], stale_links)
    return stale_ns + stale_links


def _used_subnets() -> set[ipaddress.IPv4Network]:
    out = _run("ip", "-o", "-4", "addr", "show", check=False).stdout
    return {ipaddress.IPv4Interface(m.group(1)).network for m in re.finditer(r"inet (\S+)", out)}


def _tbf(dev: str, rate_mbit: float, ns: str | None) -> None:
    # burst: at least one rate-tick of bytes (rate / HZ) and a few full frames; latency bounds the queue.
    burst = max(64 << 10, int(rate_mbit * 1e6 / 8 / 250))
    prefix = ("ip", "netns", "exec", ns) if ns else ()
    _run(*prefix, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
         "burst", str(burst), "latency", "200ms")


class HostProcess:
    """A shell command running inside a host (its own process group, output in ``log``)."""

    def __init__(self, host: Host, name: str, command: str, env: Mapping[str, str] | None, log_dir: Path) -> None:
        self.host, self.name, self.command = host, name, command
        self.log = Path(log_dir) / f"{name}.log"
        self._fh = open(self.log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen([*host.exec_prefix, "bash", "-c", command], env=dict(env or os.environ),
                                     stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, cwd=str(log_dir))

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_bytes()[-chars:].decode("utf-8", "replace")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, timeout_s: float = 30.0) -> int | None:
        if self.proc.poll() is None:
            self.kill(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill(signal.SIGKILL)  # stragglers of the group (EngineCore, workers)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._fh.close()
        return self.proc.returncode


class Host:
    """One test host: a namespace with one address on the network's bridge."""

    def __init__(self, net: TestNetwork, name: str, address: str, index: int) -> None:
        self.net, self.name, self.address = net, name, address
        self.namespace = f"{net.prefix}-{name}"
        self.bridge_port = f"{net.prefix}v{index}"  # our end of its link, in the root namespace
        self.exec_prefix: list[str] = ["ip", "netns", "exec", self.namespace]
        self.processes: list[HostProcess] = []

    def run(self, *args: str, check: bool = True, timeout_s: float = _IP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        """A short command inside the host (e.g. ``ip addr``), waited for."""
        return _run(*self.exec_prefix, *args, check=check, timeout_s=timeout_s)

    def popen(self, args: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
        """``subprocess.Popen`` of ``args`` inside the host; the caller stops it."""
        return subprocess.Popen([*self.exec_prefix, *args], **kwargs)  # type: ignore[call-overload, no-any-return]

    def start(self, name: str, command: str, log_dir: str | os.PathLike[str],
              env: Mapping[str, str] | None = None) -> HostProcess:
        """``bash -c command`` inside the host in its own process group, stopped by :meth:`TestNetwork.close`."""
        proc = HostProcess(self, name, command, env, Path(log_dir))
        self.processes.append(proc)
        return proc

    # ---------------------------------------------------------------- the link
    def cut(self) -> None:
        """Take the host's link down: packets to and from it are dropped (no reset, no refusal),
        as when a cable or a switch port dies. Connections stay open and time out."""
        _run("ip", "link", "set", self.bridge_port, "down")

    def restore(self) -> None:
        _run("ip", "link", "set", self.bridge_port, "up")
        # The bridge port goes through no STP states (stp off), but give the carrier a moment.
        deadline = time.monotonic() + 5
        while "LOWER_UP" not in _run("ip", "link", "show", self.bridge_port).stdout and time.monotonic() < deadline:
            time.sleep(0.05)

    def slow(self, rate_mbit: float) -> None:
        """A token bucket (``tc tbf``) of ``rate_mbit`` on both ends of the host's link: traffic to
        and from the host is limited to that rate (no delay or loss: this kernel has no netem)."""
        _tbf(self.bridge_port, rate_mbit, None)
        _tbf("eth0", rate_mbit, self.namespace)

    def unslow(self) -> None:
        _run("tc", "qdisc", "del", "dev", self.bridge_port, "root", check=False)
        self.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)


class TestNetwork:
    """A bridge and the hosts on it; a context manager that removes everything it made."""

    __test__ = False  # not a pytest test class

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = prefix or f"kvn{os.getpid()}"
        if not PREFIX_RE.match(f"{self.prefix}br"):
            raise ValueError(f"prefix {self.prefix!r} must be 'kvn<pid>' plus at most one letter")
        if len(f"{self.prefix}v99") > 15:  # IFNAMSIZ - 1
            raise ValueError(f"prefix {self.prefix!r} is too long for interface names")
        self.bridge = f"{self.prefix}br"
        self.hosts: dict[str, Host] = {}
        self.subnet: ipaddress.IPv4Network | None = None
        self.gateway: str | None = None
        self._made = False

    # ---------------------------------------------------------------- lifecycle
    def open(self) -> TestNetwork:
        self._check_available()
        sweep_stale()
        self._remove_own()  # a previous network of this very process that was not closed
        used = _used_subnets()
        self.subnet = next((s for s in _SUBNETS.subnets(new_prefix=24) if s not in used), None)
        if self.subnet is None:
            raise NetnsUnavailable(f"no free /24 left in {_SUBNETS}")
        self.gateway = str(self.subnet.network_address + 1)
        self._made = True
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except subprocess.CalledProcessError as exc:
            self.close()
            raise NetnsUnavailable(f"cannot make bridge {self.bridge}: {exc.stderr.strip()}") from exc
        return self

    def __enter__(self) -> TestNetwork:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process started in a host, remove every namespace, veth and the bridge."""
        procs = [proc for host in self.hosts.values() for proc in host.processes]
        for proc in procs:  # all at once: servers shut down in parallel
            proc.kill(signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.stop(timeout_s=15)
        self._remove_own()
        self.hosts.clear()
        self._made = False

    def _remove_own(self) -> None:
        mine = lambda n: n == self.bridge or n.startswith(f"{self.prefix}-") or re.fullmatch(  # noqa: E731
            rf"{self.prefix}v\d+", n) is not None
        _remove([n for n in _netns_names() if mine(n)], [n for n in _link_names() if mine(n)])

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist (empty after :meth:`close`)."""
        return [n for n in _netns_names() + _link_names()
                if n == self.bridge or n.startswith(f"{self.prefix}-") or re.fullmatch(rf"{self.prefix}v\d+", n)]

    @staticmethod
    def _check_available() -> None:
        missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
        if missing:
            raise NetnsUnavailable(f"test hosts need iproute2: {', '.join(missing)} not on PATH")
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"test hosts need root to make network namespaces (euid {os.geteuid()})")

    # ---------------------------------------------------------------- hosts
    def add_host(self, name: str, address: str | None = None) -> Host:
        """A new host ``name`` (letters, digits, '-'), at ``address`` or the next free one (.11, .12, ...)."""
        if not self._made or self.subnet is None:
            raise RuntimeError("open the TestNetwork first (use it as a context manager)")
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,30}", name) or name in self.hosts:
            raise ValueError(f"host name {name!r}: lower-case letters, digits and '-', unique")
        taken = {h.address for h in self.hosts.values()}
        if address is None:
            address = next(str(a) for a in list(self.subnet.hosts())[10:] if str(a) not in taken)
        elif ipaddress.ip_address(address) not in self.subnet or address in taken or address == self.gateway:
            raise ValueError(f"address {address} is not a free address of {self.subnet}")
        host = Host(self, name, address, index=len(self.hosts))
        self.hosts[name] = host
        ns, port = host.namespace, host.bridge_port
        try:
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", port, "master", self.bridge)
            _run("ip", "link", "set", port, "up")
            host.run("ip", "link", "set", "lo", "up")
            host.run("ip", "addr", "add", f"{address}/24", "dev", "eth0")
            host.run("ip", "link", "set", "eth0", "up")
            # vLLM's get_ip() "connects" a UDP socket to 8.8.8.8: a default route makes it pick eth0's
            # address. No gateway, no forwarding: such packets die on the bridge.
            host.run("ip", "route", "add", "default", "dev", "eth0")
        except subprocess.CalledProcessError as exc:
            raise NetnsUnavailable(f"cannot make host {name} ({ns}): {' '.join(exc.cmd)}: {exc.stderr.strip()}") \
                from exc
        return host

    def url(self, host: str, port: int, path: str = "") -> str:
        return f"http://{self.hosts[host].address}:{port}{path}"
