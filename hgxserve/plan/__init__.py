"""`hgxserve plan`'s report: what a topology puts where, as data (`report.py`: the GPU map,
listeners, units, wiring, firewall, fit estimate, trust root, the last release's numbers), as
text (`text.py`) and as a Graphviz diagram (`diagram.py`).

It reads the renderer, the release's KV capacity check and the bench's shapes, so it sits above
them (README "Layers"), not in `hgxserve.topology`.
"""
