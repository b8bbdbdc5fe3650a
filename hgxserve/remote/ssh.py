"""Run one command on many hosts at once over SSH, with a pyinfra inventory's connection settings.

The inventory is a pyinfra inventory file (`inventory/lab.py`, `inventory/testhosts.py`): its
module-level lists of `(name, data)` become groups, as pyinfra reads them, with `group_data/`
beside it. Connections use paramiko (what pyinfra's SSH connector uses) on one thread per host,
honouring the same host data keys as a deploy: `ssh_hostname`, `ssh_port`, `ssh_user`,
`ssh_key`, `ssh_key_password`, `ssh_password`, `ssh_allow_agent`, `ssh_look_for_keys`,
`ssh_known_hosts_file`, `ssh_strict_host_key_checking` (default `accept-new`, as pyinfra),
`ssh_config_file` (HostName, User, Port, IdentityFile, ProxyCommand), `ssh_connect_retries`
and `ssh_paramiko_connect_kwargs`. docs/status.md says why not pyinfra's own connector (its
import and gevent cost more than the SSH round trip this view is meant to cost).

    inv = load_inventory("inventory/testhosts.py")  # hgxserve.remote.inventory
    with Sessions(inv.select(["hgx-a", "hgx-b"])) as sessions:
        results = sessions.run_all("hostname", timeout=30)
"""

from __future__ import annotations

import base64
import hashlib
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from hgxserve.remote.inventory import InventoryHost


@dataclass
class Result:
    """What one host answered: `ok` False with `error` when it could not be reached."""

    host: str
    ok: bool
    exit_status: int | None = None
    stdout: str = ""
    stderr: str = ""
    error: str | None = None
    elapsed_s: float = 0.0


def _ssh_config(data: dict[str, Any], hostname: str) -> dict[str, Any]:
    import paramiko

    path = os.path.expanduser(str(data.get("ssh_config_file") or "~/.ssh/config"))
    if not os.path.isfile(path):
        return {}
    config = paramiko.SSHConfig.from_path(path)
    return dict(config.lookup(hostname))


class _AcceptUnknown:
    """StrictHostKeyChecking=no: accept any host key without remembering it (and without
    paramiko's warning per host, which OpenSSH does not print either)."""

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        return None


class _AcceptNew:
    """accept-new: trust and remember a host seen for the first time; a changed key still fails
    (paramiko's BadHostKeyException)."""

    def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        filename = getattr(client, "_hgxserve_known_hosts", None)
        # Trusting a key on first use is a decision a user must see (OpenSSH says it as well).
        print(new_host_key_line(hostname, key, filename), file=sys.stderr)
        if filename:
            try:
                with open(filename, "a", encoding="utf-8") as fh:
                    fh.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
            except OSError:
                pass


def new_host_key_line(hostname: str, key: Any, known_file: str | None) -> str:
    """The line printed when a host key is trusted on first use: host, type, SHA256
    fingerprint (as `ssh-keygen -lf` prints it) and where it was remembered."""
    digest = base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")
    where = f"added to {known_file}" if known_file else "not remembered"
    return (
        f"ssh: {hostname}: new host key {key.get_name()} SHA256:{digest} trusted on first use "
        f"({where}; ssh_strict_host_key_checking=yes refuses unknown keys)"
    )


def _host_key_policy(client: Any, data: dict[str, Any], config: dict[str, Any]) -> None:
    """Load the known hosts and set what happens to a host key not in them."""
    import paramiko

    known = data.get("ssh_known_hosts_file") or config.get("userknownhostsfile")
    known_file = os.path.expanduser(str(known or "~/.ssh/known_hosts"))
    if os.path.isfile(known_file):
        client.load_host_keys(known_file)
    policy = str(data.get("ssh_strict_host_key_checking") or
                 config.get("stricthostkeychecking") or "accept-new").lower()  # fmt: skip
    if policy in ("no", "off"):
        client.set_missing_host_key_policy(_AcceptUnknown())
    elif policy == "accept-new":
        client._hgxserve_known_hosts = known_file if known_file != "/dev/null" else None
        client.set_missing_host_key_policy(_AcceptNew())
    else:  # yes / ask: nobody can answer a prompt here
        client.set_missing_host_key_policy(paramiko.RejectPolicy())


def _connect_kwargs(data: dict[str, Any], config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """paramiko's connect() arguments from the host data, then the ssh_config entry."""
    import paramiko

    kwargs: dict[str, Any] = {
        "timeout": timeout,
        "banner_timeout": timeout,
        "auth_timeout": timeout,
        "allow_agent": bool(data.get("ssh_allow_agent", True)),
        "look_for_keys": bool(data.get("ssh_look_for_keys", True)),
    }
    user = data.get("ssh_user") or config.get("user")
    if user:
        kwargs["username"] = str(user)
    port = data.get("ssh_port") or config.get("port")
    if port:
        kwargs["port"] = int(port)
    if data.get("ssh_password"):
        kwargs["password"] = str(data["ssh_password"])
    key = data.get("ssh_key") or (config.get("identityfile") or [None])[0]
    if key:
        kwargs["key_filename"] = os.path.expanduser(str(key))
        kwargs["allow_agent"] = kwargs["look_for_keys"] = False
        if data.get("ssh_key_password"):
            kwargs["passphrase"] = str(data["ssh_key_password"])
    if config.get("proxycommand"):
        kwargs["sock"] = paramiko.ProxyCommand(config["proxycommand"])
    kwargs.update(data.get("ssh_paramiko_connect_kwargs") or {})
    return kwargs


def connect(host: InventoryHost, timeout: float) -> Any:
    """A connected paramiko SSHClient for an inventory host (raises on failure)."""
    import paramiko

    data = host.data
    hostname = str(data.get("ssh_hostname") or host.name)
    config = _ssh_config(data, hostname)
    hostname = config.get("hostname", hostname)
    client: Any = paramiko.SSHClient()
    _host_key_policy(client, data, config)
    kwargs = _connect_kwargs(data, config, timeout)
    retries = int(data.get("ssh_connect_retries") or 0)
    while True:
        try:
            client.connect(hostname, **kwargs)
            return client
        except (OSError, paramiko.SSHException, EOFError):
            if retries <= 0:
                raise
            retries -= 1
            time.sleep(float(data.get("ssh_connect_retry_min_delay") or 0.1))


def describe_error(exc: BaseException) -> str:
    """A one-line reason a host could not be reached."""
    errors = getattr(exc, "errors", None)  # paramiko's NoValidConnectionsError: per address
    if isinstance(errors, dict) and errors:
        sockaddr, error = next(iter(errors.items()))  # (host, port[, flow, scope])
        return f"{describe_error(error)} ({sockaddr[0]}:{sockaddr[1]})"
    text = str(exc) or type(exc).__name__
    if isinstance(exc, TimeoutError) or "timed out" in text:
        return f"no answer (timed out): {text}"
    strerror = getattr(exc, "strerror", None)
    return f"{strerror.lower()}" if strerror else f"{type(exc).__name__}: {text}"


class Sessions:
    """SSH connections to a set of hosts, opened lazily and kept for repeated runs (--watch)."""

    def __init__(self, hosts: list[InventoryHost], connect_timeout: float = 5.0) -> None:
        self.hosts = {h.name: h for h in hosts}
        self.connect_timeout = connect_timeout
        self.clients: dict[str, Any] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> Sessions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            clients, self.clients = self.clients, {}
        for client in clients.values():
            client.close()

    def client(self, name: str) -> Any:
        """The connected paramiko client of one host (connecting now if needed)."""
        with self._lock:
            client = self.clients.get(name)
        transport = client.get_transport() if client is not None else None
        if client is not None and transport is not None and transport.is_active():
            return client
        client = connect(self.hosts[name], self.connect_timeout)
        with self._lock:
            self.clients[name] = client
        return client

    def _drop(self, name: str) -> None:
        with self._lock:
            client = self.clients.pop(name, None)
        if client is not None:
            client.close()

    def run(self, name: str, command: str, timeout: float) -> Result:
        """Run `command` on one host; never raises for an unreachable host."""
        started = time.monotonic()
        try:
            client = self.client(name)
            _, stdout, stderr = client.exec_command(command, timeout=timeout)
            out = stdout.read().decode("utf-8", "replace")
            err = stderr.read().decode("utf-8", "replace")
            status = stdout.channel.recv_exit_status()
        except Exception as exc:  # paramiko raises many types; each means "could not tell"
            self._drop(name)
            return Result(name, False, error=describe_error(exc),
                          elapsed_s=time.monotonic() - started)  # fmt: skip
        return Result(name, True, status, out, err, elapsed_s=time.monotonic() - started)

    def run_all(self, command: str | Callable[[str], str], timeout: float) -> dict[str, Result]:
        """Run one command (or one per host, `command(name)`) on every host at once."""
        names = list(self.hosts)
        if not names:
            return {}
        with ThreadPoolExecutor(max_workers=min(64, len(names))) as pool:
            futures = {
                n: pool.submit(self.run, n, command(n) if callable(command) else command, timeout)
                for n in names
            }
            return {n: f.result() for n, f in futures.items()}

    def stream(
        self, name: str, command: str, on_line: Callable[[str, str], None], stop: threading.Event
    ) -> Result:
        """Run `command` with a terminal (so it ends when we hang up) and hand each output line
        to `on_line(host, line)` as it arrives, until it ends or `stop` is set."""
        started = time.monotonic()
        try:
            client = self.client(name)
            transport = client.get_transport()
            channel = transport.open_session()
            channel.get_pty()
            channel.settimeout(0.5)
            channel.exec_command(command)
        except Exception as exc:
            self._drop(name)
            return Result(name, False, error=describe_error(exc),
                          elapsed_s=time.monotonic() - started)  # fmt: skip
        pending = b""
        try:
            while not stop.is_set():
                try:
                    chunk = channel.recv(65536)
                except TimeoutError:
                    continue
                if not chunk:
                    break
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    on_line(name, line.decode("utf-8", "replace").rstrip("\r"))
            if pending:
                on_line(name, pending.decode("utf-8", "replace").rstrip("\r"))
        finally:
            channel.close()
        status = channel.recv_exit_status() if channel.exit_status_ready() else None
        return Result(name, True, status, elapsed_s=time.monotonic() - started)


def quote_argv(argv: list[str]) -> str:
    """One shell command line; every word quoted (topology values end up here)."""
    return " ".join(shlex.quote(word) for word in argv)
