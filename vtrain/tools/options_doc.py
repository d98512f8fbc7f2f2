"""docs/options.md, the reference of `vtrain train`'s options and --config keys, generated from the config fields
(config/fields.py): `python -m vtrain.tools.options_doc > docs/options.md`. tests/core/test_options.py checks that the
file is current."""

from __future__ import annotations

import json
import sys
import typing

from vtrain.config import TASK_DEFAULTS, Option, options

HEADER = """# Options of `vtrain train`

Generated from the config dataclasses (`vtrain/config/`) by `python -m vtrain.tools.options_doc > docs/options.md`;
do not edit by hand (tests/core/test_options.py checks it). `vtrain train --help` shows the same text.

Every option is also a key of a `--config FILE.yaml` file, under its section (`model`, `data`, `optim`, `parallel`,
`train`; `task` at the top): flags override the file, the file overrides the task's defaults, which override the
defaults below. A run writes its resolved config to `<output-dir>/config.yaml`, which `--config` takes back as it
is. Keys marked "config file only" have no flag. Errors name both: `--lr (optim.lr): must be > 0, got 0.0`.
"""


def _type(o: Option) -> str:
    if o.choices:
        return " \\| ".join(f"`{c}`" for c in o.choices)
    hint = o.hint
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (list, tuple) or (args and typing.get_origin(args[0]) is list):
        return "list" + (" (comma-separated as a flag)" if o.flag else "")
    if o.value_type is bool:
        return "flag" if o.flag else "true or false"
    return {int: "integer", float: "number"}.get(o.value_type, "text")


def _value(value: object) -> str:
    return f"`{value}`" if isinstance(value, str) else f"`{json.dumps(value)}`"


def _default(o: Option) -> str:
    text = "unset" if o.default is None else "none" if o.default == [] else _value(o.default)
    per_task = [f"{task}: {_value(values[o.section][o.name])}" for task, values in TASK_DEFAULTS.items()
                if o.section in values and values[o.section].get(o.name, o.default) != o.default]
    return text + (f" ({', '.join(per_task)})" if per_task else "")


def _row(o: Option) -> str:
    flag = f"`{o.flag}`" if o.flag else "config file only"
    return f"| {flag} | `{o.key}` | {_type(o)} | {_default(o)} | {o.help.replace('|', chr(92) + '|')} |"


def render() -> str:
    """The whole page."""
    lines = [HEADER]
    section = "?"
    for o in options():
        if o.section != section:
            section = o.section
            lines += ["", f"## {section or 'task'}", "", "| flag | config key | type | default | meaning |",
                      "|---|---|---|---|---|"]
        lines.append(_row(o))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
