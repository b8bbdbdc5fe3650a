"""The parsers run on hosts (`hgxserve gpus`, `inspect`, the release switch) without pyinfra:
importing every module of hgxserve.parsers loads no pyinfra module."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import hgxserve.parsers


def test_parsers_import_no_pyinfra():
    names = [f"hgxserve.parsers.{m.name}" for m in pkgutil.iter_modules(hgxserve.parsers.__path__)]
    assert {"hgxserve.parsers.outputs", "hgxserve.parsers.sections"} <= set(names)
    code = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'pyinfra'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"


def test_the_check_sees_pyinfra_when_it_is_imported():
    code = "import sys, hgxserve.facts.gpu; print('pyinfra' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
