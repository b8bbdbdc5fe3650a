"""Deploy time: the typed `--data` table (`data`), one plan per stage (`plans`) and the
decisions made once per run (`switching`, `bakers`, `stages`).

The deploy files (deploys/*.py) import only `hgxserve.deploy.plans` and roles.
"""
