"""How an engine gets the proxy's key for its engines without it on a command line.

vLLM reads `VLLM_API_KEY` from its environment. SGLang reads a key only from `--api-key`, so a
keyed SGLang engine starts through a short launcher run by the engine's own Python: it takes
the key out of its environment and appends `--api-key <key>` to `sys.argv` in memory before it
runs the `sglang` program in the same process. The process's command line (`/proc/<pid>/cmdline`,
what `ps` shows every local user) holds the launcher and the engine's arguments, never the key.

>>> strip_key_launcher(["/v/bin/python", "-c", SGLANG_KEY_LAUNCHER, "/v/bin/sglang", "serve"])
['/v/bin/sglang', 'serve']
>>> strip_key_launcher(["/v/bin/sglang", "serve"])
['/v/bin/sglang', 'serve']
"""

from __future__ import annotations

# the variable the engines' key is exported as (hgxserve gpus exec-with-credentials)
ENGINE_KEY_VAR = "VLLM_API_KEY"

# `python -c SGLANG_KEY_LAUNCHER <sglang program> serve <args>`: one line without `$`, `%` or `\`
# (unit text); the key leaves the environment, so no child process inherits it.
SGLANG_KEY_LAUNCHER = (
    "import os,runpy,shutil,sys;"
    f"k=os.environ.pop('{ENGINE_KEY_VAR}');"
    "p=sys.argv[1];"
    "sys.argv=[p,*sys.argv[2:],'--api-key',k];"
    "runpy.run_path(shutil.which(p) or p,run_name='__main__')"
)


def keyed_sglang_command(python: str, command: list[str]) -> list[str]:
    """The argv that starts `command` (`<sglang> serve ...`) with the key as `--api-key`."""
    return [python, "-c", SGLANG_KEY_LAUNCHER, *command]


def strip_key_launcher(argv: list[str]) -> list[str]:
    """The engine's own command of an argv that may start with the key launcher."""
    if len(argv) > 3 and argv[1:3] == ["-c", SGLANG_KEY_LAUNCHER]:
        return argv[3:]
    return list(argv)
