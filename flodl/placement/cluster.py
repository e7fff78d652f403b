"""``ClusterBuilder``: a cluster file written in Python (tests, embedded launchers).

    cluster = (
        ClusterBuilder()
        .controller("10.0.0.1", port=29400)
        .worker("node-a", devices=[0, 1], nccl_socket_ifname="enp1s0", ssh="node-a")
        .worker("node-b", devices="all", nccl_socket_ifname="enp1s0", ssh={"user": "me"})
        .build()
    )
    Trainer.builder(model_fn, optim_fn, step).dataset(ds).cluster(cluster).run().join()

Global ranks are assigned in worker order. ``build()`` validates like every config (a
:class:`~flodl.config.ConfigError` names the key); hosts are checked when the run starts.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from flodl.config import ClusterConfig, ConfigError, SshConfig, WorkerConfig, explain


class ClusterBuilder:
    """Collects a controller and workers; ``build()`` returns a validated ``ClusterConfig``."""

    def __init__(self) -> None:
        self._controller: dict[str, Any] = {}
        self._workers: list[dict[str, Any]] = []
        self._options: dict[str, Any] = {}

    def controller(self, host: str, port: int = 0) -> ClusterBuilder:
        """Where the controller listens (an address every worker can reach)."""
        self._controller = {"host": host, "port": port}
        return self

    def worker(
        self,
        host: str,
        *,
        devices: str | list[int] = "all",
        ranks: int = 1,
        speeds: list[float] | None = None,
        ssh: SshConfig | dict[str, Any] | str | None = None,
        python: str = "python3",
        project_path: str | None = None,
        nccl_socket_ifname: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ClusterBuilder:
        """One host and its ranks. ``ssh`` may be a target string, a dict or an ``SshConfig``;
        leave it out for the launcher's own host (``localhost``)."""
        if isinstance(ssh, str):
            ssh = {"target": ssh}
        elif isinstance(ssh, SshConfig):
            ssh = ssh.model_dump()
        self._workers.append(
            {
                "host": host,
                "devices": devices,
                "ranks": ranks,
                "speeds": speeds,
                "ssh": ssh,
                "python": python,
                "project_path": project_path,
                "nccl_socket_ifname": nccl_socket_ifname,
                "env": dict(env or {}),
            }
        )
        return self

    def options(self, **fields: Any) -> ClusterBuilder:
        """Other cluster fields: ``start_timeout_s``, ``heartbeat_timeout_s``, ``threads_per_rank``,
        ``pace_margin``, ``warmup_steps``."""
        self._options.update(fields)
        return self

    def build(self) -> ClusterConfig:
        data: dict[str, Any] = {"kind": "hosts", "workers": self._workers, **self._options}
        if self._controller:
            data["controller"] = self._controller
        try:
            return ClusterConfig.model_validate(data)
        except ValidationError as exc:
            raise explain(exc, data, "cluster") from None

    @staticmethod
    def all_local_gpus() -> ClusterConfig:
        """Every visible GPU of this host, one rank each, loopback controller: the topology that
        auto-promote synthesises. Raises :class:`ConfigError` when no GPU is visible."""
        from flodl.placement.gpus import detect_gpus

        gpus = detect_gpus()
        if not gpus:
            raise ConfigError("all_local_gpus: no GPU visible on this host (nvidia-smi/KFD)")
        physical = [g.physical_index if g.physical_index is not None else g.index for g in gpus]
        return ClusterBuilder().worker("localhost", devices=physical).build()


__all__ = ["ClusterBuilder", "WorkerConfig"]
