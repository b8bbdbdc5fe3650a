"""Model weights: manifests, parallel S3/local sync with inline sha256, verification, markers.

Runs on the controller (manifest building) and on the hosts (sync, verify, check-marker), where
the engine units call `hgxserve weights check-marker` before they start. Importing this package is
cheap: boto/botocore and pyinfra are imported only where they are needed.

    hgxserve weights sync s3://models/DeepSeek-V4-Flash/ /models/DeepSeek-V4-Flash
"""
