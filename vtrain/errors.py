"""User-facing errors: the CLI turns these into one line on stderr and a non-zero exit, never a traceback."""

import re

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
