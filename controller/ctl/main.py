"""`controllerctl`: the operator's view of runwarden (console script -> `controller.ctl.main:main`).

Subcommands come from a registry. Built-in ones are added directly; the optional ones are modules
exposing ``add_parser(subparsers)`` and ``run(args) -> int``, imported only when their name is on
the command line (so `controllerctl status` never pays for importing them), and replaced by a
placeholder that says what is missing when the module is not installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from controller.ctl import (
    claims,
    compare_loss,
    config,
    drain,
    events,
    goodput,
    node,
    nodes,
    quarantine,
    release,
    repaired,
    status,
    stop,
)
from controller.ctl.client import ENV_ADDRESS, ENV_CONFIG, EXIT_CODE_HELP, Client, CtlError, ExitCode, resolve
from controller.ctl.format import Painter, colour_wanted

PROG = "controllerctl"

# The built-in subcommands, in --help order: each module exposes add_parser(subparsers, common) and run(args).
BUILTIN_SUBCOMMANDS: tuple[ModuleType, ...] = (
    status,
    nodes,
    node,
    events,
    quarantine,
    release,
    repaired,
    drain,
    stop,
    goodput,
    compare_loss,
    config,
    claims,
)

# name -> (module, one-line help). Each module exposes add_parser(subparsers) and run(args) -> int.
OPTIONAL_SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "attribute": ("controller.ctl.attribute", "blame a rank/node from a flight-recorder dump directory"),
    "certs": ("controller.ctl.certs", "create a cluster CA and its server/admin/reader certificates"),
    "chaos": ("controller.ctl.chaos", "inject faults into a test run"),
    "simulate": ("controller.ctl.simulate", "replay supervisor policies on a simulated fleet"),
}


def _global_options(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("connection")
    g.add_argument(
        "--controller",
        metavar="HOST:PORT",
        help=f"controller address (default: ${ENV_ADDRESS}, then the config file, then 127.0.0.1:7070)",
    )
    g.add_argument(
        "--config",
        metavar="FILE",
        help=f"config file (default: ${ENV_CONFIG}, "
        "~/.config/runwarden/controllerctl.toml, /etc/runwarden/...)",
    )
    g.add_argument("--ca", metavar="PEM", help="CA certificate: turns on TLS (with --cert and --key)")
    g.add_argument(
        "--cert", metavar="PEM", help="client certificate (its subject decides read-only or admin)"
    )
    g.add_argument("--key", metavar="PEM", help="client private key")
    g.add_argument("--server-name", dest="server_name", help="the name in the controller's certificate")
    g.add_argument("--timeout", type=float, metavar="SECONDS", help="per-call deadline (default 10)")
    parser.add_argument(
        "--color",
        choices=["auto", "always", "never"],
        default="auto",
        help="colour the tables (default: only on a terminal)",
    )
    parser.add_argument("--json", dest="json_global", action="store_true", help="JSON output for scripts")


def _import_optional(module: str) -> ModuleType | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module.startswith(exc.name):
            return None  # the module itself is missing, not one of its dependencies
        raise


def _missing(name: str, module: str) -> Any:
    def run(args: argparse.Namespace) -> int:
        print(
            f"{PROG} {name}: not available in this installation ({module} is not installed)", file=sys.stderr
        )
        return int(ExitCode.FAILED)

    return run


def _add_optional(sub: Any, argv: Sequence[str]) -> None:
    for name, (module_name, help_text) in OPTIONAL_SUBCOMMANDS.items():
        module = _import_optional(module_name) if name in argv else None
        if module is not None:
            module.add_parser(sub)
            chosen = sub.choices.get(name)
            if chosen is not None:
                chosen.set_defaults(func=module.run)
            continue
        stub = sub.add_parser(name, help=help_text, add_help=False)
        stub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        stub.set_defaults(
            func=_missing(name, module_name) if name in argv else None, optional_module=module_name
        )


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look at and steer the runwarden controller.",
        epilog=f"exit codes:\n{EXIT_CODE_HELP}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _global_options(parser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", dest="json_cmd", action="store_true", help="JSON output for scripts")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in BUILTIN_SUBCOMMANDS:
        module.add_parser(sub, common)
    p = sub.add_parser(
        "completion", help='print a shell completion script: eval "$(controllerctl completion bash)"'
    )
    p.add_argument("shell", choices=["bash", "zsh"])
    p.set_defaults(func=_completion)
    _add_optional(sub, argv)
    return parser


def _completion(args: argparse.Namespace) -> int:
    from controller.ctl.completion import completion_script

    print(completion_script(build_parser(), args.shell))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "optional_module", None):  # a placeholder accepts anything
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.json_out = bool(getattr(args, "json_cmd", False) or args.json_global)
    args.paint = Painter(colour_wanted(args.color, sys.stdout))
    clients: list[Client] = []

    def client_factory() -> Client:
        if not clients:
            address, cfg = resolve(args)
            clients.append(Client(address, cfg))
        return clients[0]

    args.client_factory = client_factory
    try:
        if args.func is None:  # an optional module's placeholder when its name was not on the line
            parser.error(f"{args.command} is not available")
        return int(args.func(args))
    except CtlError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return int(exc.code)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        return int(ExitCode.OK)  # `controllerctl events | head`
    finally:
        for c in clients:
            c.close()


if __name__ == "__main__":
    sys.exit(main())
