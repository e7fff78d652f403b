"""Fake hosts for real multi-host tests: Linux network namespaces, each running its own sshd.

A multi-host launcher is only really tested when ranks live behind *different* IP addresses
and are started over *real* ssh.  A network namespace gives a process its own interfaces,
addresses and port space while sharing everything else with the machine (file system, the
venv, CPU, users), so one box can pose as ``n`` hosts cheaply::

    root namespace                      namespace fnh-<pid>-<tok>-0 ... -<n-1>
    bridge fnb<pid>g<tok>  10.231.X.1/24  --veth-->  eth0 10.231.X.2/24, lo, sshd :22
                                          --veth-->  eth0 10.231.X.3/24, lo, sshd :22

The root namespace (the test process, a launcher, a rendezvous store) reaches every host
through the bridge, and the hosts reach each other and the controller address the same way.

Everything is torn down when the context exits, also on errors; what an earlier, crashed run
left behind is removed the next time a context starts, recognised by the owner pid encoded in
every name.  Needs root, iproute2 and OpenSSH (server, client and ssh-keygen);
:func:`unavailable_reason` says what is missing, and the :func:`make_test_hosts` fixture
skips the test with that reason.

Names (``ip netns list`` / ``ip link``), where ``pid`` is the owning process:

* namespaces ``fnh-<pid decimal>-<tok>-<i>``
* bridge ``fnb<pid hex>g<tok>``, root veth ends ``fnv<pid hex>g<tok><i hex>`` (at most
  15 characters: the kernel's limit on interface names), the other end is ``eth0``.

``<tok>`` is two random hex digits that tell apart several contexts of the same process.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SSHD = "/usr/sbin/sshd"
"""sshd re-executes itself for every connection, so it must be started by its absolute path."""

INTERFACE = "eth0"
SUBNET_BASE = "10.231"
"""Hosts get ``10.231.X.0/24`` with a free ``X``; 10.231/16 is private and rarely routed."""

NS_PREFIX = "fnh-"
BRIDGE_PREFIX = "fnb"
VETH_PREFIX = "fnv"
_LINK_NAME = re.compile(r"^fn[bv]([0-9a-f]+)g([0-9a-f]{2})([0-9a-f]*)$")
_NS_NAME = re.compile(r"^fnh-(\d+)-")  # hosts: fnh-<pid>-<tok>-<i>, probe: fnh-<pid>-probe
LOCK_FILE = Path("/run/flodl-netns-hosts.lock")
"""Serialises subnet choice, name choice and stale clean-up between concurrent test sessions."""

MAX_HOSTS = 200
READY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class TestHosts:
    """``n`` fake hosts, reachable over ssh as root with :attr:`ssh_config`.

    Use ``ssh -F hosts.ssh_config <address> <command>`` (or :meth:`ssh`) from the test
    process or from inside any host: the file system is shared, so the same config and key
    work everywhere, and so does ``sys.executable``.
    """

    __test__ = False  # pytest: a helper, not a test class

    addresses: list[str]
    controller_address: str
    namespaces: list[str]
    interface: str
    identity_file: str
    ssh_config: str
    sshd_pids: list[int] = field(default_factory=list)
    """The sshd listener of every host (the process :meth:`kill_host` spares)."""

    def ssh_command(self, i: int, command: str) -> list[str]:
        """argv that runs ``command`` on host ``i``: for ``Popen`` when :meth:`ssh` won't do."""
        return ["ssh", "-F", self.ssh_config, "-T", self.addresses[i], command]

    def ssh(self, i: int, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``command`` on host ``i`` through its sshd; stdout and stderr captured as text.

        stdin is /dev/null: ssh would otherwise read (and steal) the test process's stdin.
        """
        return subprocess.run(
            self.ssh_command(i, command),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def pids(self, i: int) -> list[int]:
        """Every process living in host ``i``'s namespace (``ip netns pids``), sshd included."""
        return _netns_pids(self.namespaces[i])

    def kill_host(self, i: int) -> None:
        """SIGKILL every process on host ``i`` except its sshd listener: the host's work dies
        (a crashed node) but it can still be reached, so a test can relaunch on it.

        Session sshd processes die too, so ssh connections open to the host break.
        Returns once the killed processes are gone.
        """
        _kill_netns(self.namespaces[i], spare={self.sshd_pids[i]})


def unavailable_reason() -> str | None:
    """``None`` when this machine can make test hosts, else a one-line reason to skip."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    for tool in ("ip", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"no `{tool}` on PATH"
    if not os.access(SSHD, os.X_OK):
        return f"no OpenSSH server at {SSHD}"
    if _root_locked():
        return "root's password is locked with '!' in /etc/shadow: sshd (UsePAM no) refuses it"
    probe = f"{NS_PREFIX}{os.getpid()}-probe"
    added = _ip("netns", "add", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` refused: {added.stderr.strip() or added.returncode}"
    _ip("netns", "delete", probe, check=False)
    return None


@contextmanager
def test_hosts(n: int, tmp_dir: Path) -> Iterator[TestHosts]:
    """``n`` fake hosts, each a network namespace running its own sshd; gone on exit.

    ``tmp_dir`` receives the keys, configs and sshd logs (``sshd-<i>.log``: look there
    when a host misbehaves).  Raises :class:`RuntimeError` when the machine can't make
    hosts (see :func:`unavailable_reason`) or an sshd does not come up.
    """
    if not 1 <= n <= MAX_HOSTS:
        raise ValueError(f"n must be in 1..{MAX_HOSTS}, got {n}")
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot make test hosts: {reason}")
    tmp_dir = Path(tmp_dir).resolve()
    tmp_dir.mkdir(parents=True, exist_ok=True)
    net = _Network(n)
    sshds: list[subprocess.Popen] = []
    try:
        net.create()
        hosts = _start_sshds(net, tmp_dir, sshds)
        yield hosts
    finally:
        _teardown(net, sshds)


test_hosts.__test__ = False  # type: ignore[attr-defined]  # pytest: not a test function


@pytest.fixture
def make_test_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., TestHosts]]:
    """Factory fixture: ``hosts = make_test_hosts(2)``; skips the test when the machine can't.

    Every set of hosts made by the factory is torn down when the test ends.
    """
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:

        def make(n: int = 2) -> TestHosts:
            return stack.enter_context(test_hosts(n, tmp_path_factory.mktemp("netns-hosts")))

        yield make


# --------------------------------------------------------------------------- network


class _Network:
    """The bridge, veths and namespaces of one context; :meth:`delete` is idempotent."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.pid = os.getpid()
        self.token = ""
        self.bridge = ""
        self.veths: list[str] = []
        self.namespaces: list[str] = []
        self.addresses: list[str] = []
        self.controller_address = ""

    def create(self) -> None:
        with _lock():
            _remove_stale()
            subnet = _free_subnet()
            self.token = self._free_token()
            tag = f"{self.pid:x}g{self.token}"
            self.bridge = f"{BRIDGE_PREFIX}{tag}"
            self.controller_address = str(subnet.network_address + 1)
            # Address the bridge while still holding the lock: that is what marks the subnet
            # as taken for the next session's _free_subnet.
            _ip("link", "add", "name", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            ns = f"{NS_PREFIX}{self.pid}-{self.token}-{i}"
            veth = f"{VETH_PREFIX}{tag}{i:x}"
            address = str(subnet.network_address + 2 + i)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            # The peer is born inside the namespace already named eth0: no rename, and no
            # clash with the root namespace's own eth0.
            _ip("link", "add", veth, "type", "veth", "peer", "name", INTERFACE, "netns", ns)
            self.veths.append(veth)
            _ip("link", "set", veth, "master", self.bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", INTERFACE)
            _ip("-n", ns, "link", "set", INTERFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.addresses.append(address)

    def _free_token(self) -> str:
        taken = set(_link_names()) | set(_netns_names())
        for _ in range(1000):
            token = secrets.token_hex(1)
            if f"{BRIDGE_PREFIX}{self.pid:x}g{token}" not in taken and not any(
                name.startswith(f"{NS_PREFIX}{self.pid}-{token}-") for name in taken
            ):
                return token
        raise RuntimeError("no free name token: too many live test-host contexts in one process")

    def delete(self) -> None:
        for ns in self.namespaces:
            # A survivor (stuck in the kernel) keeps the namespace alive, but deleting the
            # name still works, and the veths and bridge must go regardless.
            with contextlib.suppress(RuntimeError):
                _kill_netns(ns)
            _ip("netns", "delete", ns, check=False)
        for veth in self.veths:  # normally gone with their namespace already
            _delete_link(veth)
        if self.bridge:
            _delete_link(self.bridge)
        self.namespaces, self.veths, self.bridge = [], [], ""


def _free_subnet() -> ipaddress.IPv4Network:
    """A ``10.231.X.0/24`` that overlaps no address or route of the root namespace."""
    used: list[ipaddress.IPv4Network] = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        match = re.search(r"\binet (\S+)", line)
        if match:
            used.append(ipaddress.ip_interface(match.group(1)).network)
    for line in _ip("-4", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0] if line.split() else ""
        if dest[:1].isdigit():
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(dest, strict=False))
    thirds = list(range(1, 255))
    secrets.SystemRandom().shuffle(thirds)
    for third in thirds:
        subnet = ipaddress.ip_network(f"{SUBNET_BASE}.{third}.0/24")
        if not any(subnet.overlaps(other) for other in used):
            return subnet
    raise RuntimeError(f"no free /24 left in {SUBNET_BASE}.0.0/16")


def _remove_stale() -> None:
    """Delete namespaces and links whose owning process is gone (crashed earlier runs)."""
    for ns in _netns_names():
        match = _NS_NAME.match(ns)
        if match and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(RuntimeError):
                _kill_netns(ns)
            _ip("netns", "delete", ns, check=False)
    for link in _link_names():
        match = _LINK_NAME.match(link)
        if match and not _pid_alive(int(match.group(1), 16)):
            _delete_link(link)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextmanager
def _lock() -> Iterator[None]:
    with LOCK_FILE.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- sshd


def _start_sshds(net: _Network, tmp_dir: Path, sshds: list[subprocess.Popen]) -> TestHosts:
    """Keys, configs and one ``sshd -D`` per namespace; returns once each accepts a login."""
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
    identity = tmp_dir / "id_ed25519"
    _keygen(identity, "flodl-test-client")
    authorized_keys = tmp_dir / "authorized_keys"
    authorized_keys.write_text(identity.with_suffix(".pub").read_text())
    known_hosts = tmp_dir / "known_hosts"
    ssh_config = tmp_dir / "ssh_config"
    known_lines = []
    for i, (ns, address) in enumerate(zip(net.namespaces, net.addresses, strict=True)):
        host_key = tmp_dir / f"ssh_host_ed25519_key-{i}"
        _keygen(host_key, f"flodl-test-host-{i}")
        known_lines.append(f"{address} {host_key.with_suffix('.pub').read_text().strip()}\n")
        config = tmp_dir / f"sshd_config-{i}"
        config.write_text(
            _sshd_config(address, host_key, authorized_keys, tmp_dir / f"sshd-{i}.pid")
        )
        sshd = ["-D", "-e", "-f", str(config)]
        with (tmp_dir / f"sshd-{i}.log").open("wb") as log:
            sshds.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, "sh", "-c", _PRIVATE_SHM, "sshd", SSHD, *sshd],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    # Its own session: a Ctrl-C meant for pytest must not kill the hosts
                    # before teardown has run.
                    start_new_session=True,
                )
            )
    known_hosts.write_text("".join(known_lines))
    ssh_config.write_text(_ssh_config(net.addresses, identity, known_hosts))
    hosts = TestHosts(
        addresses=list(net.addresses),
        controller_address=net.controller_address,
        namespaces=list(net.namespaces),
        interface=INTERFACE,
        identity_file=str(identity),
        ssh_config=str(ssh_config),
        sshd_pids=[p.pid for p in sshds],  # `ip netns exec` execs sshd: same pid
    )
    # In parallel: each first login costs a key exchange plus root's shell start-up.
    with ThreadPoolExecutor(max_workers=min(len(sshds), 16)) as pool:
        waits = [
            pool.submit(_wait_ready, hosts, i, sshd, tmp_dir / f"sshd-{i}.log")
            for i, sshd in enumerate(sshds)
        ]
        for wait in waits:
            wait.result()
    return hosts


# A host of its own has a /dev/shm of its own: without it, a rank on a fake host negotiates
# shared memory with the launcher (flodl/runtime/wire/shm.py) and the tests never run the TCP
# path a second machine takes. `ip netns exec` already gives the command a mount namespace of
# its own (mounts propagate no further), so the tmpfs mounted there is this host's alone; the
# shell then execs sshd (the same pid, which kill_host spares).
_PRIVATE_SHM = 'mount -t tmpfs -o size=256m,mode=1777 flodl-host-shm /dev/shm && exec "$@"'


def _sshd_config(address: str, host_key: Path, authorized_keys: Path, pid_file: Path) -> str:
    """Key-only root logins on ``address:22``; nothing read from /etc/ssh.

    StrictModes is off because the keys live in a pytest tmp dir whose modes sshd would
    otherwise reject; UsePAM is off so sessions need no PAM stack (and start faster).
    sshd's default AcceptEnv already accepts no environment variables from the client.
    MaxStartups/MaxSessions are raised because launchers open many connections at once.
    """
    return (
        f"ListenAddress {address}\n"
        "Port 22\n"
        f"HostKey {host_key}\n"
        f"PidFile {pid_file}\n"
        f"AuthorizedKeysFile {authorized_keys}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        "StrictModes no\n"
        "UseDNS no\n"
        "PrintMotd no\n"
        "PrintLastLog no\n"
        "ClientAliveInterval 5\n"
        "MaxStartups 100\n"
        "MaxSessions 100\n"
        "LogLevel INFO\n"
    )


def _ssh_config(addresses: list[str], identity: Path, known_hosts: Path) -> str:
    """Client settings for the hosts: their real host keys, strictly checked; never prompt.

    The classic curve25519 key exchange saves ~0.13 s per connection on a slow machine over
    OpenSSH 9's default post-quantum hybrid, which guards nothing between namespaces.
    """
    return (
        f"Host {' '.join(addresses)}\n"
        "    User root\n"
        f"    IdentityFile {identity}\n"
        "    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {known_hosts}\n"
        "    GlobalKnownHostsFile /dev/null\n"
        "    StrictHostKeyChecking yes\n"
        "    BatchMode yes\n"
        "    LogLevel ERROR\n"
        "    ConnectTimeout 10\n"
        "    KexAlgorithms curve25519-sha256\n"
        "    ControlMaster no\n"
        "    ControlPath none\n"
    )


def _wait_ready(hosts: TestHosts, i: int, sshd: subprocess.Popen, log: Path) -> None:
    """Poll with a real ``ssh <host> true`` until the login works (the port alone isn't
    enough: a listening sshd can still reject the key or the account)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    last = ""
    while True:
        if sshd.poll() is not None:
            raise RuntimeError(
                f"sshd of host {i} ({hosts.addresses[i]}) exited with {sshd.returncode}; "
                f"its log {log}:\n{_tail(log)}"
            )
        try:
            result = hosts.ssh(i, "true", timeout=10)
            if result.returncode == 0:
                return
            last = result.stderr.strip()
        except subprocess.TimeoutExpired:
            last = "ssh timed out"
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"sshd of host {i} ({hosts.addresses[i]}) refused `ssh true` for "
                f"{READY_TIMEOUT_S:.0f} s (last error: {last!r}); its log {log}:\n{_tail(log)}"
            )
        time.sleep(0.05)


def _keygen(path: Path, comment: str) -> None:
    for stale in (path, path.with_suffix(".pub")):
        stale.unlink(missing_ok=True)
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
        capture_output=True,
    )


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"<unreadable: {e}>"


def _teardown(net: _Network, sshds: list[subprocess.Popen]) -> None:
    """Kill what runs on the hosts (sshd included), then delete namespaces, veths, bridge."""
    try:
        for ns in net.namespaces:
            _kill_netns(ns)
        for sshd in sshds:
            if sshd.poll() is None:
                sshd.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                sshd.wait(timeout=10)
    finally:
        net.delete()


# --------------------------------------------------------------------------- helpers


def _kill_netns(ns: str, spare: Collection[int] = (), timeout_s: float = 10.0) -> None:
    """SIGKILL every process in namespace ``ns`` but ``spare``; wait until they are gone.

    Repeats, because a dying session sshd's children may fork meanwhile.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        victims = [pid for pid in _netns_pids(ns) if pid not in spare]
        if not victims:
            return
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {victims} in namespace {ns} survive SIGKILL")
        time.sleep(0.02)


def _netns_pids(ns: str) -> list[int]:
    """Live processes in ``ns``; zombies are not listed (their namespace is already gone)."""
    result = _ip("netns", "pids", ns, check=False)
    return [int(tok) for tok in result.stdout.split() if tok.isdigit()]


def _netns_names() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").stdout.splitlines() if line.strip()]


def _link_names() -> list[str]:
    names = []
    for line in _ip("-o", "link", "show").stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _delete_link(name: str) -> None:
    _ip("link", "delete", name, check=False)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        ["ip", *args], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False
    )
    if check and result.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")
    return result


def _root_locked() -> bool:
    """sshd without PAM refuses accounts whose password field starts with '!' (locked)."""
    try:
        for line in Path("/etc/shadow").read_text().splitlines():
            if line.startswith("root:"):
                return line.split(":")[1].startswith("!")
    except OSError:
        pass
    return False
