"""The size of a model as its published manifest lists it, read on the controller.

The weights stage syncs the files the manifest published next to an S3 model lists
(`hgxserve weights manifest SRC --publish`), so that manifest's total is what each host must
have room for. The preflight reads it once per source when the topology has no `model.size`,
with the controller's own S3 credentials (the standard chain, or the source's profile), a short
timeout and one retry: a controller that cannot read it says why, and the preflight says the
disk check was not sized.

Example:
    size, where = published_manifest_size("s3://models/DeepSeek-V3.2/hgxserve-manifest.json")
    # (740881858560, 'the published manifest s3://models/DeepSeek-V3.2/hgxserve-manifest.json')
"""

from __future__ import annotations

import functools

from hgxserve.weights.errors import WeightsError
from hgxserve.weights.manifest import Manifest
from hgxserve.weights.s3 import S3Options, S3Url, make_client

TIMEOUT_S = 10.0  # per request: the controller may not reach the hosts' S3 at all
RETRIES = 1


@functools.lru_cache(maxsize=16)
def published_manifest_size(
    url: str,
    endpoint: str | None = None,
    region: str | None = None,
    addressing: str = "auto",
    profile: str | None = None,
) -> tuple[int | None, str]:
    """(bytes, where they came from) for the manifest at `url` (s3://...), or (None, why not).
    Cached: every host of a topology asks for the same manifest.

    Example:
        published_manifest_size("s3://models/x/hgxserve-manifest.json", "http://s3.lab:9000")
    """
    where = f"the published manifest {url}"
    try:
        parsed = S3Url.parse(url)
        options = S3Options(
            endpoint_url=endpoint,
            region=region,
            addressing=addressing,
            profile=profile,
            retries=RETRIES,
        )
        client = make_client(parsed.bucket, options)
        client.timeout = TIMEOUT_S
        manifest = Manifest.loads(client.get_bytes(parsed.prefix), url)
    except (WeightsError, OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())[:300]
        return None, f"{where} could not be read from the controller: {reason}"
    return sum(f.size for f in manifest.files), where
