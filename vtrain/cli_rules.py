"""The rules every `vtrain` command shares at the command line (Typer only, the cli layer): what a text or path
option accepts (`text`, `path`: never empty), and the one line a user error becomes (`user_error`), with which
cli.py ends a command with exit 2 and the tests check a reader called in-process (tests/helpers/fuzz.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from vtrain.errors import VtrainError
from vtrain.io.guarded import ENVIRONMENT_ERRNOS


def text(value: str) -> str:
    """The value of a text option: never empty or blank (`--out "$OUT"` with OUT unset passes '', which would name
    the current directory, or leave an optional value silently unset). `train`'s options are refused by the same
    rule in the config (config/fields.py `Section._check_text`)."""
    if not value.strip():
        raise typer.BadParameter(f"must not be empty, got {value!r} (an unset shell variable?)")
    return value


def path(value: str) -> Path:
    """A path option's value (`text`'s rule: '' is not the current directory)."""
    return Path(text(value))


def user_error(e: BaseException) -> str | None:
    """The one line `vtrain` prints for `e` when it is a user error, ending the command with exit 2 (Click's exit
    code for its own): a VtrainError from anywhere in the core, Click's usage errors (an unknown option, `--seed
    abc`), or an environment error (a full or read-only disk, a missing permission) at a write that no disk_op
    names (vtrain/io/guarded.py); None for anything else, which stays a traceback (a bug)."""
    if isinstance(e, VtrainError):
        return f"error: {e}"
    if isinstance(e, typer.TyperException):  # Click's own: an unknown option, `--seed abc`
        ctx = getattr(e, "ctx", None)
        hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        return f"error: {' '.join(e.format_message().split())}{hint}"
    if isinstance(e, OSError) and e.errno in ENVIRONMENT_ERRNOS and not isinstance(e, FileNotFoundError):
        return f"error: {e.strerror}: {e.filename or 'a file'} (during `vtrain {' '.join(sys.argv[1:2])}`)"
    return None
