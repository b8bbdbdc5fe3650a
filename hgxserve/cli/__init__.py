"""The `hgxserve` command line: the root group, and one module per command group beside it.

Each module here parses its options, calls the library, prints, and maps errors to exit codes
(`hgxserve.base.errors`); the options several commands share are declared once in `options.py`.
A command's module is imported only when that command runs, so `hgxserve validate` does not pay
for boto3 or aiohttp imports. Only this package imports its modules; no library module imports
it (tests/structure/test_layers.py).
"""

from __future__ import annotations

import importlib
import signal
from typing import Any

import click

from hgxserve import __version__

# command name -> "module:attribute" of a click command or group
COMMANDS: dict[str, tuple[str, str]] = {
    "validate": ("hgxserve.cli.topology:validate", "Check topology files: schema and rules."),
    "plan": ("hgxserve.cli.topology:plan", "Show per-host GPU map, ports, commands, wiring."),
    "render": ("hgxserve.cli.render:render", "Write the units and files each host will get."),
    "weights": ("hgxserve.cli.weights:weights", "Build manifests, sync and verify model weights."),
    "cache": ("hgxserve.cli.caches:cache", "Key, bake, pack and restore JIT/compile caches."),
    "proxy": ("hgxserve.cli.proxy:proxy", "Run the P/D proxy (OpenAI-compatible endpoint)."),
    "release": ("hgxserve.cli.release:release", "Host-side release switch, health gate, rollback."),
    "engine": ("hgxserve.cli.release:engine", "Watch a multi-node engine (run by its units)."),
    "facts": ("hgxserve.cli.facts:facts", "Print this host's GPU/RDMA/shm facts as JSON."),
    "bench": ("hgxserve.cli.bench:bench", "SLA load tests of a deployed topology; compare runs."),
    "gpus": ("hgxserve.cli.gpus:gpus", "Check or wait until GPUs hold no memory (used by units)."),
    "status": ("hgxserve.cli.status:status", "What runs where, healthy or not, on every host."),
    "logs": ("hgxserve.cli.status:logs", "An engine's or the proxy's journal on all its hosts."),
    "inspect": ("hgxserve.cli.inspect:inspect", "This host's serving state as JSON (for status)."),
    "runtime": ("hgxserve.cli.runtime:runtime", "Check the files the runtime stage shipped."),
    "tune": (
        "hgxserve.cli.tune:tune",
        "Deploy candidate topologies, bench each, keep the best under the SLA.",
    ),
    "deploy-data": ("hgxserve.cli.deploy:deploy_data", "The --data keys the deploys read."),
    "monitoring": (
        "hgxserve.cli.monitoring:monitoring",
        "Prometheus config, rules and Grafana dashboard from a topology.",
    ),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, attr = target[0].split(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                return _unavailable(cmd_name, target[1])
            raise
        command: click.Command = getattr(module, attr)
        return command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, help_text: str) -> click.Command:
    def run(**_: Any) -> None:
        raise click.ClickException(f"'{name}' is not available in this build of hgxserve")

    return click.Command(name, callback=run, help=help_text)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hgxserve")
def main() -> None:
    """Deploy LLM serving on bare-metal NVIDIA HGX hosts from one validated YAML topology.

    \b
    hgxserve validate topologies/h20-v4flash-tp8.yml
    hgxserve plan topologies/h20-v4flash-4p4d.yml
    pyinfra inventory/lab.py deploys/site.py --data topology=topologies/h20-v4flash-4p4d.yml
    """
    # Ctrl-C stops every command ("Ctrl-C to stop"), also one started where SIGINT is
    # ignored: a background job of a non-interactive shell inherits SIG_IGN, and Python then
    # leaves it ignored, so `status --watch` or `logs -f` could only be killed.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
