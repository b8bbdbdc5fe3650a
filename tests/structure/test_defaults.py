"""Each default is written once: the CLIs, roles and operations use the schema's defaults and the
host paths from hgxserve.base.paths, so a direct call behaves as a deploy does."""

from __future__ import annotations

import inspect

from click.testing import CliRunner

from hgxserve.base import defaults, paths
from hgxserve.cli.weights import weights as weights_cli
from hgxserve.topology.model import S3Source, _engine
from hgxserve.weights.options import SyncArgs, sync_command
from hgxserve.weights.sync import SyncOptions
from hgxserve.weights.transfer import TransferOptions


def _default(fn, name):
    fn = inspect.unwrap(getattr(fn, "_inner", fn))
    return inspect.signature(fn).parameters[name].default


def test_s3_defaults_are_the_schema_defaults():
    assert defaults.S3_CONCURRENCY == 32 and defaults.S3_PART_SIZE == "32Mi"
    assert defaults.S3_PART_SIZE_BYTES == 32 << 20
    assert SyncOptions().concurrency == defaults.S3_CONCURRENCY
    assert SyncOptions().part_size == defaults.S3_PART_SIZE_BYTES
    assert SyncArgs("s3://b/m/", "/m").concurrency == defaults.S3_CONCURRENCY
    assert SyncArgs("s3://b/m/", "/m").part_size == defaults.S3_PART_SIZE_BYTES
    assert TransferOptions().concurrency == defaults.S3_CONCURRENCY
    assert TransferOptions().part_size == defaults.S3_PART_SIZE_BYTES
    assert {f.name for f in S3Source.__dataclass_fields__.values()} >= {"concurrency", "part_size"}


def test_sync_cli_shows_the_schema_defaults():
    out = CliRunner().invoke(weights_cli, ["sync", "--help"]).output
    assert "[default: 32;" in out and "[default: 32Mi]" in out
    sync = weights_cli.commands["sync"]
    params = {p.name: p.default for p in sync.params}
    assert params["concurrency"] == defaults.S3_CONCURRENCY
    assert params["part_size"] == defaults.S3_PART_SIZE


def test_sync_command_without_options_uses_the_schema_defaults():
    cmd = sync_command(SyncArgs("s3://b/m/", "/models/m"))
    assert "--concurrency 32 --part-size 33554432" in cmd
    assert cmd.startswith(paths.AGENT + " weights sync ")


def test_engine_and_bootstrap_defaults():
    assert defaults.ENGINE == "vllm"
    assert defaults.SGLANG_BOOTSTRAP_PORT == 8998
    engine = _engine("e", {"role": "combined", "place": {"h": [0]}, "port": 8000})
    assert engine.engine == defaults.ENGINE


def test_proxy_config_bootstrap_default_is_the_schema_default():
    from hgxserve.proxy.config import parse_proxy_config

    cfg = parse_proxy_config(
        {
            "protocol": "sglang",
            "listen": {"host": "127.0.0.1", "port": 8000},
            "served_model_name": "m",
            "pd_groups": [
                {
                    "name": "g",
                    "prefill": [{"url": "http://127.0.0.1:30000", "bootstrap_host": "127.0.0.1"}],
                    "decode": ["http://127.0.0.1:30001"],
                }
            ],
        }
    )
    assert cfg.pd_groups[0].prefill[0].bootstrap_port == defaults.SGLANG_BOOTSTRAP_PORT
