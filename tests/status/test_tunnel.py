"""hgxserve.remote.tunnel against a real SSH server (paramiko's server side, in this process):
through a forwarded port, many connections at once, and an unreachable host named."""

from __future__ import annotations

import http.server
import select
import socket
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import paramiko
import pytest

from hgxserve.remote.inventory import InventoryHost
from hgxserve.remote.tunnel import TunnelError, Tunnels


class _Server(paramiko.ServerInterface):
    def __init__(self) -> None:
        self.opened: list[tuple[str, int]] = []

    def check_auth_password(self, username: str, password: str) -> int:
        ok = (username, password) == ("bench", "pw")
        return paramiko.AUTH_SUCCESSFUL if ok else paramiko.AUTH_FAILED

    def get_allowed_auths(self, username: str) -> str:
        return "password"

    def check_channel_request(self, kind: str, chanid: int) -> int:
        return paramiko.OPEN_FAILED_ADMINISTRATIVELY_PROHIBITED

    def check_channel_direct_tcpip_request(self, chanid: int, origin: Any, dest: Any) -> int:
        self.opened.append(tuple(dest))
        return paramiko.OPEN_SUCCEEDED


def _pump(chan: Any, dest: tuple[str, int]) -> None:
    with socket.create_connection(dest, timeout=10) as sock:
        while True:
            ready, _, _ = select.select([sock, chan], [], [], 5)
            if sock in ready:
                data = sock.recv(65536)
                if not data:
                    break
                chan.sendall(data)
            if chan in ready:
                data = chan.recv(65536)
                if not data:
                    break
                sock.sendall(data)
    chan.close()


@pytest.fixture
def sshd() -> Iterator[tuple[int, _Server]]:
    key = paramiko.RSAKey.generate(2048)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    server = _Server()
    transports: list[paramiko.Transport] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            transport = paramiko.Transport(conn)
            transport.add_server_key(key)
            transport.start_server(server=server)
            transports.append(transport)

            def channels(t: paramiko.Transport = transport) -> None:
                while t.is_active():
                    chan = t.accept(1)
                    if chan is not None:
                        dest = server.opened[-1]
                        threading.Thread(target=_pump, args=(chan, dest), daemon=True).start()

            threading.Thread(target=channels, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1], server
    listener.close()
    for t in transports:
        t.close()


@pytest.fixture
def web() -> Iterator[int]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            body = f"path {self.path}".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def _host(port: int, password: str = "pw") -> InventoryHost:
    return InventoryHost(
        "hgx-x",
        {"ssh_hostname": "127.0.0.1", "ssh_port": port, "ssh_user": "bench",
         "ssh_password": password, "ssh_strict_host_key_checking": "no",
         "ssh_known_hosts_file": "/dev/null", "ssh_allow_agent": False,
         "ssh_look_for_keys": False},
    )  # fmt: skip


def test_http_through_the_tunnel_many_at_once(sshd: tuple[int, _Server], web: int) -> None:
    port, server = sshd
    with Tunnels([_host(port)]) as tunnels:
        url = tunnels.url("hgx-x", "127.0.0.1", web)
        assert url.startswith("http://127.0.0.1:") and not url.endswith(f":{web}")

        def get(i: int) -> str:
            with urllib.request.urlopen(f"{url}/metrics?{i}", timeout=10) as resp:
                return str(resp.read().decode())

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(get, range(24)))
    assert answers == [f"path /metrics?{i}" for i in range(24)]
    # the SSH server was asked for the destination as the remote host names it
    assert set(server.opened) == {("127.0.0.1", web)} and len(server.opened) == 24
    with pytest.raises(OSError):  # closed with the Tunnels
        urllib.request.urlopen(url + "/metrics", timeout=3)


def test_a_host_that_refuses_the_login_is_named(sshd: tuple[int, _Server], web: int) -> None:
    port, _ = sshd
    with (
        Tunnels([_host(port, password="wrong")]) as tunnels,
        pytest.raises(TunnelError, match="hgx-x: cannot open an SSH tunnel: .*uthentication"),
    ):
        tunnels.url("hgx-x", "127.0.0.1", web)


def test_bench_reach_maps_every_engine_through_its_host_and_the_load_through_from(
    sshd: tuple[int, _Server], tmp_path: Path
) -> None:
    from hgxserve.bench.reach import open_reach
    from hgxserve.topology import load_topology

    port, server = sshd
    topo = load_topology(Path(__file__).resolve().parents[2] / "topologies/demo/demo-pd.yml")
    data = _host(port).data
    (tmp_path / "inv.py").write_text(
        f"hosts = {[(name, data) for name in ('hgx-a', 'hgx-b', 'hgx-c', 'client-1')]!r}\n"
    )
    reach = open_reach(topo, inventory=str(tmp_path / "inv.py"), from_host="client-1",
                       proxy_url=None, engine_urls={"decode-0": "http://127.0.0.1:1"})  # fmt: skip
    try:
        assert reach.via == {
            "prefill-0": "http://127.0.0.1:8100 on hgx-a",  # each engine as its own host sees it
            "combined-0": "http://127.0.0.1:8300 on hgx-c",
            "proxy": "http://10.77.0.13:8000 from client-1",  # the proxy's routable address
        }
        assert reach.engine_urls["decode-0"] == "http://127.0.0.1:1"  # --engine-url wins
        assert reach.proxy_url is not None and reach.proxy_url.startswith("http://127.0.0.1:")
        assert reach.origin == "client-1 (SSH tunnel from the controller to http://10.77.0.13:8000)"
        assert server.opened == []  # nothing connects until the bench does
    finally:
        reach.close()
    direct = open_reach(topo, inventory=None, from_host=None, proxy_url=None, engine_urls={})
    assert direct.origin == "controller" and direct.tunnels is None
