"""Architecture providers: discovery from metadata only, the allowlist, and every refusal.

The example provider (tests/providers/edgerun_example_provider) is installed for real with
``pip install --target`` into a temp dir; the refusal cases use hand-written dist-info
directories whose modules raise on import, which proves each refusal happens before any
provider code runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.bundle.reader import Bundle, load_bundle_model
from edgerun.cli import build_parser
from edgerun.cli import main as edgerun_main
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.errors import ConfigError
from edgerun.models.providers import (
    Provider,
    ProviderError,
    ProviderPolicy,
    discover,
    edgerun_requirement,
    select,
    version_matches,
)
from edgerun.models.registry import BUILTIN_PROVIDER, import_architecture, load_args, resolve_config

EXAMPLE_SRC = Path(__file__).parent / "edgerun_example_provider"
CPU_PROFILE = str(Path(__file__).parents[2] / "configs" / "cpu.yaml")
EXAMPLE = "edgerun-example-provider"
ALLOW_EXAMPLE = ProviderPolicy(allow=frozenset({EXAMPLE}))
PROVIDER_MODULES = ("edgerun_example_provider", "boom_arch", "partial_arch")
# example_moe's config vocabulary (tests/providers/edgerun_example_provider/.../arch.py KEYS, reversed)
EXAMPLE_KEYS = {
    "vocab_size": "n_vocab",
    "num_hidden_layers": "n_layer",
    "hidden_size": "d_model",
    "num_attention_heads": "n_head",
    "num_key_value_heads": "n_kv_head",
    "head_dim": "d_head",
    "intermediate_size": "d_ff",
    "mlp_only_layers": "dense_layers",
    "num_experts": "n_expert",
    "num_experts_per_tok": "n_expert_active",
    "moe_intermediate_size": "d_expert",
    "max_position_embeddings": "n_ctx",
}


@pytest.fixture(scope="session")
def example_site(tmp_path_factory) -> Path:
    """The example provider, built and installed by pip (setuptools, offline) into a temp dir."""
    tmp = tmp_path_factory.mktemp("example_provider")
    src = shutil.copytree(EXAMPLE_SRC, tmp / "src")  # a build writes build/ and *.egg-info in-tree
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(tmp / "site"), str(src)],
        check=True,
    )  # fmt: skip
    return tmp / "site"


@pytest.fixture(scope="session")
def example_ckpt(hf_checkpoints, tmp_path_factory) -> Path:
    """The tiny qwen3_moe checkpoint's weights under an example_moe config."""
    src = hf_checkpoints["qwen3_moe"][1]
    out = tmp_path_factory.mktemp("example_moe") / "ckpt"
    shutil.copytree(src, out)
    cfg = json.loads((src / "config.json").read_text())
    cfg = {EXAMPLE_KEYS.get(k, k): v for k, v in cfg.items()}
    cfg["model_type"] = "example_moe"
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture
def forget_provider_modules():
    """Providers imported by a test are dropped again, so 'not imported' checks stay meaningful."""
    yield
    for name in [m for m in sys.modules if m.split(".")[0] in PROVIDER_MODULES]:
        del sys.modules[name]


def write_dist(root: Path, name: str, models: dict[str, str], api=("1",), requires=(), version="1.0") -> Path:
    """A hand-written installed distribution: METADATA and entry_points.txt in a dist-info dir."""
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    (info / "METADATA").write_text("\n".join(meta + [f"Requires-Dist: {r}" for r in requires]) + "\n")
    eps = ["[edgerun.models]"] + [f"{t} = {m}" for t, m in models.items()]
    eps += ["", "[edgerun.provider_api]"] + [f"{level} = {name.replace('-', '_')}" for level in api]
    (info / "entry_points.txt").write_text("\n".join(eps) + "\n")
    return root


@pytest.fixture
def site(tmp_path) -> Path:
    """A site dir with a module that fails loudly if any provider code is ever imported from it."""
    (tmp_path / "boom_arch.py").write_text("raise RuntimeError('provider code ran')\n")
    return tmp_path


def installed(*roots: Path) -> tuple[Provider, ...]:
    return discover([str(r) for r in roots])


def run_py(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)


# ---- discovery ------------------------------------------------------------------------------


def test_discovery_reads_metadata_without_importing(example_site):
    """A fresh process: discovery and resolution import neither the provider nor torch."""
    code = (
        "import json, sys\n"
        "from edgerun.models.providers import ProviderPolicy\n"
        "from edgerun.models.registry import discover, resolve\n"
        "[p] = [p for p in discover() if p.name == 'edgerun-example-provider']\n"
        "res = resolve('example_moe', ProviderPolicy(allow=frozenset({'edgerun_example_provider'})))\n"
        "print(json.dumps({'provider': [p.name, p.version, dict(p.models), p.api, p.requires_edgerun],\n"
        "    'resolved': res.as_dict(), 'describe': res.describe(),\n"
        "    'imported': sorted(m for m in ('torch', 'edgerun_example_provider') if m in sys.modules)}))\n"
    )
    proc = run_py(code, example_site)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["provider"] == [
        EXAMPLE, "0.1.0", {"example_moe": "edgerun_example_provider.arch"}, ["1"], "<0.2,>=0.1"
    ]  # fmt: skip
    assert out["resolved"] == {
        "model_type": "example_moe",
        "module": "edgerun_example_provider.arch",
        "provider": EXAMPLE,
        "distribution": EXAMPLE,
        "version": "0.1.0",
        "api": 1,
        "builtin": False,
    }
    assert out["describe"] == "architecture example_moe from edgerun-example-provider 0.1.0 (provider API 1)"
    assert out["imported"] == []


def test_builtins_resolve_like_any_provider():
    res = select("qwen3_moe", BUILTIN_PROVIDER, ())
    assert (res.module, res.provider.builtin) == ("edgerun.models.qwen3_moe", True)
    assert res.describe().startswith("architecture qwen3_moe from edgerun 0.1.0 (built-in, provider API 1)")
    with pytest.raises(ConfigError, match=r"model_type 'llama' is not supported \(supported: qwen3_5_moe, "):
        select("llama", BUILTIN_PROVIDER, ())


# ---- trust ----------------------------------------------------------------------------------


def test_refused_without_allowlist(example_site, example_ckpt, monkeypatch):
    monkeypatch.syspath_prepend(str(example_site))
    with pytest.raises(ProviderError) as err:
        load_args(example_ckpt)
    assert str(err.value) == (
        "model_type 'example_moe' is provided by edgerun-example-provider 0.1.0 (provider API 1), which is "
        "not allowed to run: pass --allow-provider edgerun-example-provider (or list it under "
        "providers.allow in the serve config) if you trust it"
    )
    assert "edgerun_example_provider" not in sys.modules
    # allowing some other provider is not consent for this one
    with pytest.raises(ProviderError, match="not allowed to run"):
        load_args(example_ckpt, ProviderPolicy(allow=frozenset({"someone-else"})))


def test_allowed_provider_generates_tokens(
    example_site, example_ckpt, hf_checkpoints, monkeypatch, forget_provider_modules
):
    """Same weights, same blocks: the provider's model decodes the built-in one's tokens exactly."""
    monkeypatch.syspath_prepend(str(example_site))
    runner = Runner.load(example_ckpt, device="cpu", providers=ALLOW_EXAMPLE)
    assert runner.args.model_type == "example_moe"
    assert runner.provider.describe() == (
        "architecture example_moe from edgerun-example-provider 0.1.0 (provider API 1)"
    )
    builtin = Runner.load(hf_checkpoints["qwen3_moe"][1], device="cpu")
    assert builtin.provider.provider.builtin
    params = SamplingParams(max_tokens=8)
    tokens = runner.generate_ids([3, 4, 5], params)
    assert len(tokens) == 8 and tokens == builtin.generate_ids([3, 4, 5], params)


def test_other_processes_resolve_the_same(example_site, example_ckpt):
    """The daemon's or a tool's child process gets the policy, never a registry, from its parent:
    resolution there is the same pure function of installed metadata and policy."""
    cmd = [sys.executable, "-m", "edgerun.cli", "generate", "--model", str(example_ckpt), "--device", "cpu"]
    cmd += ["--token-ids", "3,4,5", "--max-tokens", "4"]
    env = {**os.environ, "PYTHONPATH": str(example_site)}
    refused = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert refused.returncode == 2
    assert "error: model_type 'example_moe' is provided by edgerun-example-provider" in refused.stderr
    assert "--allow-provider edgerun-example-provider" in refused.stderr

    argv = ALLOW_EXAMPLE.to_argv()
    assert ProviderPolicy.from_namespace(build_parser().parse_args(["generate", *argv])) == ALLOW_EXAMPLE
    ok = subprocess.run(cmd + argv, capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert len(ok.stdout.split()) == 4
    assert "architecture example_moe from edgerun-example-provider 0.1.0 (provider API 1)" in ok.stderr


# ---- every command that resolves an architecture takes the options its refusal advises ------


def refusal_advice(capsys, argv: list[str]) -> list[str]:
    """Run ``edgerun ARGV``, which must refuse the example provider; the options it says to pass."""
    assert edgerun_main(argv) != 0
    err = capsys.readouterr().err
    m = re.search(r"model_type 'example_moe' is provided by .*: pass ((?:--allow-provider \S+ ?)+)", err)
    assert m, err
    return m.group(1).split()


def accepted(capsys, argv: list[str]) -> str:
    """Run ``edgerun ARGV``, which must succeed; its stdout."""
    rc = edgerun_main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


@pytest.mark.parametrize("source", ["checkpoint", "config.json"])
def test_plan_takes_the_provider_options(
    example_site, example_ckpt, monkeypatch, capsys, forget_provider_modules, source
):
    monkeypatch.syspath_prepend(str(example_site))
    path = example_ckpt if source == "checkpoint" else example_ckpt / "config.json"
    argv = ["plan", "--profile", CPU_PROFILE, "--model", str(path), "--context", "64", "--quant", "int8"]
    advice = refusal_advice(capsys, argv)
    assert advice == ["--allow-provider", EXAMPLE]
    assert "edgerun plan: ckpt (example_moe) on " in accepted(capsys, argv + advice)


def test_convert_verify_and_plan_a_provider_bundle(
    example_site, example_ckpt, monkeypatch, capsys, tmp_path, forget_provider_modules
):
    """convert (--dry-run and for real), verify, plan --bundle and the bundle reader, each refused
    without the provider options and accepted with the ones the refusal names."""
    from tokenizers import Tokenizer, models

    monkeypatch.syspath_prepend(str(example_site))
    src = shutil.copytree(example_ckpt, tmp_path / "ckpt")  # a bundle carries a tokenizer
    Tokenizer(models.WordLevel({"t0": 0}, unk_token="t0")).save(str(src / "tokenizer.json"))
    dst = tmp_path / "bundle"
    argv = ["convert", str(src), str(dst), "--quant", "int8"]
    advice = refusal_advice(capsys, argv + ["--dry-run"])
    assert advice == ["--allow-provider", EXAMPLE]
    assert "bundle: example_moe, experts int8" in accepted(capsys, argv + ["--dry-run", *advice])
    assert refusal_advice(capsys, argv) == advice
    assert not dst.exists()  # refused before the destination was made
    accepted(capsys, argv + advice)

    argv = ["verify", str(dst), "--deep"]
    assert refusal_advice(capsys, argv) == advice
    out = accepted(capsys, argv + advice)
    assert f"{dst}: OK: edgerun bundle v2, example_moe, experts int8" in out and "files hashed" in out

    argv = ["plan", "--profile", CPU_PROFILE, "--model", str(dst), "--context", "64"]
    assert refusal_advice(capsys, argv) == advice
    out = accepted(capsys, argv + advice)
    assert "edgerun plan: bundle (example_moe) on " in out and "experts int8" in out

    with pytest.raises(ProviderError, match=r"manifest.json: model_type 'example_moe' is provided by"):
        Bundle.open(dst)
    _, args, report = load_bundle_model(dst, experts=False, providers=ALLOW_EXAMPLE)
    assert args.model_type == "example_moe"
    assert (
        report.provider.describe()
        == "architecture example_moe from edgerun-example-provider 0.1.0 (provider API 1)"
    )
    assert Bundle.open(dst, providers=ALLOW_EXAMPLE).provider == report.provider

    # streaming it (generate --quota) and tracing it take the same options
    argv = ["generate", "--model", str(dst), "--quota", "2", "--token-ids", "0", "--max-tokens", "3", "-q"]
    assert refusal_advice(capsys, argv) == advice
    accepted(capsys, argv + advice)
    argv = [
        "trace",
        "t0",
        "--model",
        str(dst),
        "--quota",
        "2",
        "--out",
        str(tmp_path / "t.jsonl"),
        "--max-tokens",
        "3",
    ]
    assert refusal_advice(capsys, argv) == advice
    accepted(capsys, argv + advice)
    assert (
        len((tmp_path / "t.jsonl").read_text().splitlines()) == 1 + 3
    )  # header, 1 prompt + 2 decoded tokens


# ---- refusals ---------------------------------------------------------------------------------


def test_duplicate_providers_need_a_choice(example_site, site):
    write_dist(site, "other-provider", {"example_moe": "boom_arch"})
    both = ProviderPolicy(allow=frozenset({EXAMPLE, "other-provider"}))
    with pytest.raises(ProviderError) as err:
        select("example_moe", BUILTIN_PROVIDER, installed(example_site, site), both)
    assert str(err.value) == (
        "model_type 'example_moe' is provided by 2 providers (edgerun-example-provider 0.1.0 (provider API 1), "
        "other-provider 1.0 (provider API 1)): choose one with --provider example_moe=edgerun-example-provider "
        "or --provider example_moe=other-provider (or providers.choose in the serve config)"
    )
    chosen = ProviderPolicy(allow=both.allow, choose={"example_moe": "edgerun_example_provider"})
    assert (
        select("example_moe", BUILTIN_PROVIDER, installed(example_site, site), chosen).provider.name
        == EXAMPLE
    )
    # only one of them allowed: no ambiguity, the other never runs
    assert select("example_moe", BUILTIN_PROVIDER, installed(example_site, site), ALLOW_EXAMPLE).module == (
        "edgerun_example_provider.arch"
    )
    with pytest.raises(ProviderError, match=r"--provider example_moe=nobody: no installed provider named"):
        select(
            "example_moe", BUILTIN_PROVIDER, installed(site), ProviderPolicy(choose={"example_moe": "nobody"})
        )
    assert "boom_arch" not in sys.modules


@pytest.mark.parametrize(
    "api, requires, message",
    [
        (
            ("2",),
            ("edgerun>=0.1",),
            "provider future-provider 1.0 implements provider API 2, but edgerun 0.1.0 implements API 1: "
            "install a version of future-provider for API 1",
        ),
        (
            (),
            (),
            "provider future-provider 1.0 must declare exactly one provider API level as an "
            "'edgerun.provider_api' entry point name (declared: none); edgerun 0.1.0 implements API 1",
        ),
        (
            ("1",),
            ("edgerun>=0.2,<0.3", "torch>=2"),
            "provider future-provider 1.0 requires edgerun>=0.2,<0.3 but this is edgerun 0.1.0: "
            "install a version of future-provider built for it",
        ),
        (
            ("1",),
            ("edgerun>=0.1.0rc1",),
            "provider future-provider 1.0: Requires-Dist edgerun '>=0.1.0rc1': "
            "cannot read version clause '>=0.1.0rc1'",
        ),
    ],
)
def test_incompatible_provider_is_refused(site, api, requires, message):
    write_dist(site, "future-provider", {"future_moe": "boom_arch"}, api=api, requires=requires)
    policy = ProviderPolicy(allow=frozenset({"future-provider"}))
    with pytest.raises(ProviderError) as err:
        select("future_moe", BUILTIN_PROVIDER, installed(site), policy)
    assert str(err.value) == message
    assert "boom_arch" not in sys.modules


def test_replacing_a_builtin_needs_an_override(site):
    write_dist(site, "shadow-provider", {"qwen3_moe": "boom_arch"})
    found = installed(site)
    # installed but not allowed: ignored, the built-in serves (an install can't deny service either)
    assert select("qwen3_moe", BUILTIN_PROVIDER, found).provider.builtin
    allowed = ProviderPolicy(allow=frozenset({"shadow-provider"}))
    with pytest.raises(ProviderError) as err:
        select("qwen3_moe", BUILTIN_PROVIDER, found, allowed)
    assert str(err.value) == (
        "provider shadow-provider 1.0 (provider API 1) declares model_type 'qwen3_moe', which is a built-in "
        "architecture: replacing it needs --allow-override shadow-provider (or providers.allow_override); "
        "to keep the built-in one, pass --provider qwen3_moe=builtin"
    )
    keep = ProviderPolicy(allow=allowed.allow, choose={"qwen3_moe": "builtin"})
    assert select("qwen3_moe", BUILTIN_PROVIDER, found, keep).provider.builtin
    override = ProviderPolicy(allow=allowed.allow, allow_override=frozenset({"shadow-provider"}))
    assert select("qwen3_moe", BUILTIN_PROVIDER, found, override).module == "boom_arch"
    with pytest.raises(ProviderError, match="not allowed to run"):  # override alone is not consent to run
        select("qwen3_moe", BUILTIN_PROVIDER, found, ProviderPolicy(choose={"qwen3_moe": "shadow-provider"}))
    with pytest.raises(ConfigError, match="'builtin' is not a provider to allow"):
        ProviderPolicy(allow=frozenset({"builtin"}))
    assert "boom_arch" not in sys.modules


def test_provider_module_interface_is_checked_on_import(site, monkeypatch, forget_provider_modules):
    (site / "partial_arch.py").write_text(
        "MODEL_TYPES = ('partial_moe',)\ndef model_args(cfg, source): ...\n"
    )
    write_dist(site, "partial-provider", {"partial_moe": "partial_arch", "boom_moe": "boom_arch"})
    monkeypatch.syspath_prepend(str(site))
    policy = ProviderPolicy(allow=frozenset({"partial-provider"}))
    with pytest.raises(ProviderError) as err:
        import_architecture(select("partial_moe", BUILTIN_PROVIDER, installed(site), policy))
    assert str(err.value) == (
        "provider partial-provider 1.0 (provider API 1): module 'partial_arch' does not implement provider "
        "API 1: no function 'tensor_specs'; 'Model' is not a subclass of edgerun.models.base.CausalLM"
    )
    with pytest.raises(ProviderError) as err:
        resolve_config({"model_type": "boom_moe"}, policy)
    assert str(err.value) == (
        "provider partial-provider 1.0 (provider API 1): importing 'boom_arch' for model_type 'boom_moe' "
        "failed: RuntimeError: provider code ran"
    )


# ---- pieces -----------------------------------------------------------------------------------


def test_version_specifiers():
    for spec in (">=0.1,<0.2", "==0.1", "==0.1.*", "~=0.1.0", "!=0.2", ">0.0.9", "<=0.1.0", ""):
        assert version_matches("0.1.0", spec), spec
    for spec in (">=0.2", "<0.1", "==0.2.*", "~=0.2", "!=0.1.0", ">=0.1,<0.1"):
        assert not version_matches("0.1.0", spec), spec
    with pytest.raises(ValueError, match="cannot read version clause '~=1'"):
        version_matches("0.1.0", "~=1")
    assert (
        edgerun_requirement(["torch>=2", "edgerun (>=0.1,<0.2)", 'edgerun>=9; extra == "dev"'])
        == ">=0.1,<0.2"
    )
    assert edgerun_requirement(["edgerun[serve]>=0.1; python_version >= '3.10'"]) == ">=0.1"
    assert edgerun_requirement(["edgerun"]) == ""
    assert edgerun_requirement(["torch"]) is None


def test_policy_from_config_and_command_line():
    policy = ProviderPolicy.from_mapping(
        {"allow": ["Edgerun_Example.Provider"], "choose": {"example_moe": "edgerun-example-provider"}}
    )
    assert policy == ProviderPolicy(allow=frozenset({EXAMPLE}), choose={"example_moe": EXAMPLE})
    ns = build_parser().parse_args(["generate", "x", *policy.to_argv()])
    assert ProviderPolicy.from_namespace(ns) == policy
    with pytest.raises(ConfigError, match=r"providers.allow: must be a list of distribution names"):
        ProviderPolicy.from_mapping({"allow": "edgerun-example-provider"})
    with pytest.raises(ConfigError, match=r"providers: unknown key 'alow'"):
        ProviderPolicy.from_mapping({"alow": []})
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--provider", "example_moe"])


def test_docs_show_the_tested_example_package():
    doc = (Path(__file__).parents[2] / "docs" / "providers.md").read_text()
    blocks = dict(re.findall(r'```\w+ title="([^"]+)"\n(.*?)```', doc, re.S))
    files = {
        p.relative_to(EXAMPLE_SRC).as_posix() for p in EXAMPLE_SRC.rglob("*") if p.suffix in (".py", ".toml")
    }
    assert set(blocks) == files
    for name, text in blocks.items():
        assert text == (EXAMPLE_SRC / name).read_text(), (
            f"docs/providers.md: {name} differs from the tested file"
        )
