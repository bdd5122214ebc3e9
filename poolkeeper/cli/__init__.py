"""``poolctl``: the operator's command line.

Every failure is one line on stderr and the exit code its error class carries
(``core.errors``, ``exit_code``; the table in ``EPILOG``, docs/operate.md and
docs/design.md section 6), never a traceback unless
``POOLCTL_DEBUG=1``. Only ``init`` creates a database.

Importing this package loads nothing but the standard library: ``poolctl --version`` is
answered before typer is imported, and each command imports what it needs when it runs
(tests/cli/test_cli_start.py; ``bench/cli_start.py`` times it).
"""

from __future__ import annotations

import os
import sys

from poolkeeper import __version__

__all__ = ["main"]


def main() -> None:
    """Entry point: every failure is one line on stderr and the exit code its class carries."""
    if sys.argv[1:] == ["--version"]:
        print(f"poolctl {__version__}")
        sys.exit(0)
    import typer

    # Importing the group modules registers their commands on ``app``.
    from poolkeeper.cli import board_cmds, render, store_cmds, wire_cmds  # noqa: F401
    from poolkeeper.cli.base import _fail, app

    render.flags_without_types()
    try:
        _require_utf8(sys.argv[1:])
        code = app(prog_name="poolctl", standalone_mode=False)
    except typer.TyperException as e:  # a usage error: one line, not click's framed panel
        # typer itself recognises this one by name; its help is already printed
        if type(e).__name__ != "NoArgsIsHelpError":
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _fail(f"{e.format_message()}{hint}", e.exit_code)
        code = e.exit_code
    except Exception as e:
        code, message = _exit_code(e)
        _fail(message, code)
    sys.exit(code if isinstance(code, int) else 0)


def _exit_code(err: Exception) -> tuple[int, str]:
    import traceback

    from core.errors import exit_code

    if os.environ.get("POOLCTL_DEBUG"):
        traceback.print_exc()
    if (ours := exit_code(err)) is not None:
        return ours
    return 1, f"internal error: {type(err).__name__}: {err} (run with POOLCTL_DEBUG=1 for the traceback)"


def _require_utf8(args: list[str]) -> None:
    """Arguments the databases can hold: a non-UTF-8 byte arrives as a lone surrogate."""
    from core import validate
    from core.errors import InvalidInput

    for i, arg in enumerate(args):
        try:
            validate.text("argument", arg)
        except InvalidInput as err:
            if arg.startswith("--") and "=" in arg:
                name = arg.split("=", 1)[0]
            elif i and args[i - 1].startswith("-"):
                name = f"the value of {args[i - 1]}"
            else:
                name = f"argument {i + 1}"
            raise InvalidInput(name, f"{err.problem}: {arg!a}") from None
