"""Command-line entry point: `hybridmoe <command> ...`. Dispatch only; each command is its own module."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under hybridmoe.commands; imported lazily so `inspect` never pays for torch.
COMMANDS = ["serve", "generate", "inspect", "synth", "plan", "replicas"]
# Commands that take llama-server's command lines: its flags that mean nothing here are set aside
# and warned about instead of failing the command (commands/llama_flags.py).
LLAMA_COMPATIBLE = {"serve"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="hybridmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name in COMMANDS:
        if wanted is not None and name != wanted:
            sub.add_parser(name)  # keep --help listing complete without importing every module
            continue
        try:
            mod = importlib.import_module(f"hybridmoe.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"hybridmoe.commands.{name}":
                raise
            sub.add_parser(name, help="(not available in this build)")
            continue
        mod.add_parser(sub)
    if wanted in LLAMA_COMPATIBLE:
        from hybridmoe.commands.llama_flags import parse_llama_command_line

        args = parse_llama_command_line(parser, argv)
    else:
        args = parser.parse_args(argv)
    mod = importlib.import_module(f"hybridmoe.commands.{args.command}")
    try:
        return int(mod.run(args) or 0)
    except (ValueError, OSError) as e:
        # Bad files (GGUFError), bad placement (PlacementError) and bad arguments are ValueErrors:
        # the user gets one line naming the problem, not a traceback.
        print(f"hybridmoe {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
