"""Error types. Every message names the thing that was wrong (tensor, file, key)."""


class EdgerunError(Exception):
    """Base class: a user-facing error with a complete message."""


class DaemonUnavailable(EdgerunError):
    """A client got no answer from the daemon: none at the socket, or it closed the connection or
    a stream before finishing. Not the user's input, so the command exits 1, not 2."""

    exit_status = 1


class ConfigError(EdgerunError, ValueError):
    """A configuration file or key is missing, unknown or has an impossible value."""


class DeviceUnavailable(ConfigError):
    """The device asked for is not there (no CUDA device): possibly not yet, at boot, before its
    driver is ready, so a daemon exits 1 (restarted), not 2 (a configuration error)."""

    exit_status = 1


class CheckpointError(EdgerunError, ValueError):
    """A checkpoint directory or tensor does not match what the architecture expects."""


class StorageError(EdgerunError, OSError):
    """Bytes the engine needs could not be read intact from storage: a short read, an I/O error,
    a missing file, or a block that fails its checksum on a read and a re-read. The daemon stops
    serving (docs/serving.md: storage faults)."""


class ChecksumError(StorageError):
    """A block whose bytes are not the ones its manifest checksum describes."""
