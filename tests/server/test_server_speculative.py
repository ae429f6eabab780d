"""``edgerun serve --speculative mtp --draft-tokens K`` (and serve.yaml's keys): a greedy request
served through the socket with MTP drafting gives plain greedy's tokens; /metrics and the model
card say what ran; bad settings are named errors."""

from __future__ import annotations

import re

import pytest
from server_helpers import Daemon, get, post, serve_argv

from edgerun.config import SpeculativeConfig
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams
from edgerun.errors import ConfigError
from edgerun.server.options import ServeOptions, load_serve_config

PROMPT = "And God said"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    sock = d / "edgerun.sock"
    config = d / "serve.yaml"
    config.write_text(f"socket: {sock}\nspeculative: mtp\ndraft_tokens: 3\n")
    # the demo model (its MTP head is trained); the flag overrides the YAML's draft count
    proc = Daemon(serve_argv("--config", str(config), "--device", "cpu", "--draft-tokens", "2"), sock)
    proc.wait_health(200)
    yield proc
    assert proc.stop() == 0, proc.log()


def metric(text: str, name: str, **labels) -> float:
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{([^}}]*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            return float(m.group(2))
    raise AssertionError(f"{name} {labels} missing from /metrics")


def test_served_greedy_with_mtp_equals_plain_greedy(daemon):
    runner = Runner.load(None, device="cpu")
    ids = runner.tokenizer.encode(PROMPT)
    want = runner.generate_ids(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    body = dict(prompt=PROMPT, max_tokens=40, temperature=0, ignore_eos=True, return_token_ids=True)
    status, out = post(daemon.sock, "/v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["token_ids"] == want

    _, models = get(daemon.sock, "/v1/models")
    assert "speculative mtp, 2 draft token(s) a step" in models["data"][0]["edgerun"]["provenance"]
    _, text = get(daemon.sock, "/metrics")
    labels = dict(method="mtp", draft_tokens=2)
    drafted = metric(text, "edgerun_speculative_tokens_total", kind="drafted", **labels)
    accepted = metric(text, "edgerun_speculative_tokens_total", kind="accepted", **labels)
    emitted = metric(text, "edgerun_speculative_tokens_total", kind="emitted", **labels)
    steps = metric(text, "edgerun_speculative_steps_total", **labels)
    assert emitted == 39 and 0 < accepted <= drafted <= 2 * steps  # 40 tokens: the first from prefill
    # on the CPU every step is host-driven (device-decided steps run on the CUDA decoder)
    assert metric(text, "edgerun_speculative_device_steps_total", **labels) == 0
    assert metric(text, "edgerun_speculative_acceptance_ratio", **labels) == pytest.approx(accepted / drafted)
    assert metric(text, "edgerun_speculative_tokens_per_step", **labels) == pytest.approx(emitted / steps)
    assert metric(text, "edgerun_speculative_speedup", **labels) > 0
    assert metric(text, "edgerun_speculative_row_step_seconds", **labels) > 0


def test_serve_config_speculative_keys(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("speculative: mtp\ndraft_tokens: 4\n")
    assert ServeOptions().merged(load_serve_config(cfg)).speculative_config() == SpeculativeConfig("mtp", 4)
    cfg.write_text("speculative: mtp\nspeculative_sampled: verify\n")
    got = ServeOptions().merged(load_serve_config(cfg)).speculative_config()
    assert got == SpeculativeConfig("mtp", 1, sampled="verify")
    assert ServeOptions(speculative="mtp").speculative_config() == SpeculativeConfig("mtp", 1)
    assert ServeOptions().speculative_config() is None
    for text, message in (
        ("draft_tokens: 2\n", "'draft_tokens' needs 'speculative: mtp'"),
        ("speculative: mtp\ndraft_tokens: 5\n", "draft tokens must be an integer in 1..4, got 5"),
        ("speculative: eagle\n", "speculative method 'eagle' is not supported"),
        ("speculative_sampled: verify\n", "'speculative_sampled' needs 'speculative: mtp'"),
        (
            "speculative: mtp\nspeculative_sampled: maybe\n",
            "speculative sampled 'maybe' is not one of plain, verify",
        ),
    ):
        cfg.write_text(text)
        with pytest.raises(ConfigError, match=re.escape(message)):
            ServeOptions().merged(load_serve_config(cfg))
