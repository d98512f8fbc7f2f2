"""User-facing errors: the CLI turns these into one line on stderr and a non-zero exit, never a traceback."""


class VtrainError(Exception):
    """A problem the user can fix (bad flag, missing file, incompatible options)."""


class ConfigError(VtrainError):
    """An invalid configuration value; the message names the option to change."""
