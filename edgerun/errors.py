"""Error types. Every message names the thing that was wrong (tensor, file, key)."""


class EdgerunError(Exception):
    """Base class: a user-facing error with a complete message."""


class ConfigError(EdgerunError, ValueError):
    """A configuration file or key is missing, unknown or has an impossible value."""


class CheckpointError(EdgerunError, ValueError):
    """A checkpoint directory or tensor does not match what the architecture expects."""
