"""The base layer: host paths, schema defaults, sizes, digests, the error contract, credentials,
unit value escaping, the cache layout and the Prometheus text format. Imports nothing above it."""
