"""Redis servers of our own on free ports: a local Redis Cluster (3 masters, 3 replicas), a
master watched by a Sentinel, and a server that also listens with TLS and on a Unix socket."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

from tests.support.ports import free_ports

if TYPE_CHECKING:
    from tests.support.certificates import Certificates

HOST = "127.0.0.1"
#: How long a master may be silent before the others count it as failed (ms): short, so a
#: failover test takes seconds, not the default 15.
NODE_TIMEOUT_MS = 1000


def redis_cli(port: int, *args: str, timeout: float = 30) -> str:
    result = subprocess.run(
        ["redis-cli", "-h", HOST, "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return result.stdout


@dataclass
class Node:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None


def start_server(folder: Path, port: int, *options: str, config: Path | None = None) -> Node:
    """``redis-server`` on ``port`` with its files in ``folder`` (made here), not persisted."""
    folder.mkdir(parents=True)
    command = ["redis-server", *([str(config)] if config else []), "--bind", HOST]
    command += ["--port", str(port), "--dir", str(folder), "--save", "", "--appendonly", "no"]
    command += ["--logfile", "redis.log", *options]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    node = Node(port, process)
    _wait_for_ping(node, folder / "redis.log")
    return node


@dataclass
class RedisCluster:
    """Six ``redis-server --cluster-enabled yes`` processes made into one cluster (``size``
    processes, ``replicas`` of each primary).

    Started by :meth:`start`, ended by :meth:`stop` (the processes this object started, and
    only those); the data folder is removed then.
    """

    folder: Path
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def start(cls, folder: Path, *, size: int = 6, replicas: int = 1) -> Self:
        cluster = cls(folder)
        ports = free_ports(2 * size)
        try:
            for port, bus_port in zip(ports[::2], ports[1::2], strict=True):
                cluster.nodes.append(cluster._start_node(port, bus_port))
            redis_cli(
                cluster.nodes[0].port,
                "--cluster",
                "create",
                *(node.address for node in cluster.nodes),
                "--cluster-replicas",
                str(replicas),
                "--cluster-yes",
            )
            cluster.wait_until_ok()
            cluster._wait_for_replicas(size * replicas // (replicas + 1))
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_node(self, port: int, bus_port: int) -> Node:
        return start_server(
            self.folder / str(port),
            port,
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            str(bus_port),
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--repl-diskless-sync-delay",
            "0",
        )

    @property
    def url(self) -> str:
        """A URL of one node: a cluster client learns the others from it."""
        return f"redis://{self.nodes[0].address}/0"

    def masters(self) -> list[Node]:
        return [node for node in self.nodes if node.alive() and _role(node) == "master"]

    def wait_until_ok(self, timeout: float = 60) -> None:
        """Until every live node sees all 16384 slots served (``cluster_state:ok``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [node for node in self.nodes if node.alive()]
            if all("cluster_state:ok" in redis_cli(node.port, "CLUSTER", "INFO") for node in live):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the Redis Cluster in {self.folder} was not ok within {timeout} s")

    def _wait_for_replicas(self, count: int, timeout: float = 60) -> None:
        """Until every replica has its master's data: only then may it take over."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [redis_cli(node.port, "INFO", "replication") for node in self.nodes]
            replicas = [info for info in infos if "role:slave" in info]
            if len(replicas) == count and all("master_link_status:up" in info for info in replicas):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the replicas in {self.folder} did not sync within {timeout} s")

    def wait_for_replication(self, master: Node, timeout: float = 30) -> None:
        """Until every replica of ``master`` has all it was sent so far."""
        sent = int(
            dict(_info_fields(redis_cli(master.port, "INFO", "replication")))["master_repl_offset"]
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            replicas = [
                dict(part.split("=", 1) for part in value.split(","))
                for name, value in _info_fields(redis_cli(master.port, "INFO", "replication"))
                if name.startswith("slave") and name[5:].isdigit()
            ]
            if replicas and all(int(replica["offset"]) >= sent for replica in replicas):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the replicas of {master.address} lagged for {timeout} s")

    def kill(self, node: Node) -> None:
        """SIGKILL: the node dies at once, without a shutdown or a last save."""
        node.process.send_signal(signal.SIGKILL)
        node.process.wait(10)

    def stop(self) -> None:
        stop_servers(self.nodes, self.folder)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop()


@dataclass
class RedisSentinel:
    """A master and one Sentinel that watches it under ``name``; stopped by :meth:`stop`."""

    folder: Path
    name: str = "idempotency"
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def start(cls, folder: Path) -> Self:
        sentinel = cls(folder)
        folder.mkdir(parents=True, exist_ok=True)
        master_port, sentinel_port = free_ports(2)
        try:
            sentinel.nodes.append(start_server(folder / "master", master_port))
            config = folder / "sentinel.conf"  # Sentinel rewrites its own config file
            config.write_text(f"sentinel monitor {sentinel.name} {HOST} {master_port} 1\n")
            sentinel.nodes.append(
                start_server(folder / "sentinel", sentinel_port, "--sentinel", config=config)
            )
        except BaseException:
            sentinel.stop()
            raise
        return sentinel

    @property
    def sentinel_address(self) -> tuple[str, int]:
        return HOST, self.nodes[1].port

    def stop(self) -> None:
        stop_servers(self.nodes, self.folder)


@dataclass
class RedisTLS:
    """A server that listens on a plain port, on a TLS port (its certificate signed by an
    authority of the test's own) and on a Unix socket; stopped by :meth:`stop`."""

    folder: Path
    tls_port: int
    certificates: Certificates
    nodes: list[Node] = field(default_factory=list)

    @classmethod
    def start(cls, folder: Path) -> Self:
        # Imported here: the stores' tests on the oldest versions run without cryptography.
        from tests.support.certificates import make_certificates

        folder.mkdir(parents=True, exist_ok=True)
        port, tls_port = free_ports(2)
        server = cls(folder, tls_port, make_certificates(folder))
        try:
            server.nodes.append(
                start_server(
                    folder / "server",
                    port,
                    *("--tls-port", str(tls_port), "--tls-auth-clients", "no"),
                    *("--tls-cert-file", str(server.certificates.cert)),
                    *("--tls-key-file", str(server.certificates.key)),
                    *("--tls-ca-cert-file", str(server.certificates.ca)),
                    *("--unixsocket", str(server.socket), "--unixsocketperm", "700"),
                )
            )
        except BaseException:
            server.stop()
            raise
        return server

    @property
    def socket(self) -> Path:
        return self.folder / "redis.sock"

    @property
    def tls_url(self) -> str:
        """A ``rediss://`` URL that trusts the server's authority."""
        return f"rediss://{HOST}:{self.tls_port}/0?ssl_ca_certs={self.certificates.ca}"

    def stop(self) -> None:
        stop_servers(self.nodes, self.folder)


def stop_servers(nodes: list[Node], folder: Path) -> None:
    """End the servers we started (these, and only these), then remove their folder."""
    for node in nodes:
        if node.alive():
            node.process.terminate()
    for node in nodes:
        try:
            node.process.wait(10)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait(10)
    shutil.rmtree(folder, ignore_errors=True)


def _info_fields(info: str) -> list[tuple[str, str]]:
    """The ``name:value`` lines of an ``INFO`` answer."""
    return [
        (name, value)
        for name, _, value in (line.strip().partition(":") for line in info.splitlines())
        if value
    ]


def _role(node: Node) -> str:
    return redis_cli(node.port, "ROLE").split("\n", 1)[0].strip()


def _wait_for_ping(node: Node, log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not node.alive():
            # Its log says why (the folder goes with the cluster).
            said = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(
                f"redis-server on port {node.port} exited ({node.process.returncode}):\n{said}"
            )
        try:
            if redis_cli(node.port, "PING", timeout=2).strip() == "PONG":
                return
        except subprocess.SubprocessError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"redis-server on port {node.port} did not answer within {timeout} s")
