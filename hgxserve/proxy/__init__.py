"""`hgxserve proxy`: one OpenAI-compatible endpoint for P/D (vLLM NIXL, SGLang) and combined.

hgxserve proxy check --config /etc/hgxserve/proxy.json
hgxserve proxy serve --config /etc/hgxserve/proxy.json
"""
