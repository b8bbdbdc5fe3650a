"""What the controller asks a host's `hgxserve weights sync` to do, as one typed object.

`SyncArgs` holds the options the `weights sync` command takes (paths and settings, never a
secret), `to_argv()` writes them as that command's arguments and `from_params()` reads them back
from its parsed options, so the operation, the role and the CLI agree on one set of options
(tests/weights/test_options.py parses `to_argv()` with the real command and gets the object back).
`sync_command()` is the host command line the weights operation runs: sync, then verify.

The part size is bytes (an int) from the topology's model to the command line: the topology's
`32Mi` is parsed once there, and s5cmd's MiB are taken from the bytes at the last step
(hgxserve.weights.native).

>>> SyncArgs("s3://models/x/", "/models/x").to_argv()[:5]
['sync', 's3://models/x/', '/models/x', '--concurrency', '32']
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from typing import Any

from hgxserve.base.defaults import S3_CONCURRENCY, S3_PART_SIZE_BYTES, S3_REQUEST_DEADLINE_S
from hgxserve.base.paths import AGENT
from hgxserve.weights.manifest import MANIFEST_NAME


@dataclass(frozen=True)
class SyncArgs:
    """`hgxserve weights sync SRC DEST` and its options (see `hgxserve weights sync --help`)."""

    src: str  # s3://bucket/prefix/ or a directory (a CephFS mount when staging)
    dest: str  # the model directory on the host
    concurrency: int = S3_CONCURRENCY
    part_size: int = S3_PART_SIZE_BYTES  # bytes per ranged GET
    manifest: str | None = None  # file or s3:// URL; None: SRC/hgxserve-manifest.json
    state_dir: str | None = None
    # S3 only: endpoint, signing region, addressing, and where credentials are read on the host
    endpoint_url: str | None = None
    region: str | None = None
    addressing: str = "auto"
    env_file: str | None = None  # a 0600 file on the host; the secret never passes here
    profile: str | None = None
    # all attempts of one S3 request together (given on the command line only when changed)
    request_deadline_s: float = S3_REQUEST_DEADLINE_S
    # False is the explicit opt-out (model.integrity: size-etag): --allow-size-etag
    require_sha256: bool = True

    @property
    def is_s3(self) -> bool:
        return self.src.startswith("s3://")

    def to_argv(self) -> list[str]:
        """The `weights sync` arguments, options in a fixed order."""
        argv = ["sync", self.src, self.dest, "--concurrency", str(self.concurrency)]
        argv += ["--part-size", str(self.part_size), "-q"]
        if self.is_s3:
            argv += ["--addressing", self.addressing]
            for flag, value in (
                ("--endpoint-url", self.endpoint_url),
                ("--region", self.region),
                ("--env-file", self.env_file),
                ("--profile", self.profile),
            ):
                if value:
                    argv += [flag, value]
            if self.request_deadline_s != S3_REQUEST_DEADLINE_S:
                argv += ["--request-deadline", f"{self.request_deadline_s:g}"]
        if self.manifest:
            argv += ["--manifest", self.manifest]
        if self.state_dir:
            argv += ["--state-dir", self.state_dir]
        if not self.require_sha256:
            argv.append("--allow-size-etag")
        return argv

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> SyncArgs:
        """From the parsed options of `weights sync` (click's ctx.params)."""
        names = {f.name for f in fields(cls)}
        renamed = {"manifest_ref": "manifest"}
        values = {renamed.get(k, k): v for k, v in params.items()}
        return cls(**{k: v for k, v in values.items() if k in names})


def manifest_ref(base: str, name: str) -> str | None:
    """The manifest to pass for a tree at `base` whose manifest is called `name`: None for the
    default name (the command finds it), else the file or object next to the model."""
    return None if name == MANIFEST_NAME else f"{base.rstrip('/')}/{name}"


def sync_command(options: SyncArgs, *, agent: str = AGENT, digest: str | None = None) -> str:
    """The agent command line: sync, then verify (paths and options only, never a secret).

    sync_command(SyncArgs("s3://models/x/", "/models/x", env_file="/etc/hgxserve/s3.env"))
    """
    q = shlex.quote
    sync = " ".join(q(word) for word in [agent, "weights", *options.to_argv()])
    verify = [q(agent), "weights", "verify", q(options.dest), "-q"]
    if options.state_dir:
        verify += ["--state-dir", q(options.state_dir)]
    if digest:
        verify += ["--digest", q(digest)]
    return sync + " && " + " ".join(verify)
