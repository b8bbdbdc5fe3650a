"""Local TCP ports forwarded over an SSH connection (what `ssh -N -L` does), in process.

`hgxserve bench --inventory` reads each engine's /metrics through its own host (an engine that
the proxy fronts listens on that host's loopback only), and `--from HOST` sends the load
through HOST: the connections to the proxy then start on HOST's network (the client network
seed 003 measured from), while the load generator itself runs on the controller.

    with Tunnels(inventory_hosts) as tunnels:
        url = tunnels.url("hgx-c", "127.0.0.1", 8300)   # http://127.0.0.1:<local port>
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Any

from hgxserve.base.errors import ExitCode, HgxserveError

BUFFER = 65536


class TunnelError(HgxserveError):
    """The SSH connection to the tunnel's host could not be made (exit 3: unreachable)."""

    exit_code = ExitCode.SOURCE


class Tunnel:
    """127.0.0.1:<port> here -> `dest_host:dest_port` as the SSH server's host reaches it."""

    def __init__(self, transport: Any, dest_host: str, dest_port: int) -> None:
        self.transport = transport
        self.dest = (dest_host, dest_port)
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(64)
        self.port: int = self._server.getsockname()[1]
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="tunnel-accept")
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, peer = self._server.accept()
            except OSError:
                return
            threading.Thread(
                target=self._pump, args=(conn, peer), daemon=True, name="tunnel-pump"
            ).start()

    def _pump(self, conn: socket.socket, peer: tuple[str, int]) -> None:
        try:
            chan = self.transport.open_channel("direct-tcpip", self.dest, peer, timeout=15)
        except Exception:  # paramiko raises several types; the client sees a closed socket
            conn.close()
            return
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([conn, chan], [], [], 1.0)
                if conn in ready:
                    data = conn.recv(BUFFER)
                    if not data:
                        break
                    chan.sendall(data)
                if chan in ready:
                    data = chan.recv(BUFFER)
                    if not data:
                        break
                    conn.sendall(data)
        except OSError:
            pass
        finally:
            chan.close()
            conn.close()

    def close(self) -> None:
        self._closed.set()
        self._server.close()


class Tunnels:
    """Tunnels through the hosts of a pyinfra inventory (`hgxserve.remote.ssh`'s SSH
    settings), one SSH connection per host, all closed together."""

    def __init__(self, hosts: list[Any], connect_timeout: float = 10.0) -> None:
        from hgxserve.remote.ssh import Sessions

        self.sessions = Sessions(hosts, connect_timeout)
        self.tunnels: list[Tunnel] = []

    def __enter__(self) -> Tunnels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def url(self, host: str, dest_host: str, dest_port: int) -> str:
        """`http://127.0.0.1:<port>` that reaches `dest_host:dest_port` from `host`."""
        from hgxserve.remote.ssh import describe_error

        try:
            transport = self.sessions.client(host).get_transport()
        except Exception as exc:  # paramiko and socket errors: say which host and why
            raise TunnelError(f"{host}: cannot open an SSH tunnel: {describe_error(exc)}") from None
        tunnel = Tunnel(transport, dest_host, dest_port)
        self.tunnels.append(tunnel)
        return f"http://127.0.0.1:{tunnel.port}"

    def close(self) -> None:
        for tunnel in self.tunnels:
            tunnel.close()
        self.tunnels = []
        self.sessions.close()
