"""The torchrun/srun path never takes the control-plane secret from the unauthenticated store:
one host hands it over in a private file, several hosts need FLODL_SECRET_FILE."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from flodl.runtime.cohorts import external
from flodl.runtime.wire import rank_env
from flodl.runtime.wire.store import serve_store

pytestmark = pytest.mark.light

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize(
    ("extra", "single"),
    [
        ({"LOCAL_WORLD_SIZE": "2"}, True),
        ({"LOCAL_WORLD_SIZE": "1"}, False),
        ({}, None),
    ],
)
def test_torchrun_says_whether_every_rank_is_on_this_host(extra, single):
    role = rank_env.external_role({**TORCHRUN, **extra, rank_env.DEVICE: "cpu"})
    assert role is not None and role.single_host is single


def test_srun_node_count_decides():
    srun = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "MASTER_ADDR": "h", "MASTER_PORT": "2"}
    one = rank_env.external_role({**srun, "SLURM_NNODES": "1", rank_env.DEVICE: "cpu"})
    two = rank_env.external_role({**srun, "SLURM_NNODES": "2", rank_env.DEVICE: "cpu"})
    assert one is not None and one.single_host is True
    assert two is not None and two.single_host is False


def test_several_hosts_without_a_secret_file_are_refused(monkeypatch):
    monkeypatch.delenv(rank_env.SECRET_FILE, raising=False)
    role = rank_env.external_role({**TORCHRUN, "LOCAL_WORLD_SIZE": "1", rank_env.DEVICE: "cpu"})
    assert role is not None
    with pytest.raises(RuntimeError, match="FLODL_SECRET_FILE=") as err:
        external.follow(role, timeout_s=1.0)
    assert "no authentication" in str(err.value)


def test_the_private_folder_is_this_users_only():
    folder = external.private_dir()
    info = os.stat(folder)
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700


def test_a_stranger_rewriting_the_store_cannot_reach_a_follower(monkeypatch):
    """The attack of the issue: keys pointing at a fake controller with a known secret. The
    follower ignores them (the secret is not in the store) and fails clearly, unconnected."""
    monkeypatch.delenv(rank_env.SECRET_FILE, raising=False)
    fake = socket.create_server(("127.0.0.1", 0))
    fake.settimeout(4.0)
    contacted: list[bool] = []
    threading.Thread(target=lambda: _accept(fake, contacted), daemon=True).start()
    store = serve_store("127.0.0.1")
    key = "flodl/0/0/"
    monkeypatch.setattr(external, "next_run_key", lambda role: key)
    store.set(key + "controller", f"127.0.0.1:{fake.getsockname()[1]}")
    store.set(key + "secret", "00" * 32)
    store.set(key + "handoff", "f" * 32)  # a name in our folder the attacker cannot write to
    env = {**TORCHRUN, "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": str(store.port)}
    # TORCHELASTIC_USE_AGENT_STORE: the store is not ours to host
    role = rank_env.external_role(
        {**env, rank_env.DEVICE: "cpu", "TORCHELASTIC_USE_AGENT_STORE": "true"}
    )
    assert role is not None and role.agent_store
    with pytest.raises(TimeoutError, match="did not publish"):
        external.follow(role, timeout_s=1.0)
    fake.close()
    assert contacted == []
    store.set(key + "handoff", "../../etc/passwd")
    with pytest.raises(RuntimeError, match="bad hand-off name"):
        external.follow(role, timeout_s=1.0)


def _accept(server: socket.socket, contacted: list[bool]) -> None:
    try:
        conn, _ = server.accept()
    except OSError:
        return
    contacted.append(True)
    conn.close()
