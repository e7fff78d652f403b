"""Smoke test of tests/netns_hosts.py: fake hosts that really are separate over the network."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.netns_hosts import TestHosts, test_hosts, unavailable_reason

PY = sys.executable  # the venv: the hosts share the file system, so it runs there too

# Accepts one connection on (argv[1], any port), prints the port first so the test can
# connect, then answers with the peer's address: proof of where the connection came from.
SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
s.settimeout(20)
conn, peer = s.accept()
conn.recv(16)
conn.sendall(peer[0].encode())
conn.close()
"""
CLIENT = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.sendall(b"hi")
print(c.recv(64).decode())
"""
INTERFACES = """
import json, subprocess
links = json.loads(subprocess.check_output(["ip", "-j", "-4", "addr", "show"]))
print(json.dumps({a["ifname"]: [x["local"] for x in a["addr_info"]] for a in links}))
"""


def python(code: str, *args: str) -> str:
    """A shell command line that runs ``code`` with the venv python on a host."""
    return shlex.join([PY, "-c", code, *args])


@pytest.mark.skipif(not os.environ.get("CI"), reason="CI installs sshd and iproute2 (.ci/run)")
def test_ci_can_make_test_hosts() -> None:
    """In CI the multi-host tests must run, not skip: .ci/run installs what they need. Elsewhere
    (a fresh machine without sshd, root or not) they skip with their reason instead."""
    assert unavailable_reason() is None


@pytest.mark.slow  # ~5 s: a dozen ssh logins
def test_two_hosts(tmp_path: Path) -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    with test_hosts(2, tmp_path) as hosts:
        names = (list(hosts.namespaces), _bridge_of(hosts), list(hosts.sshd_pids))
        _check_addresses(hosts)
        _check_tcp_host_to_host(hosts)
        _check_tcp_host_to_controller(hosts)
        _check_own_shm(hosts)
        _check_kill_host(hosts)
    namespaces, bridge, sshd_pids = names
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not [ns for ns in namespaces if ns in listed], listed
    assert bridge not in links, links
    assert all(not Path(f"/proc/{pid}").exists() for pid in sshd_pids)


def _check_own_shm(hosts: TestHosts) -> None:
    """No /dev/shm shared with the launcher or the other host (was: one /dev/shm for all, so
    remote ranks sent bulk tensors through shared memory, never the network)."""
    mine = Path("/dev/shm") / f"flodl-test-host-probe-{os.getpid()}"
    mine.write_text("launcher")
    try:
        for i in range(len(hosts.addresses)):
            there = hosts.ssh(i, f"ls /dev/shm; echo host{i} > /dev/shm/probe-{i}")
            assert there.returncode == 0, there.stderr
            assert mine.name not in there.stdout and "probe-" not in there.stdout, there.stdout
        assert not list(Path("/dev/shm").glob("probe-*"))
    finally:
        mine.unlink()


def test_fixture_makes_hosts(make_test_hosts: Callable[..., TestHosts]) -> None:
    hosts = make_test_hosts(1)
    result = hosts.ssh(0, "echo ok")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _check_addresses(hosts: TestHosts) -> None:
    for i, address in enumerate(hosts.addresses):
        shown = hosts.ssh(i, f"ip -4 addr show {hosts.interface}")
        assert shown.returncode == 0, shown.stderr
        assert f"inet {address}/24" in shown.stdout
        seen = hosts.ssh(i, python(INTERFACES))
        assert seen.returncode == 0, seen.stderr
        # Its own interfaces only: loopback and eth0 with the host's address.
        assert json.loads(seen.stdout) == {"lo": ["127.0.0.1"], "eth0": [address]}


def _check_tcp_host_to_host(hosts: TestHosts) -> None:
    server = subprocess.Popen(
        hosts.ssh_command(1, python(SERVER, hosts.addresses[1])),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        port = server.stdout.readline().strip()
        assert port.isdigit(), server.stderr.read() if server.poll() is not None else port
        client = hosts.ssh(0, python(CLIENT, hosts.addresses[1], port))
        assert client.returncode == 0, client.stderr
        assert client.stdout.strip() == hosts.addresses[0]  # came from host 0's eth0
        assert server.wait(timeout=20) == 0
    finally:
        if server.poll() is None:
            server.kill()
        server.communicate()


def _check_tcp_host_to_controller(hosts: TestHosts) -> None:
    peers: list[str] = []
    with socket.create_server((hosts.controller_address, 0)) as listener:
        listener.settimeout(20)

        def serve() -> None:
            conn, peer = listener.accept()
            with conn:
                conn.recv(16)
                conn.sendall(b"controller")
                peers.append(peer[0])

        thread = threading.Thread(target=serve)
        thread.start()
        port = str(listener.getsockname()[1])
        client = hosts.ssh(0, python(CLIENT, hosts.controller_address, port))
        thread.join(timeout=20)
    assert client.returncode == 0, client.stderr
    assert client.stdout.strip() == "controller"
    assert peers == [hosts.addresses[0]]


def _check_kill_host(hosts: TestHosts) -> None:
    detached = hosts.ssh(1, "nohup sleep 300 >/dev/null 2>&1 & echo $!")
    assert detached.returncode == 0, detached.stderr
    detached_pid = int(detached.stdout.strip())
    attached = subprocess.Popen(hosts.ssh_command(1, "exec sleep 301"), stdin=subprocess.DEVNULL)
    try:
        _wait_for(lambda: _sleeping(hosts, 1, "301"), "the attached sleep to start")
        assert detached_pid in hosts.pids(1)
        hosts.kill_host(1)
        assert hosts.pids(1) == [hosts.sshd_pids[1]]
        _wait_for(lambda: _dead(detached_pid), "the detached sleep to die")
        assert attached.wait(timeout=20) == 255  # its session died with the host
    finally:
        if attached.poll() is None:
            attached.kill()
        attached.wait()
    again = hosts.ssh(1, "echo alive")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "alive"
    assert hosts.ssh(0, "echo untouched").returncode == 0


def _dead(pid: int) -> bool:
    """Gone, or a zombie waiting for init to reap it (it was reparented when its shell exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _sleeping(hosts: TestHosts, i: int, seconds: str) -> bool:
    for pid in hosts.pids(i):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [
                b"sleep",
                seconds.encode(),
            ]:
                return True
        except OSError:
            pass
    return False


def _wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _bridge_of(hosts: TestHosts) -> str:
    """The bridge carrying the controller address (to check it is gone afterwards)."""
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "to", hosts.controller_address],
        capture_output=True,
        text=True,
    ).stdout
    return out.split()[1]
