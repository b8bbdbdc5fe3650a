"""The watcher of an engine that spans hosts: head and workers are one failure domain.

A multi-node engine (a head with the API server on one host, `--headless` / `--node-rank` workers
on the others) is useless when any member dies: a head whose worker died answers errors or exits,
a worker whose head died hangs in NCCL. Its units therefore have no `Restart=`; one watcher per
engine per host (`hgxserve engine watch --config <file>`, a unit of the release) restarts it as
a whole instead:

- the head host's watcher leads. Every poll it reads its head unit and /health and each
  follower's GET /state. When a member is down (a unit not running, the head's /health failing
  for `down_after_s` after it was ready, a follower unreachable for `down_after_s`) it bumps the
  engine's generation, stops the head, waits until every follower reports its worker restarted
  for that generation, starts the head and waits for its /health (bounded by the engine's start
  timeout; the head serves only once every worker joined it);
- a follower restarts its worker unit when the leader's generation differs from its own.

The watchers take no command from the network: GET /state is all they serve, and all a follower
reads from its leader is the generation. They serve it to loopback and the engine's own hosts
only (the addresses of the config's peer URLs, or `allow_from`), at most WATCH_MAX_CONNECTIONS
at once, each request read within WATCH_READ_TIMEOUT_S and WATCH_REQUEST_LIMIT bytes; their own
reads of a peer are bounded the same way in all, not per recv. Every event is kept in a state
file for `hgxserve status` (and printed to the watcher's journal for `hgxserve logs`).
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from hgxserve.base.defaults import (
    WATCH_BACKOFF_S,
    WATCH_DOWN_AFTER_S,
    WATCH_FOLLOWER_RESTART_S,
    WATCH_MAX_CONNECTIONS,
    WATCH_POLL_S,
    WATCH_READ_LIMIT,
    WATCH_READ_TIMEOUT_S,
    WATCH_REQUEST_LIMIT,
)

Role = Literal["leader", "follower"]
EVENTS_KEPT = 20
RUNNING = ("active", "activating", "reloading")
# A generation is a count of recoveries: far below this, whatever a peer claims.
MAX_GENERATION = 1 << 31
# How often a refused peer is named in the journal, and a peer name resolved again.
REFUSED_LOG_S = 60.0
RESOLVE_EVERY_S = 30.0


@dataclass
class WatchConfig:
    """What one host's watcher watches (rendered as /etc/hgxserve/watch/<engine>.json)."""

    engine: str
    host: str
    role: Role
    unit: str  # this host's engine unit (the head's or a worker's)
    port: int  # GET /state on this port
    state_file: str
    health_url: str | None = None  # the leader: the head's /health
    leader_url: str | None = None  # a follower: the leader's /state
    followers: dict[str, str] = field(default_factory=dict)  # the leader: host -> /state URL
    start_timeout_s: float = 1800.0
    poll_s: float = WATCH_POLL_S
    down_after_s: float = WATCH_DOWN_AFTER_S
    follower_restart_s: float = WATCH_FOLLOWER_RESTART_S
    backoff_s: float = WATCH_BACKOFF_S
    # who besides loopback may read GET /state (addresses or names); empty: the hosts of
    # leader_url and followers, the engine's other hosts
    allow_from: list[str] = field(default_factory=list)

    def peer_names(self) -> list[str]:
        """The hosts (addresses or names) whose watchers read this one's GET /state."""
        if self.allow_from:
            return list(self.allow_from)
        urls = [self.leader_url, *self.followers.values()]
        return sorted({urlsplit(url).hostname or "" for url in urls if url} - {""})

    @classmethod
    def load(cls, path: str) -> WatchConfig:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"


class Members:
    """What a watcher does to the world: its unit through systemctl, its peers over HTTP.
    Tests replace it with a fake."""

    def unit_state(self, unit: str) -> str:
        proc = subprocess.run(
            ["systemctl", "is-active", unit], capture_output=True, text=True, timeout=30
        )
        return proc.stdout.strip() or "unknown"

    def systemctl(self, *args: str) -> None:
        # stop/restart block until the unit stopped (TimeoutStopSec= bounds it)
        subprocess.run(["systemctl", *args], capture_output=True, text=True, timeout=600)

    def healthy(self, url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=WATCH_READ_TIMEOUT_S) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def peer_state(self, url: str) -> dict[str, Any] | None:
        """A peer watcher's GET /state, or None when it does not answer in time: at most
        WATCH_READ_LIMIT bytes within WATCH_READ_TIMEOUT_S in all (a peer trickling its answer
        does not hold the poll loop)."""
        deadline = time.monotonic() + WATCH_READ_TIMEOUT_S
        body = b""
        try:
            with urllib.request.urlopen(url, timeout=WATCH_READ_TIMEOUT_S) as resp:
                while len(body) <= WATCH_READ_LIMIT:
                    if time.monotonic() > deadline:
                        return None
                    chunk = resp.read1(WATCH_READ_LIMIT + 1 - len(body))
                    if not chunk:
                        break
                    body += chunk
            if len(body) > WATCH_READ_LIMIT:
                return None
            data = json.loads(body)
        except (urllib.error.URLError, OSError, ValueError, RecursionError):
            return None
        return data if isinstance(data, dict) else None


@dataclass
class WatchState:
    """A watcher's state: kept in its state file and served on GET /state."""

    engine: str
    host: str
    role: Role
    unit: str
    generation: int = 0
    restarts: int = 0
    phase: str = "watching"  # leader: watching, waiting-followers, starting
    unit_state: str = "unknown"
    hosts: list[str] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def event(self, kind: str, at: float, **details: Any) -> dict[str, Any]:
        entry = {"at": round(at, 3), "kind": kind, "generation": self.generation, **details}
        self.events = [*self.events, entry][-EVENTS_KEPT:]
        return entry


class Watcher:
    """The state machine; `step(now)` is one poll (the CLI calls it every `poll_s`)."""

    def __init__(
        self, config: WatchConfig, members: Members, log: Callable[[str], None] = print
    ) -> None:
        self.config = config
        self.members = members
        self.log = log
        self.state = WatchState(config.engine, config.host, config.role, config.unit)
        self.state.hosts = [config.host, *config.followers]
        self._restore()
        self.lock = threading.Lock()
        self.ready_seen = False  # the head answered /health since this generation started
        self.bad_since: dict[str, float] = {}  # member -> since when it looked down
        self.deadline = 0.0
        self.backoff_until = 0.0
        self.adopted = self.state.generation > 0 or config.role == "leader"

    # -- state file ---------------------------------------------------------------------------

    def _restore(self) -> None:
        try:
            data = json.loads(Path(self.config.state_file).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        if isinstance(data, dict) and data.get("engine") == self.config.engine:
            self.state.generation = int(data.get("generation") or 0)
            self.state.restarts = int(data.get("restarts") or 0)
            self.state.events = list(data.get("events") or [])[-EVENTS_KEPT:]

    def save(self) -> None:
        path = Path(self.config.state_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self.state), sort_keys=True) + "\n", encoding="utf-8")
        os.replace(tmp, path)

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return asdict(self.state)

    def _note(self, kind: str, now: float, **details: Any) -> None:
        entry = self.state.event(kind, now, **details)
        words = " ".join(f"{k}={v}" for k, v in entry.items() if k not in ("at", "kind"))
        self.log(f"{self.config.engine}: {kind} {words}")

    # -- one poll -----------------------------------------------------------------------------

    def step(self, now: float) -> None:
        unit_state = self.members.unit_state(self.config.unit)
        with self.lock:
            self.state.unit_state = unit_state
        if self.config.role == "leader":
            self._lead(now, unit_state)
        else:
            self._follow(now)
        with self.lock:
            self.save()

    # -- follower -----------------------------------------------------------------------------

    def _follow(self, now: float) -> None:
        assert self.config.leader_url is not None
        leader = self.members.peer_state(self.config.leader_url)
        if leader is None or not _is_generation(leader.get("generation")):
            return
        generation = int(leader["generation"])
        if not self.adopted:
            self.adopted = True
            if leader.get("phase") != "waiting-followers":
                # first contact with no state of its own: the worker runs for this generation
                self.state.generation = generation
                return
            # the leader waits for the workers of a new generation: this one may be an old one
        if generation == self.state.generation:
            return
        self._note("restart-worker", now, to_generation=generation, unit=self.config.unit)
        self.members.systemctl("reset-failed", self.config.unit)
        self.members.systemctl("restart", self.config.unit)
        with self.lock:
            self.state.generation = generation
            self.state.restarts += 1
            self.state.unit_state = self.members.unit_state(self.config.unit)
        self._note("worker-restarted", now, unit_state=self.state.unit_state)

    # -- leader -------------------------------------------------------------------------------

    def _lead(self, now: float, unit_state: str) -> None:
        phase = self.state.phase
        if phase == "waiting-followers":
            self._await_followers(now)
        elif phase == "starting":
            self._await_head(now, unit_state)
        else:
            self._watch(now, unit_state)

    def _watch(self, now: float, unit_state: str) -> None:
        reasons = self._down_reasons(now, unit_state)
        if not reasons or now < self.backoff_until:
            return
        with self.lock:
            self.state.generation += 1
            self.state.restarts += 1
            self.state.phase = "waiting-followers"
        down = sorted({host for host, _ in reasons})
        self._note(
            "engine-down",
            now,
            reason="; ".join(why for _, why in reasons),
            down_hosts=",".join(down),
            restarts=self.state.restarts,
        )
        self.members.systemctl("stop", self.config.unit)
        self.members.systemctl("reset-failed", self.config.unit)
        self.bad_since.clear()
        self.ready_seen = False
        self.deadline = now + self.config.follower_restart_s

    def _down_reasons(self, now: float, unit_state: str) -> list[tuple[str, str]]:
        """(host, why) for each member that is down now."""
        host = self.config.host
        reasons: list[tuple[str, str]] = []
        if unit_state not in RUNNING:
            reasons.append((host, f"head unit {self.config.unit} on {host} is {unit_state}"))
        elif unit_state == "active":
            reasons += self._health_reason(now)
        for peer, url in self.config.followers.items():
            reasons += self._follower_reason(now, peer, self.members.peer_state(url))
        return reasons

    def _health_reason(self, now: float) -> list[tuple[str, str]]:
        assert self.config.health_url is not None
        if self.members.healthy(self.config.health_url):
            self.ready_seen = True
            self.bad_since.pop("health", None)
            return []
        if not self.ready_seen:
            return []
        since = self.bad_since.setdefault("health", now)
        if now - since < self.config.down_after_s:
            return []
        return [(self.config.host, f"head /health failing for {now - since:.0f}s")]

    def _follower_reason(
        self, now: float, peer: str, state: dict[str, Any] | None
    ) -> list[tuple[str, str]]:
        if state is None:
            since = self.bad_since.setdefault(peer, now)
            if now - since < self.config.down_after_s:
                return []
            return [(peer, f"watcher on {peer} unreachable for {now - since:.0f}s")]
        self.bad_since.pop(peer, None)
        worker = str(state.get("unit_state", "unknown"))
        if worker in RUNNING:
            return []
        return [(peer, f"worker {state.get('unit', '?')} on {peer} is {worker}")]

    def _await_followers(self, now: float) -> None:
        generation = self.state.generation
        late = []
        for peer, url in self.config.followers.items():
            state = self.members.peer_state(url)
            if (
                state is None
                or state.get("generation") != generation
                or state.get("unit_state") not in RUNNING
            ):
                late.append(peer)
        if not late:
            self._note("workers-restarted", now, hosts=",".join(self.config.followers))
            self.members.systemctl("start", "--no-block", self.config.unit)
            with self.lock:
                self.state.phase = "starting"
            self.deadline = now + self.config.start_timeout_s
            return
        if now > self.deadline:
            self._give_up(now, f"workers on {', '.join(late)} did not restart in time")

    def _await_head(self, now: float, unit_state: str) -> None:
        assert self.config.health_url is not None
        if unit_state == "active" and self.members.healthy(self.config.health_url):
            self.ready_seen = True
            with self.lock:
                self.state.phase = "watching"
            self._note("engine-recovered", now, restarts=self.state.restarts)
            return
        stopped = self._stopped_workers()
        if unit_state not in RUNNING and unit_state != "inactive":
            self._give_up(now, f"head unit {self.config.unit} is {unit_state} while starting")
        elif stopped:
            # the head would wait for it until the start timeout (minutes on real engines)
            self._give_up(now, f"worker on {', '.join(stopped)} stopped while the head started")
        elif now > self.deadline:
            self._give_up(now, "head not healthy within the engine's start timeout")

    def _stopped_workers(self) -> list[str]:
        """Followers that answer and report their worker not running."""
        out = []
        for peer, url in self.config.followers.items():
            state = self.members.peer_state(url)
            if state is not None and state.get("unit_state") not in RUNNING:
                out.append(peer)
        return out

    def _give_up(self, now: float, why: str) -> None:
        """A recovery failed: back to watching; the next one waits `backoff_s`."""
        self._note("recovery-failed", now, reason=why, retry_in_s=self.config.backoff_s)
        with self.lock:
            self.state.phase = "watching"
        self.backoff_until = now + self.config.backoff_s


def _is_generation(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_GENERATION


class Peers:
    """Who may read GET /state: loopback and the addresses of the engine's other hosts (names
    resolved at start and again at most every RESOLVE_EVERY_S, when an unknown address calls)."""

    def __init__(self, names: list[str], log: Callable[[str], None] = print) -> None:
        self.names = names
        self.log = log
        self.addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
        self.resolved_at = -RESOLVE_EVERY_S
        self.refused_at: dict[str, float] = {}
        self.lock = threading.Lock()
        self._resolve(time.monotonic())

    def _resolve(self, now: float) -> None:
        found = set()
        for name in self.names:
            try:
                found.add(_canonical(name))
                continue
            except ValueError:
                pass
            try:
                infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            except OSError:
                continue  # not resolvable now: tried again on the next unknown caller
            found.update(_canonical(str(info[4][0])) for info in infos)
        self.addresses = found
        self.resolved_at = now

    def allows(self, address: str) -> bool:
        try:
            ip = _canonical(address)
        except ValueError:
            return False
        if ip.is_loopback or ip in self.addresses:
            return True
        with self.lock:
            now = time.monotonic()
            if now - self.resolved_at >= RESOLVE_EVERY_S:
                self._resolve(now)
                if ip in self.addresses:
                    return True
            if now - self.refused_at.get(address, -REFUSED_LOG_S) >= REFUSED_LOG_S:
                self.refused_at[address] = now
                self.log(
                    f"refused GET /state from {address}: not loopback nor one of the engine's "
                    f"hosts ({', '.join(self.names) or 'none'})"
                )
        return False


def _canonical(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class _Bounded:
    """A request's bytes as the handler reads them: at most `limit` in all (then end of file)
    and all within `seconds` (then TimeoutError, which http.server answers by closing), so a
    trickled or endless request holds its thread for `seconds` at most."""

    def __init__(self, sock: socket.socket, limit: int, seconds: float) -> None:
        self.sock = sock
        self.left = limit
        self.deadline = time.monotonic() + seconds
        self.buf = b""

    def _fill(self) -> bool:
        if self.left <= 0:
            return False
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request not read in time")
        self.sock.settimeout(remaining)
        chunk = self.sock.recv(min(4096, self.left))
        self.left -= len(chunk)
        self.buf += chunk
        return bool(chunk)

    def readline(self, size: int = -1) -> bytes:
        while b"\n" not in self.buf and (size < 0 or len(self.buf) < size):
            if not self._fill():
                break
        end = self.buf.find(b"\n") + 1 or len(self.buf)
        if size >= 0:
            end = min(end, size)
        line, self.buf = self.buf[:end], self.buf[end:]
        return line

    def read(self, size: int = -1) -> bytes:
        while size < 0 or len(self.buf) < size:
            if not self._fill():
                break
        end = len(self.buf) if size < 0 else size
        out, self.buf = self.buf[:end], self.buf[end:]
        return out

    def close(self) -> None:
        self.buf = b""


class _Handler(BaseHTTPRequestHandler):
    watcher: Watcher
    timeout = WATCH_READ_TIMEOUT_S  # the socket's, until the request is read

    def setup(self) -> None:
        super().setup()
        self.rfile.close()
        self.rfile = _Bounded(  # type: ignore[assignment]
            self.connection, WATCH_REQUEST_LIMIT, WATCH_READ_TIMEOUT_S
        )

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?", 1)[0] != "/state":
            self.send_error(404)
            return
        body = json.dumps(self.watcher.snapshot(), sort_keys=True).encode()
        self.connection.settimeout(WATCH_READ_TIMEOUT_S)  # a reader that stops is dropped
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's name
        return


class StateServer(ThreadingHTTPServer):
    """GET /state for loopback and the engine's hosts (`peers`), at most `max_connections` at
    once: a connection past them, or from another address, is closed before a byte is read."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[_Handler],
        peers: Peers,
        max_connections: int = WATCH_MAX_CONNECTIONS,
    ) -> None:
        super().__init__(address, handler)
        self.peers = peers
        self.slots = threading.BoundedSemaphore(max_connections)
        self.refused_full = 0

    def verify_request(self, request: Any, client_address: Any) -> bool:
        return self.peers.allows(str(client_address[0]))

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused_full += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


def state_server(watcher: Watcher, address: tuple[str, int]) -> StateServer:
    handler = type("Handler", (_Handler,), {"watcher": watcher})
    return StateServer(address, handler, Peers(watcher.config.peer_names(), watcher.log))


def serve(config: WatchConfig, members: Members | None = None) -> None:
    """Run a watcher: GET /state on its port, one `step` every `poll_s`, until killed."""

    def log(message: str) -> None:
        print(message, flush=True)

    watcher = Watcher(config, members or Members(), log)
    server = state_server(watcher, ("0.0.0.0", config.port))  # noqa: S104 - peers read it
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(
        f"{config.engine}: watching as {config.role} on {config.host} "
        f"(unit {config.unit}, generation {watcher.state.generation}, port {config.port})"
    )
    while True:
        try:
            watcher.step(time.time())
        except (OSError, subprocess.SubprocessError) as exc:
            print(f"{config.engine}: poll failed: {exc}", file=sys.stderr, flush=True)
        time.sleep(config.poll_s)
