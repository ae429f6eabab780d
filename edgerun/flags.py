"""The command line's one vocabulary, shared by every command and by serve.yaml (docs/cli.md):

- ``--model PATH``: what to run or plan: an HF checkpoint dir, an edgerun bundle dir (experts
  stream from it with ``--quota`` or ``--profile``), a GGUF file or (plan) a bare config.json;
- ``--profile FILE``: the device profile (configs/*.yaml) every configuration is planned against;
- ``--device cpu|cuda``: where torch runs;
- ``--quota N``: expert slots per MoE layer; with ``--profile`` it is checked against the plan.

The old spellings (``--bundle``, ``--checkpoint``, plan's ``--config``, ``--torch-device``,
``--device PROFILE``; serve.yaml's ``bundle``, ``device_profile``, ``torch_device``) still work for
one release and say so on stderr. Exit status everywhere: :data:`EXIT_OK`, :data:`EXIT_NO` (the
command ran and the answer is no: a plan that does not fit, a bundle that fails verification,
a daemon whose engine failed), :data:`EXIT_USAGE` (bad usage or input: the message names it).
Every message a command prints starts ``edgerun COMMAND:``. Imports no torch."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from edgerun.cache.policy import PREFETCH_AHEAD
from edgerun.errors import ConfigError

EXIT_OK, EXIT_NO, EXIT_USAGE = 0, 1, 2
TORCH_DEVICES = ("cpu", "cuda")

# serve.yaml's old keys -> the key that replaces them (one release)
RENAMED_KEYS = {"bundle": "model", "device_profile": "profile", "torch_device": "device"}


def deprecated(prog: str, old: str, new: str) -> None:
    """The one deprecation message: on stderr, naming the replacement."""
    print(
        f"{prog}: warning: {old} is deprecated and goes in the next release; use {new}",
        file=sys.stderr,
        flush=True,
    )


def parse_context(text: str) -> int:
    """A context length: ``4096``, ``32k`` (x1024) or ``1m`` (x1024^2)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmM]?)\s*", str(text))
    if m is None or int(m.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"a context length like 4096 or 32k, got {text!r}")
    return int(m.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[m.group(2).lower()]


def read_pieces(text: str) -> int:
    """Parts a block is read in at once, 1..64 (``--read-pieces``; the reader's own bound)."""
    value = positive_int(text)
    if value > 64:
        raise argparse.ArgumentTypeError(f"at most 64, got {text!r}")
    return value


def prefetch_ahead(text: str) -> int:
    """Streamed layers a decode step's prefetch reads ahead, 1 or 2 (``--prefetch-ahead``)."""
    value = positive_int(text)
    if value not in PREFETCH_AHEAD:
        raise argparse.ArgumentTypeError(f"1 or 2, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """A count of at least 1 (``--prefill-chunk``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1, got {text!r}")
    return value


def octal_mode(text: str) -> int:
    """A file mode in octal, like 0660 (``--socket-mode``)."""
    try:
        value = int(text, 8)
    except ValueError:
        value = -1
    if not 0 <= value <= 0o777:
        raise argparse.ArgumentTypeError(f"an octal file mode like 0660 (0 to 0777), got {text!r}")
    return value


def add_renamed(p: argparse.ArgumentParser, old: str, new: str, dest: str, **kw) -> None:
    """``old``, an earlier spelling of ``new`` (dest ``dest``), kept for one release with a note."""
    p.add_argument(old, dest=dest, action=_Renamed, new=new, **kw)


class _Renamed(argparse.Action):
    """An old spelling: stores into the new flag's dest, and says it is deprecated."""

    def __init__(self, option_strings, dest, new: str, **kw) -> None:
        kw.setdefault("help", argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kw)
        self.new = new

    def __call__(self, parser, ns, value, option_string=None) -> None:
        deprecated(parser.prog, option_string, self.new)
        _store_once(parser, ns, self.dest, self.const if self.nargs == 0 else value, option_string)


def _store_once(parser, ns, dest: str, value, flag: str) -> None:
    given = getattr(ns, "_given", set())
    if dest in given:
        parser.error(f"{flag}: the {dest} is already given (once: its old and new spellings are one flag)")
    ns._given = given | {dest}
    setattr(ns, dest, value)


class _Once(argparse.Action):
    """The new spelling of a flag that also has old ones: given once, in either."""

    def __call__(self, parser, ns, value, option_string=None) -> None:
        _store_once(parser, ns, self.dest, value, option_string)


class _Device(argparse.Action):
    """``--device cpu|cuda``; a path is the old spelling of ``--profile`` (serve and plan took
    the device profile as ``--device``)."""

    def __call__(self, parser, ns, value, option_string=None) -> None:
        if value in TORCH_DEVICES:
            _store_once(parser, ns, "device", value, option_string)
        elif value.endswith((".yaml", ".yml")) or Path(value).is_file():
            deprecated(parser.prog, "--device PROFILE", "--profile PROFILE (--device is cpu or cuda)")
            _store_once(parser, ns, "profile", Path(value), option_string)
        else:
            parser.error(
                f"argument --device: {value!r} is not cpu or cuda (a device profile is --profile FILE)"
            )


def add_model_argument(p: argparse.ArgumentParser, text: str, *old: str) -> None:
    """``--model PATH`` and its old spellings ``old`` (e.g. ``--bundle``)."""
    p.add_argument("--model", type=Path, default=None, action=_Once, metavar="PATH", help=text)
    for flag in old:
        p.add_argument(flag, type=Path, dest="model", action=_Renamed, new="--model", metavar="PATH")


def add_device_arguments(
    p: argparse.ArgumentParser, profile_help: str, device: bool = True, required: bool = False
) -> None:
    """``--profile FILE`` and (unless ``device`` is False) ``--device cpu|cuda``, with the old
    ``--torch-device``; ``--device PROFILE`` is read as the old spelling of ``--profile``."""
    p.add_argument("--profile", type=Path, default=None, action=_Once, metavar="PROFILE", help=profile_help)
    p.add_argument(
        "--device",
        default=None,
        action=_Device,
        metavar="{cpu,cuda}",
        help="where torch runs (default: cuda if available, else cpu)" if device else argparse.SUPPRESS,
    )
    if device:
        p.add_argument(
            "--torch-device", choices=TORCH_DEVICES, dest="device", action=_Renamed, new="--device"
        )
    p.set_defaults(_device_allowed=device, _profile_required=required)


def check_device_arguments(ns: argparse.Namespace) -> None:
    """What the parser could not check alone: a required profile given (in either spelling), and
    ``--device cpu|cuda`` only where torch runs."""
    if getattr(ns, "_profile_required", False) and ns.profile is None:
        raise ConfigError("--profile PROFILE is required: a device profile YAML (configs/*.yaml)")
    if not getattr(ns, "_device_allowed", True) and ns.device is not None:
        raise ConfigError(
            f"--device {ns.device}: this command runs no model; give a device profile as --profile"
        )


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        metavar="METHOD",
        default=None,
        help="speculative decoding: 'mtp' drafts with the model's own MTP head (CPU and CUDA; default off)",
    )
    p.add_argument(
        "--draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="--speculative: tokens drafted a step, 1..4 (default 1)",
    )
    p.add_argument(
        "--speculative-sampled",
        choices=["plain", "verify"],
        default=None,
        help="--speculative: sampled requests decode plainly (default; their draws on the GPU), or are "
        "drafted and verified with the rejection test on the host",
    )


def speculative_config(ns: argparse.Namespace):
    """The :class:`edgerun.config.SpeculativeConfig` the flags of :func:`add_speculative_arguments`
    ask for, or None (off); a bad value or --draft-tokens alone is a ConfigError naming it."""
    from edgerun.config import SpeculativeConfig

    sampled = getattr(ns, "speculative_sampled", None)
    if ns.speculative is None:
        if ns.draft_tokens is not None:
            raise ConfigError("--draft-tokens needs --speculative mtp")
        if sampled is not None:
            raise ConfigError("--speculative-sampled needs --speculative mtp")
        return None
    return SpeculativeConfig(
        ns.speculative, 1 if ns.draft_tokens is None else ns.draft_tokens, sampled or "plain"
    )
