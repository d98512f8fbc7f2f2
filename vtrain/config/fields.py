"""How a config field becomes an option: its flag, its help, its choices, and how an error names it.

Each option of `vtrain train` is declared once, as a field of a section dataclass (model.py, data.py, optim.py,
parallel.py, train.py): its type (a `Literal[...]` for a choice), its default, and the attribute docstring under it,
which is the option's help. The flag is the field name with dashes, unless the field's metadata names another
(`field(default="debug", metadata={"flag": "--model"})`) or none (`metadata=NO_FLAG`: a key of a --config file only).
The command line (cli.py), the option reference (docs/options.md) and every error message derive from these fields.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
import typing
from dataclasses import MISSING, Field, dataclass, fields
from functools import cache
from typing import Any, ClassVar, Literal

from vtrain.errors import ConfigError

NO_FLAG = {"flag": None}
"""Field metadata of a key that only a --config file sets (its errors name `section.key`, never a flag)."""
METRIC_ONLY = {"task": "metric"}
"""Field metadata of an option of face recognition only (`--task metric`): a DINO run's config.yaml leaves it out, and
a DINO run given another value than its default is refused (config/run.py)."""
DINO_ONLY = {"task": "dino"}
"""Field metadata of an option of detection only (`--task dino`), likewise."""
CLI_CHOICE = {"cli_choice": True}
"""Field metadata of a choice the command line itself refuses (Click's message, as every command's --task and
--mixed-precision); the other choices are refused by the section's checks, with the config key in the message."""


def flag(f: Field) -> str | None:
    """The `vtrain train` flag of a field: its metadata's `flag`, else the field name with dashes; None: none."""
    return f.metadata["flag"] if "flag" in f.metadata else "--" + f.name.replace("_", "-")


def where(cls: type, name: str) -> str:
    """How an error names field `name` of `cls`: `--lr (optim.lr)`, `optim.betas` for a key without a flag, or the
    flag alone for a field outside the sections (`--task`)."""
    f = next(f for f in fields(cls) if f.name == name)
    section = getattr(cls, "SECTION", None)
    key = f"{section}.{name}" if section else None
    opt = flag(f)
    if opt is None:
        return key or name
    return f"{opt} ({key})" if key else opt


def fail(cls: type, name: str, msg: str) -> typing.NoReturn:
    raise ConfigError(f"{where(cls, name)}: {msg}")


def check_value(cls: type, name: str, value: Any) -> None:
    """`value` of field `name` checked by its section's own rule (the section built with it, its other fields at
    their defaults): how another command refuses a value it shares with `vtrain train` (`eval --batch-size 0`),
    in the words of train's error (`--batch-size (train.batch_size): ...`)."""
    if value is not None:
        cls(**{name: value})


class Section:
    """A config section: pure values, checked in `__post_init__` with `_check` (no file is opened: paths.py)."""

    SECTION: ClassVar[str]

    def _check(self, cond: bool, name: str, msg: str) -> None:
        """Raise a ConfigError naming field `name` of this section and its flag (`--lr (optim.lr): ...`)."""
        if not cond:
            fail(type(self), name, msg)

    def _check_text(self) -> None:
        """No text value of the section is empty (or blank): `--output-dir "$OUT"` with OUT unset passes '', which a
        path would take for the current directory, and an optional value ('' for --pretrained or --resume) would be
        silently ignored. Each section's checks start with this one (a list or a number is not text)."""
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            # a list field given as one string (`--val-targets ''`, `--grad-ckpt ''`) may be empty: no items
            if isinstance(value, str) and not value.strip() and not str(f.type).startswith("list"):
                fail(type(self), f.name, f"must not be empty, got {value!r} (an unset shell variable?); leave the "
                     "option out for its default")


def choices(hint: Any) -> tuple[str, ...] | None:
    """The values of a `Literal[...]` type (also inside `X | None`), else None."""
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return choices(args[0]) if len(args) == 1 and typing.get_origin(hint) is not list else None


@cache
def attribute_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field), whitespace made single."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for stmt, nxt in zip(body, body[1:]):
        if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclass(frozen=True)
class Option:
    """One config field as an option: what the command line and docs/options.md show."""

    section: str | None
    """`model`, `data`, `optim`, `parallel`, `train`; None for `task`."""
    name: str
    flag: str | None
    """None: a --config key only."""
    hint: Any
    """The field's type (typing object)."""
    default: Any
    help: str
    cli_choice: bool

    @property
    def key(self) -> str:
        return f"{self.section}.{self.name}" if self.section else self.name

    @property
    def choices(self) -> tuple[str, ...] | None:
        return choices(self.hint)

    @property
    def value_type(self) -> type:
        """What the command line parses: bool, int, float or str (a list is a comma string, a choice a string)."""
        hint = self.hint
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
            hint = args[0]
        return hint if hint in (bool, int, float) else str


def options_of(cls: type, section: str | None) -> list[Option]:
    """The fields of `cls` as Options, in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = attribute_docs(cls)
    out = []
    for f in fields(cls):
        if f.default is not MISSING:
            default = f.default
        elif f.default_factory is not MISSING:
            default = f.default_factory()
        else:
            default = None
        out.append(Option(section, f.name, flag(f), hints[f.name], default, docs.get(f.name, ""),
                          bool(f.metadata.get("cli_choice"))))
    return out
