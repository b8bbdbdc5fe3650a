"""Read a systemd credential on a host the way a unit's LoadCredential= names it, for the agent
commands that act for an engine outside its unit's credentials directory (the warm-up in
ExecStartPost=, `hgxserve cache bake`). Values are returned, never printed.

    >>> read_credential("hgxserve-engine-key")  # doctest: +SKIP
    'the key'
"""

from __future__ import annotations

import os

from hgxserve.base.errors import UsageError

# where systemd looks for `LoadCredential=NAME` without a path (systemd.exec(5))
CREDENTIAL_STORES = ("/etc/credstore", "/run/credstore", "/usr/lib/credstore")


def read_credential(spec: str) -> str:
    """The value of a credential named as in LoadCredential= (NAME or NAME:PATH): from
    $CREDENTIALS_DIRECTORY/NAME, else PATH, else the credential stores."""
    name, _, path = spec.partition(":")
    if not name or "/" in name or name in (".", ".."):
        raise UsageError(f"not a credential name: {name!r}")
    candidates = []
    if os.environ.get("CREDENTIALS_DIRECTORY"):
        candidates.append(os.path.join(os.environ["CREDENTIALS_DIRECTORY"], name))
    candidates += [path] if path else [os.path.join(d, name) for d in CREDENTIAL_STORES]
    for candidate in candidates:
        try:
            with open(candidate, encoding="utf-8") as fh:
                value = fh.read().rstrip("\n")
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise UsageError(f"cannot read credential {name!r}: {exc.strerror}") from None
        if value:
            return value
    raise UsageError(f"credential {name!r} not found (looked in {', '.join(candidates)})")
