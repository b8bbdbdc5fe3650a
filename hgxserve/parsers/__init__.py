"""Parsers free of pyinfra: what tools print on a host, and what the facts' own commands print.

`outputs`: real tool outputs (nvidia-smi, ibv_devinfo, ibstat, os-release, engine error logs).
`sections`: the one splitter of `##name`-marked command output.
`probes`: the values the pyinfra facts (hgxserve.facts) make of their commands' output.

Host-side commands (`hgxserve gpus`, `inspect`, the release switch) import these without paying
for pyinfra; tests/structure/test_parsers_pure.py holds them to that.
"""
