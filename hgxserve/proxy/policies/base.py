"""What the router asks of a route's policy (`Policy`), and the request it asks about (`Plan`).

The router (hgxserve/proxy/kvroute.py) keeps what is shared: the indexes of what each engine
holds, the score, stickiness, P/D (decode first, local or remote prefill) and overflow. A policy
says what the router keeps for its engines and how many of a request's prompt tokens one of them
holds cached.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from hgxserve.base.routing import PolicyName
from hgxserve.proxy.config import Routing
from hgxserve.proxy.kvindex import ApproxIndex, BlockIndex, Chain


@dataclass
class Plan:
    """One request as the router sees it: its prompt tokens (exact or estimated), the tokens
    it holds on its engine while in flight, and what its prefix is matched by."""

    tokens: int
    cost: int = 0
    ids: list[int] | None = None
    chunks: list[int] | None = None
    chains: dict[int, Chain] = field(default_factory=dict)

    def chain(self, size: int) -> Chain:
        found = self.chains.get(size)
        if found is None:
            found = self.chains[size] = Chain(self.ids or [], size)
        return found


class Policy(ABC):
    """One route's routing policy, made once per router from the proxy.json's `routing`."""

    # its name and what the topology knows of it (hgxserve/base/routing.py)
    vocab: ClassVar[PolicyName]
    # the router keeps an index of the prompt text it sent each of this policy's engines
    text_index: ClassVar[bool] = False
    # with this policy on every route the decision is the balancer's own (`Pool.decide`)
    balancer_decides: ClassVar[bool] = False

    def __init__(self, routing: Routing) -> None:
        self.routing = routing

    @property
    def kv_events(self) -> bool:
        """The router subscribes to the KV events of this policy's engines: a block index per
        publisher, matched by the request's token ids (so the model's tokenizer is loaded)."""
        return self.vocab.kv_events

    @abstractmethod
    def cached(self, plan: Plan, blocks: Sequence[BlockIndex], text: ApproxIndex | None) -> int:
        """Prompt tokens of `plan` one engine holds cached, by what the router knows of it: its
        publishers' block indexes (`kv_events`) and the prompt text sent to it (`text_index`)."""
