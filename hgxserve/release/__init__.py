"""Releases: each host keeps every rendered tree it ran, switches between them as a whole,
health-gates the switch, and can always go back to `previous` or `baseline`.

Host layout (DESIGN.md "Host conventions")::

    /var/lib/hgxserve/releases/<id>/release.json   what the release is (units, files, health)
    /var/lib/hgxserve/releases/<id>/tree/<path>    the files it installs, e.g. tree/etc/systemd/...
    /var/lib/hgxserve/current  -> releases/<id>    confirmed and serving
    /var/lib/hgxserve/previous -> releases/<id>    what `rollback` goes back to
    /var/lib/hgxserve/baseline -> releases/<id>    last confirmed topology marked `baseline: true`
    /var/lib/hgxserve/pending.json                 switched but not yet confirmed (dead-man timer)
"""

# Seconds the gate has, once every host switched, before a pending host reverts on its own.
CONFIRM_WITHIN_S = 300
