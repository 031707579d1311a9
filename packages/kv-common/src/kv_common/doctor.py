"""``python -m kv_common doctor``: what would go wrong at start-up, checked before serving.

What it checks, each a line (``--json``: one object for scripts); the exit status is 1 when any
check finds a problem:

- installed connectors and who owns each name in vLLM's registry (``kv_common.registry``);
- ``--kv-transfer-config``: the connector (each child of a ``MultiConnector``) and its
  ``kv_connector_extra_config`` parsed by the connector's own start-up parser (the spec's
  ``config_parser``), so a bad key fails here with the same message as in vLLM;
- from the parsed config (``ConnectorConfig.preflight``): the addresses this instance tells its
  peers (a warning when one is loopback, unspecified, or not an address of this machine: peers on
  other machines would wait for it until their deadline), ports this instance will listen on are
  free on the configured host, peers and the Mooncake master accept a TCP connection within a short
  deadline, store directories are writable, the engines the config needs import; a listener that
  answers any peer (no shared secret) and binds beyond loopback is a warning;
- engines installed: Mooncake's TransferEngine and Store, UCM (information unless a config needs them);
- the Mooncake build (``kv_common.mooncake_build``): which distribution provides the ``mooncake``
  module (two together is a problem) and whether it fits the device vLLM runs on (a warning).

Import-light like the registry: no vLLM unless asked to show name owners, no connector package
imported except through the ``config_parser`` string.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib
import ipaddress
import json
import logging
import os
import socket
import struct
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from kv_common import mooncake_build
from kv_common.registry import ConnectorSpec, discover_connectors, name_owners

OK, PROBLEM, INFO = "ok", "problem", "info"
# WARN: worth fixing, shown, but the instance starts and works: the exit status stays 0
# (loopback is right when every peer runs on this machine).
WARN = "warning"
DEFAULT_TIMEOUT_S = 2.0
# vLLM's KVTransferConfig defaults (vllm/config/kv_transfer.py).
VLLM_DEFAULT_KV_PORT = 14579
VLLM_DEFAULT_KV_IP = "127.0.0.1"
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
MULTI_CONNECTOR = "MultiConnector"

# Engines reported whether or not a config needs them: (module, attribute, what).
ENGINES = (
    ("mooncake.engine", "TransferEngine", "Mooncake TransferEngine (kv-mooncake P2P)"),
    ("mooncake.store", "MooncakeDistributedStore", "Mooncake Store client (kv-store backend 'mooncake')"),
    ("ucm", "", "UCM (kv-ucm)"),
)


@dataclass(frozen=True)
class Preflight:
    """What a parsed config needs from the machine; built by ``ConnectorConfig.preflight``."""

    # (host, what, the key that overrides it): an address peers are told to reach this instance at
    advertise: list[tuple[str, str, str]] = field(default_factory=list)
    bind: list[tuple[str, int, str]] = field(default_factory=list)  # (host, port, what): must be free
    connect: list[tuple[str, int, str]] = field(default_factory=list)  # (host, port, what): must answer
    writable_dirs: list[tuple[str, str]] = field(default_factory=list)  # (path, what)
    modules: list[tuple[str, str, str]] = field(default_factory=list)  # (module, attribute, what)
    notes: list[str] = field(default_factory=list)  # informational lines
    problems: list[str] = field(default_factory=list)  # found while building it (e.g. no master address)
    # (host, port, what) of listeners that will answer any peer (no shared secret): a warning
    # unless bound to loopback only.
    unauthenticated_binds: list[tuple[str, int, str]] = field(default_factory=list)
    # What in this config runs on Mooncake (e.g. "Mooncake TransferEngine"): the installed Mooncake
    # build is named under the config's section and checked against the device (kv_common.mooncake_build).
    mooncake_build: str = ""


@dataclass(frozen=True)
class Check:
    section: str
    status: str
    detail: str


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, section: str, status: str, detail: str) -> None:
        self.checks.append(Check(section, status, detail))

    @property
    def ok(self) -> bool:
        return all(c.status != PROBLEM for c in self.checks)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [asdict(c) for c in self.checks]}

    def to_text(self) -> str:
        width = max((len(c.section) for c in self.checks), default=0)
        lines = [f"{c.status.upper():<7}  {c.section:<{width}}  {c.detail}" for c in self.checks]
        problems = sum(c.status == PROBLEM for c in self.checks)
        lines.append("no problems found" if problems == 0 else f"{problems} problem(s) found")
        return "\n".join(lines)


# ---- the machine ------------------------------------------------------------------------------
def port_free(host: str, port: int) -> str | None:
    """None when ``host:port`` can be bound (the way a server binds it), else why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve {host!r}: {exc}"
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "in use"
            return str(exc)
    return None


def reachable(host: str, port: int, timeout_s: float) -> str | None:
    """None when a TCP connection to ``host:port`` opens within ``timeout_s``, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or str(exc)


def beyond_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` can be reached from other machines (an unresolvable
    name counts as reachable: it cannot be shown not to be)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return True
    for info in infos:
        try:
            ip = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        except ValueError:
            return True
        if not ip.is_loopback:
            return True
    return not infos


_SIOCGIFADDR = 0x8915  # Linux: an interface's (primary) IPv4 address


def local_addresses() -> list[str]:
    """This machine's addresses: IPv4 per interface (``SIOCGIFADDR``), IPv6 from ``/proc/net/if_inet6``,
    and every address ``ip -o addr`` lists (secondary ones included) where ``ip`` is installed. Each
    source is optional: whatever can be read is returned."""
    found: list[str] = []
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
                found.append(socket.inet_ntoa(packed[20:24]))
    with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6", encoding="ascii") as f:
        for line in f:
            digits = line.split()[0]
            found.append(str(ipaddress.IPv6Address(bytes.fromhex(digits))))
    found.extend(_ip_command_addresses())
    return list(dict.fromkeys(found))


def _ip_command_addresses() -> list[str]:
    import shutil
    import subprocess

    ip = shutil.which("ip")
    if ip is None:
        return []
    try:
        out = subprocess.run([ip, "-o", "addr"], capture_output=True, text=True, timeout=2.0, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    addresses = []
    for line in out.splitlines():
        words = line.split()
        for i, word in enumerate(words[:-1]):
            if word in ("inet", "inet6"):
                addresses.append(words[i + 1].split("/")[0])
    return addresses


def _is_local(address: str) -> bool:
    """An address this machine can bind (what a listener on it needs), where the kernel refuses
    to bind foreign addresses (``ip_nonlocal_bind`` off, the default)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sysctl = "/proc/sys/net/ipv6/ip_nonlocal_bind" if family == socket.AF_INET6 else "/proc/sys/net/ipv4/ip_nonlocal_bind"
    with contextlib.suppress(OSError), open(sysctl, encoding="ascii") as f:
        if f.read().strip() != "0":
            return False  # any address binds: the list of this machine's addresses decides alone
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((address, 0))
        return True
    except OSError:
        return False


def advertised_address(host: str, key: str) -> tuple[str, str]:
    """(status, text) for an address peers are told: OK when it is one of this machine's and not
    loopback, else WARN saying why and what to set."""
    fix = f"set VLLM_HOST_IP or {key!r} to the address peers reach this machine at"
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    except OSError as exc:
        return WARN, f"{host}, which does not resolve here ({exc}): {fix}"
    parsed = [ipaddress.ip_address(a.split("%")[0]) for a in addresses]
    shown = host if addresses == [host] else f"{host} ({', '.join(addresses)})"
    if any(a.is_unspecified for a in parsed):
        return WARN, f"{shown}, which no peer can connect to: {fix}"
    if all(a.is_loopback for a in parsed):
        return WARN, (f"{shown}, a loopback address: only peers on this machine can reach it (fine when every "
                      f"peer runs here); for peers on other machines {fix}")
    mine = local_addresses()
    if not any(a in mine or _is_local(a) for a in addresses):
        # Link-local addresses (fe80::) are left out: no peer on another link is told those.
        mine_text = ", ".join(a for a in mine if not ipaddress.ip_address(a.split("%")[0]).is_link_local) \
            or "none found"
        return WARN, f"{shown}, but {host} is not an address of this machine (its addresses: {mine_text}): {fix}"
    return OK, f"{shown}, an address of this machine"


def dir_writable(path: str) -> str | None:
    """None when files can be created in ``path`` (or in the nearest existing parent, which the
    connector creates it under), else why not."""
    probe = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return "no existing parent directory"
        probe = parent
    if not os.path.isdir(probe):
        return f"{probe} is not a directory"
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".kv-doctor-"):
            pass
    except OSError as exc:
        return f"cannot create a file in {probe}: {exc.strerror or exc}"
    return None


def importable(module: str, attribute: str = "") -> str | None:
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is the finding
        return f"{type(exc).__name__}: {exc}"
    if attribute and not hasattr(mod, attribute):
        return f"{module} has no {attribute}"
    return None


# ---- the config -------------------------------------------------------------------------------
def load_kv_transfer_config(text: str) -> dict[str, Any]:
    """``--kv-transfer-config``: a JSON object, or the path of a file holding one."""
    if not text.lstrip().startswith("{") and os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    return data


def find_spec(name: str, specs: Iterable[ConnectorSpec]) -> ConnectorSpec | None:
    for spec in specs:
        if name in spec.names:
            return spec
    return None


def config_parser(spec: ConnectorSpec) -> Callable[..., Any]:
    """The connector's own start-up parser: ``spec.config_parser``, else ``<package>.config:parse_config``."""
    target = spec.config_parser or f"{spec.module.split('.', 1)[0]}.config:parse_config"
    module, _, func = target.partition(":")
    return getattr(importlib.import_module(module), func)


def parse_connector_config(name: str, extra: Mapping[str, Any] | None, specs: Iterable[ConnectorSpec]) -> Any:
    """Parse ``extra`` as connector ``name`` does at start-up. Raises its config error."""
    spec = find_spec(name, specs)
    if spec is None:
        raise LookupError(f"{name!r} is not an installed kv-* connector")
    return config_parser(spec)(extra, name)  # errors name the connector as the config wrote it


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _captured_warnings() -> Iterator[list[str]]:
    """Warnings the config parser logs (kv_common.config's logger), as report lines, not stderr."""
    from kv_common import config as config_mod

    handler = _ListHandler()
    config_mod.logger.addHandler(handler)
    propagate, config_mod.logger.propagate = config_mod.logger.propagate, False
    try:
        yield handler.messages
    finally:
        config_mod.logger.removeHandler(handler)
        config_mod.logger.propagate = propagate


def _leaves(ktc: Mapping[str, Any], where: str) -> list[tuple[str, Mapping[str, Any]]]:
    """(where, kv-transfer-config) of each connector that will run: MultiConnector's children."""
    if ktc.get("kv_connector") != MULTI_CONNECTOR:
        return [(where, ktc)]
    children = (ktc.get("kv_connector_extra_config") or {}).get("connectors") or []
    out: list[tuple[str, Mapping[str, Any]]] = []
    for i, child in enumerate(children):
        out += _leaves(child if isinstance(child, Mapping) else {}, f"{where}.connectors[{i}]")
    return out


def check_config(report: Report, ktc: Mapping[str, Any], specs: list[ConnectorSpec], timeout_s: float,
                 peers: Iterable[tuple[str, int]] = ()) -> None:
    role = ktc.get("kv_role")
    if role is not None and role not in KV_ROLES:
        report.add("config", PROBLEM, f"kv_role {role!r} is not one of {', '.join(KV_ROLES)}")
    if ktc.get("kv_connector") == MULTI_CONNECTOR and not (ktc.get("kv_connector_extra_config") or {}).get("connectors"):
        report.add("config", PROBLEM, "MultiConnector: kv_connector_extra_config has no 'connectors' list")
    for where, leaf in _leaves(ktc, "kv_transfer_config"):
        name = leaf.get("kv_connector")
        section = f"config {name}" if name else "config"
        if not name:
            report.add(section, PROBLEM, f"{where}: no kv_connector")
            continue
        if find_spec(name, specs) is None:
            report.add(section, INFO, f"{where}: {name!r} is not a kv-* connector; not checked here")
            continue
        try:
            kv_port = int(leaf.get("kv_port", ktc.get("kv_port", VLLM_DEFAULT_KV_PORT)))
        except (TypeError, ValueError):
            report.add(section, PROBLEM, f"{where}: kv_port {leaf.get('kv_port')!r} is not a port number")
            continue
        with _captured_warnings() as warned:
            try:
                config = parse_connector_config(name, leaf.get("kv_connector_extra_config"), specs)
            except Exception as exc:  # noqa: BLE001 - the connector's own message names the key
                report.add(section, PROBLEM, f"{where}: {exc}")
                continue
        report.add(section, OK, f"{where}: kv_connector_extra_config parses ({type(config).__name__})")
        for message in warned:  # keys accepted without effect: the same warning the engine logs
            report.add(section, INFO, message)
        context = dict(leaf)
        context.setdefault("kv_role", role)
        context["kv_port"] = kv_port
        context.setdefault("kv_ip", ktc.get("kv_ip", VLLM_DEFAULT_KV_IP))
        preflight = getattr(config, "preflight", None)
        plan = preflight(context) if preflight is not None else None
        if plan is not None:
            run_preflight(report, section, plan, timeout_s)
    for host, port in peers:
        why = reachable(host, port, timeout_s)
        report.add("peers", OK if why is None else PROBLEM,
                   f"peer {host}:{port} " + ("accepts TCP" if why is None else f"unreachable: {why}"))


def run_preflight(report: Report, section: str, plan: Preflight, timeout_s: float) -> None:
    for problem in plan.problems:
        report.add(section, PROBLEM, problem)
    for note in plan.notes:
        report.add(section, INFO, note)
    for host, what, key in plan.advertise:
        status, told = advertised_address(host, key)
        report.add(section, status, f"{what}: peers are told {told}")
    for module, attribute, what in plan.modules:
        why = importable(module, attribute)
        name = f"{module}.{attribute}" if attribute else module
        report.add(section, OK if why is None else PROBLEM,
                   f"{what}: {name} " + ("imports" if why is None else f"does not import: {why}"))
    for host, port, what in plan.bind:
        why = port_free(host, port)
        report.add(section, OK if why is None else PROBLEM,
                   f"{what}: {host}:{port} " + ("is free" if why is None else f"cannot be bound: {why}"))
    for host, port, what in plan.connect:
        why = reachable(host, port, timeout_s)
        report.add(section, OK if why is None else PROBLEM,
                   f"{what}: {host}:{port} " + ("accepts TCP" if why is None else f"unreachable: {why}"))
    for host, port, what in plan.unauthenticated_binds:
        if beyond_loopback(host):
            report.add(section, WARN, f"{what}: {host}:{port} listens beyond loopback and answers any peer (no "
                                      "shared secret): keep it on a private network, or set a secret")
    if plan.mooncake_build:
        for status, detail in mooncake_build.check():
            report.add(section, status, f"{plan.mooncake_build}: {detail}")
    for path, what in plan.writable_dirs:
        why = dir_writable(path)
        report.add(section, OK if why is None else PROBLEM,
                   f"{what}: {path} " + ("is writable" if why is None else f"is not writable: {why}"))


# ---- the installation -------------------------------------------------------------------------
def check_installed(report: Report, specs: list[ConnectorSpec], registry: dict | None, heading: str,
                    plugins_ok: bool) -> None:
    if not specs:
        report.add("installed", PROBLEM, "no kv-* connectors installed")
        return
    report.add("installed", INFO, heading)
    if not plugins_ok:
        report.add("installed", PROBLEM, "vLLM's general plugins failed: vLLM would not start")
    for owner in name_owners(specs, registry):
        package = f"{owner.spec.package} {owner.spec.package_version}".strip()
        kind = "shared name" if owner.shared else "own name"
        report.add("installed", INFO, f"{owner.name} ({kind}) -> {owner.spec.module}.{owner.spec.class_name} "
                                      f"[{package}]: {owner.owner}")


def check_engines(report: Report) -> None:
    for module, attribute, what in ENGINES:
        why = importable(module, attribute)
        name = f"{module}.{attribute}" if attribute else module
        report.add("engines", INFO if why else OK,
                   f"{what}: {name} " + ("imports" if why is None else f"not importable ({why})"))
    for status, detail in mooncake_build.check():
        report.add("mooncake build", status, detail)


def parse_peer(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--peer {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


def run(kv_transfer_config: str | None = None, *, peers: Iterable[str] = (), timeout_s: float = DEFAULT_TIMEOUT_S,
        registry: dict | None = None, registry_heading: str = "vLLM not imported: what registering would do",
        plugins_ok: bool = True) -> Report:
    report = Report()
    try:
        specs = discover_connectors()
    except Exception as exc:  # noqa: BLE001 - a broken entry point is a finding
        report.add("installed", PROBLEM, f"connector discovery failed: {exc}")
        specs = []
    check_installed(report, specs, registry, registry_heading, plugins_ok)
    check_engines(report)
    peer_addresses = []
    for text in peers:
        try:
            peer_addresses.append(parse_peer(text))
        except ValueError as exc:
            report.add("peers", PROBLEM, str(exc))
    if kv_transfer_config is None:
        for host, port in peer_addresses:
            why = reachable(host, port, timeout_s)
            report.add("peers", OK if why is None else PROBLEM,
                       f"peer {host}:{port} " + ("accepts TCP" if why is None else f"unreachable: {why}"))
        return report
    try:
        ktc = load_kv_transfer_config(kv_transfer_config)
    except (ValueError, OSError) as exc:
        report.add("config", PROBLEM, f"--kv-transfer-config is not a JSON object: {exc}")
        return report
    check_config(report, ktc, specs, timeout_s, peer_addresses)
    return report
