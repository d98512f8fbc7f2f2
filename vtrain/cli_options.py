"""Every command's options from fields (Typer only, the cli layer): `vtrain train`'s from the config sections
(config/fields.py), each other command's from its own dataclass (config/estimate.py) whose shared options are train's
fields themselves, or one by one (`shared`) in a hand-written signature. One field gives the flag, the type, the
help and the choices: a `Literal` field is a choice wherever it appears, refused by Click when the field says so
(`CLI_CHOICE`, and every command's own choices) and otherwise by the field's section check, as for `train`."""

from __future__ import annotations

import inspect
import typing
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from vtrain.cli_rules import path, text
from vtrain.config import Option, options
from vtrain.config.fields import choices, options_of


def choice(name: str, values: tuple[Any, ...]) -> type[Enum]:
    """A choice as Typer takes one (an Enum of strings): Click refuses any other value in its own line."""
    return Enum(name, {str(v): str(v) for v in values}, type=str)  # type: ignore[return-value]


def _train_option(key: str) -> Option:
    return next(o for o in options() if o.key == key)


def parameter(o: Option, help: str | None = None, default: Any = None, own: bool = False,
              name: str | None = None, empty_rule: bool = False) -> inspect.Parameter:
    """One option from its field: the flag, the field's docstring as help (or `help`), a Click choice or the listed
    values, a path parsed by the empty-value rule; default None (an unset flag leaves the value below it: a --config
    file's, the run's) unless the field's own default is shown. `own`: a command's own field, not a config
    section's (its choice is Click's, its text refused empty by `cli_rules.text`: no section check follows);
    `empty_rule`: a train field on another command, whose text is refused empty as that command's own are (a list,
    `--grad-ckpt ''`, may be empty: no items)."""
    is_choice = o.cli_choice or own
    is_path = Path in typing.get_args(o.hint) or o.hint is Path
    is_list = list in (typing.get_origin(o.hint), *map(typing.get_origin, typing.get_args(o.hint)))
    kind: Any = Path if is_path else (choice(o.name.title(), o.choices) if is_choice and o.choices else o.value_type)
    metavar = f"<{'|'.join(o.choices)}>" if o.choices and not is_choice else None
    option = typer.Option(*([o.flag] if o.flag else []), help=(help or o.help).replace("[", r"\["), metavar=metavar,
                          show_default=default is not None and default is not False,
                          parser=path if is_path else (text if (own or empty_rule) and kind is str and not is_list else None))
    return inspect.Parameter(name or o.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind if default is not None else Optional[kind], option])


def shared(key: str, help: str | None = None) -> Any:
    """The annotation of a hand-written parameter that is train's option `key` (`train.batch_size`): its flag, type
    and choices from the field; `help` where the command's meaning differs (its default is the run's)."""
    return parameter(_train_option(key), help, empty_rule=True).annotation


def plain(value: Any, hint: Any) -> Any:
    """A value as the command line passed it (an Enum member for a choice) as its field holds it (`3`, not `'3'`)."""
    if not isinstance(value, Enum):
        return value
    allowed = {str(v): v for v in choices(hint) or ()}
    return allowed.get(value.value, value.value)


def command_of(cls: type) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator: `fn(opts)` becomes a command with one option per field of dataclass `cls` (a field made by
    config.estimate.shared is train's option; the others are the command's own, a Literal one a Click choice), and
    is called with `cls(**values)`."""
    own = {o.name: o for o in options_of(cls, None)}
    hints = typing.get_type_hints(cls)
    params = []
    for f in cls.__dataclass_fields__.values():  # type: ignore[attr-defined]
        if "same" in f.metadata:
            o = _train_option(f.metadata["same"])
            hints[f.name] = o.hint
            params.append(parameter(o, f.metadata.get("help"), name=f.name, empty_rule=True))
        else:
            params.append(parameter(own[f.name], default=own[f.name].default, own=True))

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def command(**values: Any) -> Any:
            return fn(cls(**{k: plain(v, hints[k]) for k, v in values.items()}))

        command.__name__, command.__doc__ = fn.__name__, fn.__doc__
        command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        return command

    return wrap
