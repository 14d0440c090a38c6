"""The `hvdp` command: doctor, verify, bench, build-horovod. Each subcommand's module loads only when it runs."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). The module has add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "doctor": ("hvdp.tools.doctor", "explain the installed stack, the launcher, and what to fix"),
    "verify": ("hvdp.tools.verify", "prove on this machine that N ranks x batch b == 1 process x batch N*b"),
    "bench": ("hvdp.tools.bench", "measure training throughput and allreduce bandwidth vs DDP and Horovod"),
    "build-horovod": ("hvdp.tools.build_horovod",
                      "build Horovod with hvdp's fixes for this env's frameworks and install it"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hvdp", description="Data-parallel training you can trust.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help) in COMMANDS.items():
        p = sub.add_parser(name, help=help, description=help)
        p.set_defaults(module=module)
        # Each subcommand's flags live with its code; loading them imports no framework.
        importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(args.module).run(args)


if __name__ == "__main__":
    sys.exit(main())
