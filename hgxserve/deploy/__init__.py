"""Deploy time: the typed `--data` table (`data`), one plan per stage (`plans`), the
decisions made once per run (`switching`, `bakers`, `stages`) and the state kept per pyinfra run
(`runstate`).

The deploy files (deploys/*.py) import only `hgxserve.deploy.plans` and roles. This package
module imports nothing: `runstate` is a base-layer module the release operations use.
"""
