"""AWS credentials from the standard chain or an env-file reference, never printed.

Order: an env file named by the topology (`credentials: {env_file: /etc/hgxserve/s3.env}`, 0600,
KEY=VALUE lines loaded into this process's environment), then `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN` in the environment (fast path, no botocore import),
then botocore's chain (profiles, credential files, SSO, container and instance roles).

    creds = resolve_credentials(env_file="/etc/hgxserve/s3.env", profile=None)
    access_key, secret_key, token = creds.get()
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from hgxserve.base.errors import register_secret, scrub
from hgxserve.weights.errors import CredentialsError

_ENV_LINE = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")


def load_env_file(path: str) -> dict[str, str]:
    """Read KEY=VALUE lines from a 0600 env file (systemd EnvironmentFile syntax, no expansion).

    values = load_env_file("/etc/hgxserve/s3.env")
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CredentialsError(f"credentials env file {path} does not exist") from None
    except PermissionError:
        raise CredentialsError(
            f"credentials env file {path} is not readable by this user"
        ) from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialsError(
            f"credentials env file {path} has mode {stat.S_IMODE(st.st_mode):04o}; "
            "it must be readable by its owner only",
            hint=f"chmod 600 {path}",
        )
    values: dict[str, str] = {}
    try:
        with open(path, encoding="utf-8") as fh:
            for number, raw in enumerate(fh, 1):
                line = raw.strip()
                if not line or line.startswith("#"):
                    continue
                match = _ENV_LINE.match(line)
                if not match:
                    # The line may hold a secret: name the line, never its content.
                    raise CredentialsError(f"{path}:{number}: not a KEY=VALUE line")
                key, value = match.group(1), match.group(2)
                if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                    value = value[1:-1]
                values[key] = value
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials env file {path}: {exc.strerror}") from None
    for key in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        register_secret(values.get(key))
    return values


@dataclass
class Credentials:
    """A source of (access key, secret key, session token) that may refresh itself."""

    access_key: str | None = None
    secret_key: str | None = None
    token: str | None = None
    provider: Any = field(default=None, repr=False)
    method: str = "env"

    def get(self) -> tuple[str, str, str | None]:
        """Current credentials; refreshable ones (instance roles, SSO) refresh here."""
        if self.provider is not None:
            frozen = self.provider.get_frozen_credentials()
            register_secret(frozen.secret_key)
            register_secret(frozen.token)
            register_secret(frozen.access_key)
            return frozen.access_key, frozen.secret_key, frozen.token
        assert self.access_key and self.secret_key
        return self.access_key, self.secret_key, self.token


def apply_env_file(path: str | None) -> None:
    """Load the env file's values into this process's environment (they win over inherited ones).

    apply_env_file("/etc/hgxserve/s3.env")
    """
    if path:
        os.environ.update(load_env_file(path))


def resolve_credentials(profile: str | None = None) -> Credentials:
    """Resolve credentials like the AWS CLI does; raise CredentialsError when none are found.

    creds = resolve_credentials(profile="models-ro")
    """
    for key in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        register_secret(os.environ.get(key))
    access_key = os.environ.get("AWS_ACCESS_KEY_ID")
    secret_key = os.environ.get("AWS_SECRET_ACCESS_KEY")
    if access_key and secret_key and not profile:
        return Credentials(access_key, secret_key, os.environ.get("AWS_SESSION_TOKEN") or None)
    # The full chain (profiles, SSO, instance metadata) needs botocore; imported only here.
    import botocore.exceptions
    import botocore.session

    try:
        session = botocore.session.Session(profile=profile)
        provider = session.get_credentials()
    except botocore.exceptions.ProfileNotFound:
        raise CredentialsError(f"AWS profile {profile!r} is not configured") from None
    except botocore.exceptions.BotoCoreError as exc:
        raise CredentialsError(f"cannot load AWS credentials: {scrub(str(exc))}") from None
    if provider is None:
        raise CredentialsError(
            "no AWS credentials found (env, profile, credential file or instance role)",
            hint="set credentials.env_file or credentials.profile in the topology, "
            "or export AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
        )
    creds = Credentials(provider=provider, method=getattr(provider, "method", "chain"))
    creds.get()  # registers the secrets for scrubbing before any request is made
    return creds


def profile_setting(profile: str | None, name: str) -> str | None:
    """A setting (region, endpoint_url, ca_bundle) from the AWS config profile, if any.

    region = profile_setting("models-ro", "region")
    """
    config_file = os.environ.get("AWS_CONFIG_FILE", os.path.expanduser("~/.aws/config"))
    if not profile and not os.path.exists(config_file):
        return None
    import botocore.exceptions
    import botocore.session

    try:
        scoped = botocore.session.Session(profile=profile).get_scoped_config()
    except botocore.exceptions.BotoCoreError:
        return None
    value = scoped.get(name)
    if isinstance(value, dict):  # nested "s3 =" sections
        return None
    return str(value) if value else None
