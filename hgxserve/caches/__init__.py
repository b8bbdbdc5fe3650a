"""JIT/compile caches: the render-time key, the pinned layout on hosts, bake/pack/restore.

>>> from hgxserve.caches.key import cache_key
>>> cache_key(topo, topo.engines["decode-0"])  # doctest: +SKIP
'vllm-0.26.0-h20-9b0f3c1d2e4a6b8c'
"""
