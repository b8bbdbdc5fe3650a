"""SyncArgs.to_argv() is what `hgxserve weights sync` parses: the real click command reads it
back into the same object, for every option set and unset."""

from __future__ import annotations

from dataclasses import fields

import pytest

from hgxserve.cli.weights import weights
from hgxserve.weights.options import SyncArgs, manifest_ref

CASES = [
    SyncArgs("s3://models/x/", "/models/x"),
    SyncArgs(
        "s3://models/x/",
        "/models/x",
        concurrency=7,
        part_size=64 << 20,
        manifest="s3://models/x/other-manifest.json",
        state_dir="/var/lib/hgxserve/weights/x",
        endpoint_url="https://s3.example.com",
        region="cn-north-1",
        addressing="virtual",
        env_file="/etc/hgxserve/s3.env",
        profile="models",
        request_deadline_s=900.0,
        require_sha256=False,
    ),
    SyncArgs("/mnt/hgxserve-models", "/nvme/models/x", manifest="/mnt/hgxserve-models/m.json"),
    SyncArgs("/srv/with space/x", "/models/x y", part_size=8 << 20),
]


def _parse(argv: list[str]) -> SyncArgs:
    command = weights.commands[argv[0]]
    ctx = command.make_context(argv[0], argv[1:])
    return SyncArgs.from_params(ctx.params)


@pytest.mark.parametrize("args", CASES, ids=lambda a: a.src)
def test_to_argv_round_trips_through_the_cli(args: SyncArgs) -> None:
    assert _parse(args.to_argv()) == args


def test_every_field_is_an_option_of_the_command() -> None:
    params = {p.name for p in weights.commands["sync"].params} | {"manifest"}
    missing = [f.name for f in fields(SyncArgs) if f.name not in params]
    assert missing == []
    full = CASES[1]
    assert all(getattr(full, f.name) != getattr(CASES[0], f.name) for f in fields(SyncArgs)[2:])


def test_manifest_ref_is_written_once() -> None:
    assert manifest_ref("s3://m/x/", "hgxserve-manifest.json") is None
    assert manifest_ref("s3://m/x/", "other.json") == "s3://m/x/other.json"
    assert manifest_ref("/mnt/m", "other.json") == "/mnt/m/other.json"
