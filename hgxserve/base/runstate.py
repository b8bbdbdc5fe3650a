"""State that lives exactly as long as one pyinfra run.

Deploy files run once per host, but some decisions are made once per run (every host's release
plan, the switch's plan and the record of what its hosts report, whether the agent was
handled). They are kept per pyinfra `State`, so a second deploy in the same Python process
(API use, tests) starts afresh instead of reusing the first one's plan or verdict, and a
finished run's state goes away with it.

>>> from pyinfra.api import Config, Inventory, State
>>> run = State(Inventory(([], {})), Config())
>>> per_run(run, "answer", lambda: 42), per_run(run, "answer", lambda: 0)
(42, 42)
>>> recorded(run, "answer"), recorded(run, "question")
(42, None)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar
from weakref import WeakKeyDictionary

from pyinfra.api.state import State

T = TypeVar("T")

_RUNS: WeakKeyDictionary[State, dict[Hashable, Any]] = WeakKeyDictionary()


def per_run(state: State, key: Hashable, make: Callable[[], T]) -> T:
    """The value stored under `key` for this run, made by `make()` the first time it is asked.

    `make` must not read a fact or run a command: pyinfra loads every host's deploy file side
    by side (a greenlet each), and a `make` that pauses lets another host's load make a second
    value, each host then keeping its own. Read what it needs first."""
    memo = _RUNS.setdefault(state, {})
    if key not in memo:
        memo[key] = make()
    value: T = memo[key]
    return value


def recorded(state: State, key: Hashable) -> Any:
    """The value stored under `key` for this run, or None when nothing was stored."""
    return _RUNS.get(state, {}).get(key)
