"""`hgxserve tune SPEC`: deploy candidate topologies one after the other through normal releases,
bench each with the same scenarios and seeds, keep the results, and leave the lab on the best one
that meets the SLA (docs/tune.md).

- `spec`: the SPEC file (checked like a topology: every error as `file:line:col: $.path: msg`);
- `matrix`: a matrix over the base topology expanded to concrete topology files;
- `prune`: validate + the memory / KV-cache fit estimate of each candidate, before any deploy;
- `state`: the tune's state file (atomic writes), what a resumed tune skips;
- `choose`: each candidate's score and verdict from its bench run, and the best one;
- `loop`: deploy (the pyinfra CLI, as `deploys/site.py` runs for an operator), bench, record;
- `report`: report.md, report.json and plots in the tune's run directory.
"""
