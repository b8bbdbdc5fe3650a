"""Roll every host back together to its `previous` release (default) or its `baseline`.

pyinfra inventory/testhosts.py deploys/rollback.py
pyinfra inventory/testhosts.py deploys/rollback.py --data to=baseline

Also `health_timeout` and `confirm_within`, as for deploys/engines.py. Every key:
`hgxserve deploy-data` (docs/deploy-data.md).
"""

from pyinfra import host, inventory

from hgxserve.deploy.plans import rollback_plan
from roles.releases import switch_to

plan = rollback_plan(host, inventory)
switch_to(plan=plan)
