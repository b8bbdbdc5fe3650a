"""The operator's view of a deployed topology: `hgxserve status` and `hgxserve logs`.

Each host answers one read-only command, `hgxserve inspect` (module `hgxserve.status.host`),
with everything `status` shows as JSON: releases and the pending switch, the units and their
health, drift from the release, GPUs and who holds them, the weights marker, cache keys, and on
the proxy's host the proxy's rotation and counters. The controller runs that command on every
host at once over SSH (`hgxserve.remote.ssh`), compares the answers with the topology
(`hgxserve.status.report`) and prints a table or JSON (`hgxserve.cli.status`).

    hgxserve status topologies/demo/demo-pd.yml --inventory inventory/testhosts.py
    hgxserve logs topologies/demo/demo-pd.yml decode-0 --diagnose
"""
