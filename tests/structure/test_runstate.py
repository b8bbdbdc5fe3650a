"""Per-run state: a second deploy in the same process plans afresh and never sees the first
run's switch plan or gate verdict; within one run every host shares one plan."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any

import gevent
from pyinfra.api import Config, Inventory, State

from hgxserve.base.runstate import _RUNS, per_run
from hgxserve.deploy import switching as deploying


def _run() -> State:
    return State(Inventory(([], {})), Config())


@dataclass
class FakeHost:
    """What plan_switch/release_plans use of a pyinfra Host: name, state, the ReleaseState fact."""

    name: str
    state: State
    release_state: dict[str, Any] = field(default_factory=dict)

    def get_fact(self, fact: Any, **_: Any) -> dict[str, Any]:
        return self.release_state


def test_second_run_in_one_process_does_not_reuse_the_switch_plan_or_verdict():
    first = _run()
    hosts = [FakeHost("a", first, {"current": "old"}), FakeHost("b", first, {"current": "r2"})]
    coord = deploying.plan_switch("release:t", hosts, {"a": "r1", "b": "r2"})
    assert coord.plan.switching == {"a": "r1"}
    coord.record.verdict = (False, "decode never got healthy")
    # every host's deploy in the same run gets the same plan, even after a host switched
    hosts[0].release_state = {"current": "r1"}
    assert deploying.plan_switch("release:t", hosts, {"a": "r1", "b": "r2"}) is coord

    second = _run()
    again = [FakeHost("a", second, {"current": "r1"}), FakeHost("b", second, {"current": "r2"})]
    fresh = deploying.plan_switch("release:t", again, {"a": "r1", "b": "r2"})
    assert fresh is not coord
    assert fresh.plan.switching == {} and fresh.record.verdict is None


@dataclass
class PausingHost(FakeHost):
    """A host whose fact is read over the network: the read lets other greenlets run."""

    def get_fact(self, fact: Any, **_: Any) -> dict[str, Any]:
        gevent.sleep(0)
        return self.release_state


def test_hosts_whose_deploys_load_side_by_side_share_one_plan():
    # pyinfra loads each host's deploy file in a greenlet of its own
    run = _run()
    hosts = [PausingHost(name, run, {"current": "old"}) for name in ("a", "b", "c")]
    targets = {"a": "r1", "b": "r1", "c": "r1"}
    loads = [gevent.spawn(deploying.plan_switch, "release:t", hosts, targets) for _ in hosts]
    gevent.joinall(loads, raise_error=True)
    assert loads[0].value is loads[1].value is loads[2].value
    assert deploying.plan_switch("release:t", hosts, targets) is loads[0].value


def test_release_plans_are_made_once_per_run(monkeypatch):
    calls: list[str] = []

    def fake_plan(topo: Any, host: str, health_timeout_s: float) -> str:
        calls.append(host)
        return f"plan-{host}-{len(calls)}"

    monkeypatch.setattr(deploying, "plan_release", fake_plan)

    @dataclass(frozen=True)
    class Topo:
        digest: str = "sha256:t"

    first = _run()
    hosts = [FakeHost("a", first), FakeHost("b", first)]
    plans = deploying.release_plans(Topo(), hosts, 900.0)  # type: ignore[arg-type]
    assert deploying.release_plans(Topo(), hosts, 900.0) is plans  # type: ignore[arg-type]
    assert calls == ["a", "b"]
    second = [FakeHost("a", _run()), FakeHost("b", _run())]
    deploying.release_plans(Topo(), second, 900.0)  # type: ignore[arg-type]
    assert calls == ["a", "b", "a", "b"]


def test_a_finished_run_leaves_nothing_behind():
    run = _run()
    per_run(run, "k", dict)
    assert run in _RUNS
    before = len(_RUNS)
    del run
    gc.collect()
    assert len(_RUNS) == before - 1
