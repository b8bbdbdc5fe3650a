"""Each Literal type of the typed topology equals the schema enum it stands for."""

from __future__ import annotations

from typing import get_args

import pytest

from hgxserve.base.defaults import topology_schema
from hgxserve.base.routing import POLICY_NAMES, VOCABULARY
from hgxserve.proxy.policies import POLICIES
from hgxserve.topology import model


@pytest.mark.parametrize(
    ("literal", "definition", "prop"),
    [
        (model.Role, "engine", "role"),
        (model.EngineKind, "engine", "engine"),
        (model.KvConnector, "kv", "connector"),
        (model.KvFailurePolicy, "kv", "failure_policy"),
        (model.KvBufferDevice, "kv", "buffer_device"),
        (model.ProxyKind, "proxy", "kind"),
        (model.Addressing, "s3Source", "addressing"),
        (model.CacheMode, "cache", "policy"),
        (model.CacheDistribute, "cache", "distribute"),
        (model.WarmupApi, "warmup", "api"),
        (model.DcgmSource, "monitoringDcgm", "source"),
    ],
)
def test_literal_matches_the_schema_enum(literal, definition, prop):
    enum = topology_schema()["$defs"][definition]["properties"][prop]["enum"]
    assert list(get_args(literal)) == enum


def test_secret_kinds_are_the_schema_alternatives():
    alternatives = topology_schema()["$defs"]["secretRef"]["oneOf"]
    kinds = sorted(k for alt in alternatives for k in alt.get("required", []))
    assert sorted(get_args(model.SecretKind)) == kinds


def test_routing_policies_are_named_once_for_the_schema_and_the_proxy():
    """The routing policies' names are written in hgxserve/base/routing.py alone: the schema's
    enum names the same, in its order, and the proxy's registry holds one policy under each,
    the one that says it is that name's."""
    assert list(POLICY_NAMES) == topology_schema()["$defs"]["routingPolicy"]["enum"]
    assert sorted(POLICIES) == sorted(POLICY_NAMES)
    assert all(policy.vocab is VOCABULARY[name] for name, policy in POLICIES.items())
