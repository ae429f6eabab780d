"""Architecture providers: who may supply the model class for an HF ``model_type``.

A provider is an installed distribution that declares, in its metadata only:

- ``edgerun.models`` entry points: ``<model_type> = <module import string>``;
- one ``edgerun.provider_api`` entry point whose *name* is the provider API level it implements;
- optionally ``Requires-Dist: edgerun <range>``: the edgerun versions it was written for.

Discovery reads that metadata and imports nothing. Which provider serves a ``model_type`` is a
pure function of the installed metadata and a :class:`ProviderPolicy` the user gave (nothing
is registered at run time), so every process resolves the same way given the same policy.
Installing a package is not consent to run it: an external provider is selected only when the
policy allows it by distribution name. See docs/providers.md.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from edgerun import __version__
from edgerun.errors import ConfigError

MODELS_GROUP = "edgerun.models"
API_GROUP = "edgerun.provider_api"
API_LEVELS = (1,)  # provider API levels this edgerun implements
BUILTIN_NAME = "builtin"


class ProviderError(ConfigError):
    """An architecture provider was refused (trust, ambiguity, compatibility or interface)."""


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``Foo_Bar`` == ``foo-bar``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class Provider:
    """One source of architectures, as its metadata declares it (nothing imported)."""

    name: str  # distribution name as published, or "builtin"
    version: str
    models: Mapping[str, str]  # model_type -> module import string
    api: tuple[str, ...]  # names of its edgerun.provider_api entry points
    requires_edgerun: str | None = None  # version specifier from Requires-Dist, None: undeclared
    builtin: bool = False

    @property
    def key(self) -> str:
        return BUILTIN_NAME if self.builtin else normalize(self.name)

    def describe(self) -> str:
        api = "/".join(self.api) or "none"
        if self.builtin:
            return f"edgerun {self.version} (built-in, provider API {api})"
        return f"{self.name} {self.version} (provider API {api})"


@dataclass(frozen=True)
class Resolution:
    """Which provider's module implements ``model_type``: the provenance of an architecture."""

    model_type: str
    module: str
    provider: Provider

    def describe(self) -> str:
        return f"architecture {self.model_type} from {self.provider.describe()}"

    def as_dict(self) -> dict[str, Any]:
        """For ``/v1/models`` and JSON logs."""
        p = self.provider
        return {
            "model_type": self.model_type,
            "module": self.module,
            "provider": p.key,
            "distribution": None if p.builtin else p.name,
            "version": p.version,
            "api": int(p.api[0]),  # a Resolution's provider passed check_compatible
            "builtin": p.builtin,
        }


@dataclass(frozen=True)
class ProviderPolicy:
    """The user's decisions; provider names are distribution names (compared PEP 503-normalized).

    ``allow``: external providers that may run. ``choose``: model_type -> provider name (or
    ``builtin``) where several could serve it. ``allow_override``: external providers that may
    replace a built-in architecture (they must also be allowed)."""

    allow: frozenset[str] = frozenset()
    choose: Mapping[str, str] = field(default_factory=dict)
    allow_override: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "allow", frozenset(normalize(n) for n in self.allow))
        object.__setattr__(self, "allow_override", frozenset(normalize(n) for n in self.allow_override))
        object.__setattr__(self, "choose", {t: normalize(n) for t, n in dict(self.choose).items()})
        if BUILTIN_NAME in self.allow | self.allow_override:
            # built-ins always run; a distribution that calls itself "builtin" must not ride on that
            raise ConfigError(
                f"{BUILTIN_NAME!r} is not a provider to allow: built-in architectures always run"
            )

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ProviderPolicy:
        """From the options :func:`add_provider_arguments` added."""
        return cls(
            allow=frozenset(ns.allow_provider or ()),
            choose=dict(ns.provider or ()),
            allow_override=frozenset(ns.allow_override or ()),
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None, source: str = "providers") -> ProviderPolicy:
        """From a config section ``{allow: [...], choose: {model_type: name}, allow_override: [...]}``."""
        data = data or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"{source}: must be a mapping with keys allow, choose, allow_override")
        unknown = sorted(set(data) - {"allow", "choose", "allow_override"})
        if unknown:
            raise ConfigError(f"{source}: unknown key {unknown[0]!r} (known: allow, choose, allow_override)")
        names = {}
        for key in ("allow", "allow_override"):
            value = data.get(key) or []
            if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
                raise ConfigError(f"{source}.{key}: must be a list of distribution names, got {value!r}")
            names[key] = frozenset(value)
        choose = data.get("choose") or {}
        if not isinstance(choose, Mapping) or not all(isinstance(v, str) for v in choose.values()):
            raise ConfigError(f"{source}.choose: must map model_type to a provider name, got {choose!r}")
        return cls(names["allow"], dict(choose), names["allow_override"])

    def to_argv(self) -> list[str]:
        """The same policy as command-line options, for a process this one starts."""
        argv = [a for n in sorted(self.allow) for a in ("--allow-provider", n)]
        argv += [a for t, n in sorted(self.choose.items()) for a in ("--provider", f"{t}={n}")]
        return argv + [a for n in sorted(self.allow_override) for a in ("--allow-override", n)]


def _choice(text: str) -> tuple[str, str]:
    model_type, sep, name = text.partition("=")
    if not sep or not model_type.strip() or not name.strip():
        raise argparse.ArgumentTypeError(f"expected MODEL_TYPE=NAME, got {text!r}")
    return model_type.strip(), name.strip()


def add_provider_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("architecture providers (see docs/providers.md)")
    g.add_argument(
        "--allow-provider",
        action="append",
        metavar="NAME",
        help="let the installed distribution NAME supply architectures (repeatable)",
    )
    g.add_argument(
        "--provider",
        action="append",
        type=_choice,
        metavar="MODEL_TYPE=NAME",
        help="use provider NAME (or 'builtin') for MODEL_TYPE when several could (repeatable)",
    )
    g.add_argument(
        "--allow-override",
        action="append",
        metavar="NAME",
        help="let provider NAME replace a built-in architecture (repeatable)",
    )


# ---- discovery (metadata only) ------------------------------------------------------------

_REQUIREMENT = re.compile(
    r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^;()]*)\)?\s*(?:;(.*))?$"
)


def edgerun_requirement(requires: Iterable[str]) -> str | None:
    """The version specifier of an unconditional ``edgerun`` requirement (``""``: any version)."""
    specs = []
    for req in requires:
        m = _REQUIREMENT.match(req)
        if m and normalize(m.group(1)) == "edgerun" and "extra" not in (m.group(3) or ""):
            specs.append(m.group(2).strip())
    return None if not specs else ",".join(s for s in specs if s)


def discover(path: list[str] | None = None) -> tuple[Provider, ...]:
    """Every distribution on ``path`` (default ``sys.path``) declaring ``edgerun.models`` entry
    points, first one of each name (as import would find it). Reads metadata files only."""
    found: dict[str, Provider] = {}
    dists = (
        importlib.metadata.distributions() if path is None else importlib.metadata.distributions(path=path)
    )
    for dist in dists:
        eps = dist.entry_points
        models = {ep.name: ep.value for ep in eps if ep.group == MODELS_GROUP}
        name = dist.metadata["Name"]
        if not models or not name or normalize(name) in found:
            continue
        api = tuple(sorted(ep.name for ep in eps if ep.group == API_GROUP))
        found[normalize(name)] = Provider(
            name, dist.version, models, api, edgerun_requirement(dist.requires or ())
        )
    return tuple(found.values())


# ---- version specifiers (release segments of PEP 440: enough for ``>=0.1,<0.2``) ------------

_CLAUSE = re.compile(r"^(~=|==|!=|<=|>=|<|>)\s*(\d+(?:\.\d+)*)(\.\*)?$")


def _release(version: str) -> tuple[int, ...]:
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"cannot read version {version!r}")
    return tuple(int(x) for x in m.group(1).split("."))


def version_matches(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies every comma-separated clause of ``spec``. Clauses compare
    release segments only (``0.1`` == ``0.1.0``); anything else is a ValueError naming it."""
    have = _release(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = _CLAUSE.match(clause)
        op, number, star = m.groups() if m else ("", "", None)
        if not op or (star and op not in ("==", "!=")) or (op == "~=" and "." not in number):
            raise ValueError(f"cannot read version clause {clause!r}")
        want = _release(number)
        n = max(len(have), len(want))
        a, b = have + (0,) * (n - len(have)), want + (0,) * (n - len(want))
        if star:
            ok = (a[: len(want)] == want) == (op == "==")
        elif op == "~=":
            ok = a >= b and a[: len(want) - 1] == want[:-1]
        else:
            ok = {"==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]
        if not ok:
            return False
    return True


# ---- resolution: (installed metadata, policy) -> Resolution, or a refusal -------------------


def _names(providers: Iterable[Provider]) -> str:
    return ", ".join(p.describe() for p in providers)


def check_compatible(p: Provider, edgerun_version: str = __version__) -> None:
    """Refuse a provider whose declared API level or edgerun range does not fit this edgerun."""
    supported = "/".join(map(str, API_LEVELS))
    if len(p.api) != 1 or not p.api[0].isdigit():
        declared = ", ".join(repr(a) for a in p.api) or "none"
        raise ProviderError(
            f"provider {p.name} {p.version} must declare exactly one provider API level as an "
            f"'{API_GROUP}' entry point name (declared: {declared}); edgerun {edgerun_version} "
            f"implements API {supported}"
        )
    if int(p.api[0]) not in API_LEVELS:
        raise ProviderError(
            f"provider {p.name} {p.version} implements provider API {p.api[0]}, but edgerun "
            f"{edgerun_version} implements API {supported}: install a version of {p.name} for "
            f"API {supported}"
        )
    if p.requires_edgerun:
        try:
            ok = version_matches(edgerun_version, p.requires_edgerun)
        except ValueError as exc:
            raise ProviderError(
                f"provider {p.name} {p.version}: Requires-Dist edgerun {p.requires_edgerun!r}: {exc}"
            ) from exc
        if not ok:
            raise ProviderError(
                f"provider {p.name} {p.version} requires edgerun{p.requires_edgerun} but this is edgerun "
                f"{edgerun_version}: install a version of {p.name} built for it"
            )


def _not_allowed(model_type: str, candidates: list[Provider]) -> ProviderError:
    flags = " ".join(f"--allow-provider {p.name}" for p in candidates)
    return ProviderError(
        f"model_type {model_type!r} is provided by {_names(candidates)}, which is not allowed to run: "
        f"pass {flags} (or list it under providers.allow in the serve config) if you trust it"
    )


def _ambiguous(model_type: str, candidates: list[Provider]) -> ProviderError:
    options = " or ".join(f"--provider {model_type}={p.key}" for p in candidates)
    return ProviderError(
        f"model_type {model_type!r} is provided by {len(candidates)} providers ({_names(candidates)}): "
        f"choose one with {options} (or providers.choose in the serve config)"
    )


def _override(model_type: str, p: Provider) -> ProviderError:
    return ProviderError(
        f"provider {p.describe()} declares model_type {model_type!r}, which is a built-in architecture: "
        f"replacing it needs --allow-override {p.name} (or providers.allow_override); to keep the built-in "
        f"one, pass --provider {model_type}={BUILTIN_NAME}"
    )


def select(
    model_type: str,
    builtin: Provider,
    installed: Iterable[Provider],
    policy: ProviderPolicy | None = None,
    source: str = "config.json",
) -> Resolution:
    """The provider that serves ``model_type`` under ``policy``, or a :class:`ProviderError` that
    says why none may. External providers that are not allowed are never selected, so an installed
    package can neither run nor deny the built-in architecture unless the policy lets it."""
    policy = policy or ProviderPolicy()
    installed = tuple(installed)
    native = model_type in builtin.models
    external = [p for p in installed if model_type in p.models and not p.builtin]
    choice = policy.choose.get(model_type)

    if choice == BUILTIN_NAME:
        if not native:
            raise ProviderError(
                f"--provider {model_type}={BUILTIN_NAME}: there is no built-in {model_type!r}"
            )
        return Resolution(model_type, builtin.models[model_type], builtin)
    if choice is not None:
        picked = [p for p in external if p.key == choice]
        if not picked:
            have = ", ".join([BUILTIN_NAME] * native + [p.key for p in external]) or "none"
            raise ProviderError(
                f"--provider {model_type}={choice}: no installed provider named {choice!r} declares "
                f"{model_type!r} (providers of it: {have})"
            )
        candidates = picked
    else:
        candidates = external
    allowed = [p for p in candidates if p.key in policy.allow]

    if not allowed:
        if native and choice is None:
            return Resolution(model_type, builtin.models[model_type], builtin)
        if not candidates:
            known = sorted(set(builtin.models) | {t for p in installed for t in p.models})
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported (supported: {', '.join(known)})"
            )
        raise _not_allowed(model_type, candidates)
    if native:
        refused = [p for p in allowed if p.key not in policy.allow_override]
        if refused:
            raise _override(model_type, refused[0])
    if len(allowed) > 1:
        raise _ambiguous(model_type, allowed + [builtin] * native)
    chosen = allowed[0]
    check_compatible(chosen)
    module = chosen.models[model_type]
    if ":" in module or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", module.strip()):
        raise ProviderError(
            f"provider {chosen.describe()}: entry point {model_type} = {module!r} must be a module import string"
        )
    return Resolution(model_type, module.strip(), chosen)
