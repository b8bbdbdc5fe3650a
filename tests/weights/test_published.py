"""The published manifest's total, read on the controller for the preflight's disk check."""

from __future__ import annotations

from weights_helpers import Bucket, free_port

from hgxserve.weights.manifest import Manifest, ManifestFile
from hgxserve.weights.published import published_manifest_size

GiB = 1024**3


def test_size_of_the_published_manifest(bucket: Bucket) -> None:
    files = [
        ManifestFile("model-00001-of-00163.safetensors", 4 * GiB, "a" * 64),
        ManifestFile("config.json", 1812, "b" * 64),
    ]
    bucket.put("dsv32/hgxserve-manifest.json", Manifest(files).dumps())
    url = f"s3://{bucket.name}/dsv32/hgxserve-manifest.json"
    endpoint = f"http://127.0.0.1:{bucket.port}"
    assert published_manifest_size(url, endpoint, "us-east-1", "path") == (
        4 * GiB + 1812,
        f"the published manifest {url}",
    )


def test_no_published_manifest_says_why(bucket: Bucket) -> None:
    url = f"s3://{bucket.name}/unpublished/hgxserve-manifest.json"
    size, why = published_manifest_size(url, f"http://127.0.0.1:{bucket.port}", None, "path")
    assert size is None
    assert why.startswith(f"the published manifest {url} could not be read from the controller: ")
    assert "HTTP 404 NoSuchKey" in why


def test_unreachable_endpoint_says_why(aws_env: dict[str, str]) -> None:
    url = "s3://models/x/hgxserve-manifest.json"
    size, why = published_manifest_size(url, f"http://127.0.0.1:{free_port()}", None, "path")
    assert size is None
    assert why.startswith(f"the published manifest {url} could not be read from the controller")
