"""Engine files role: put the files a topology names (chat templates, tool-parser plugins,
configs) at their fixed host paths (/etc/hgxserve/files/<name>), checked against the sha256
the topology pins. Unchanged files are left alone.

Example:
    engine_files(files=[(TopologyFile("t.jinja", "/srv/t.jinja", "4ba2..."), Path("/srv/t.jinja"))])
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from pyinfra.api import deploy
from pyinfra.operations import files as file_ops
from pyinfra.operations import server

from hgxserve.topology.model import TopologyFile


@deploy("Ship the files the topology names")
def engine_files(*, files: Sequence[tuple[TopologyFile, Path]]) -> None:
    """Ship each (file, controller copy) to the file's host path, 0644, and check its sha256.

    + files: the topology's files with their verified local copies (hgxserve.runtime.files)
    """
    for spec, local in files:
        put = file_ops.put(
            name=f"Ship {spec.name} to {spec.host_path} (sha256 {spec.sha256[:12]})",
            src=str(local),
            dest=spec.host_path,
            mode="644",
            create_remote_dir=True,
        )
        line = shlex.quote(f"{spec.sha256}  {spec.host_path}")
        server.shell(
            name=f"Check {spec.host_path} against its sha256",
            commands=[f"printf '%s\\n' {line} | sha256sum --check --quiet --strict"],
            _if=put.did_change,
        )
