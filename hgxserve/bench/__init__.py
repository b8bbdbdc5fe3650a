"""`hgxserve bench`: SLA load tests of a deployed topology, through its proxy.

The load itself comes from AIPerf (`aiperf profile`); hgxserve adds what a generator alone does
not know: the topology (scenarios beside it, figures per GPU, per-role figures from the engines'
own /metrics), clean rounds (idle before, a unique request-id prefix, engine counts that match
after), results kept per run with plots, SLA verdicts, and comparisons between runs.

>>> from hgxserve.bench.scenario import load_bench
>>> topo, scenarios = load_bench("topologies/demo/demo-pd.yml")  # doctest: +SKIP
"""
