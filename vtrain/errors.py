"""User-facing errors: the CLI turns these into one line on stderr and a non-zero exit, never a traceback."""

import re
import reprlib

# torch's DataLoader re-raises a worker's exception in the main process as
# `type(e)("Caught X in DataLoader worker process N.\nOriginal Traceback (most recent call last): ...")`
_WORKER = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\nOriginal Traceback", re.S)


class VtrainError(Exception):
    """A problem the user can fix (bad flag, missing file, incompatible options)."""

    def __init__(self, message: object = "") -> None:
        text = str(message)
        if _WORKER.match(text):  # keep the worker's own one-line message, not the traceback around it
            last = [line for line in text.strip().splitlines() if line.strip()][-1]
            text = re.sub(r"^[\w.]*(Error|Sample)[\w]*: ", "", last.strip())
        super().__init__(text)


class ConfigError(VtrainError):
    """An invalid configuration value; the message names the option to change."""


class BadSample(VtrainError):
    """A data file that cannot be read (empty, truncated, not an image); names the file."""


# ---- values shown in an error message ---------------------------------------------------------------------------
# A value read from a file can be anything the file's format allows: a YAML alias "bomb" whose expanded repr is
# gigabytes (a few shared lists, referenced a billion times), a list nested 900 levels deep (repr recurses), an
# integer of 10,000 digits (its repr is refused by Python's int-to-str limit). `reprlib` (standard library) bounds
# the work: at most a few items per container and a few levels; the text is then cut to `limit` characters.
_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4


def shown(value: object, limit: int = 80) -> str:
    """`value` as short text for an error message: its repr, bounded in work and length (never the whole of an
    unbounded value)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    try:
        text = _REPR.repr(value)
    except Exception:  # an int beyond the int-to-str limit inside a container, a repr that fails
        text = f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
