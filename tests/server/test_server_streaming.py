"""The daemon serving a bundle with its experts streamed: same tokens as in-process streaming,
cache counters in /metrics, streaming mode, bundle hash and plan in /v1/models, and a plan that
does not fit refused before the socket is bound. The daemon reads through io_uring where it can
run (the in-process reference through preadv), so the two backends' tokens are compared too."""

from __future__ import annotations

import re

import pytest
from server_helpers import Daemon, get, post, serve_argv

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.cache.uring import unavailable
from edgerun.config import CacheConfig
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams


@pytest.fixture(scope="module")
def bundle(served_model, tmp_path_factory):
    dst = tmp_path_factory.mktemp("served-bundle") / "b"
    convert(served_model, dst, ConvertOptions("bf16"))
    return dst


def _metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def test_streamed_bundle_serves_the_same_tokens(bundle, tmp_path, capsys):
    sock = tmp_path / "s.sock"
    reader = "preadv" if unavailable() else "io_uring"
    d = Daemon(
        serve_argv("--model", str(bundle), "--quota", "2", "--socket", str(sock), "--device", "cpu")
        + ["--reader", reader],
        sock,
    )
    try:
        d.wait_health()
        code, body = post(
            sock, "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 12, "temperature": 0}
        )
        assert code == 200, body
        runner = Runner.load(bundle, device="cpu", cache=CacheConfig(2))
        ids = runner.generate_ids([5, 6, 7, 8], SamplingParams(max_tokens=12))
        assert body["choices"][0]["text"] == runner.tokenizer.decode(ids)
        _, models = get(sock, "/v1/models")
        meta = models["data"][0]
        text = repr(meta)
        assert "streamed" in text and re.search(r"'bundle_hash': '[0-9a-f]{16}'", text)
        _, metrics = get(sock, "/metrics")
        assert _metric_sum(metrics, "edgerun_expert_cache_misses_total") > 0
        assert _metric_sum(metrics, "edgerun_expert_bytes_read_total") > 0
        reads = re.findall(r'^edgerun_expert_reads_total\{reader="(\w+)"\} (\d+)$', metrics, re.M)
        assert [r for r, _ in reads] == [reader] and int(reads[0][1]) > 0, reads
        # the disk's busy time and its queue: every busy second had at least one read in flight
        busy, requests = (
            float(re.search(rf"^{name} ([0-9.e+-]+)$", metrics, re.M).group(1))
            for name in ("edgerun_disk_busy_seconds_total", "edgerun_disk_request_seconds_total")
        )
        assert 0 < busy <= requests * (1 + 1e-9), (busy, requests)
        assert "experts streamed (quota 2 per layer" in d.log() and f" via {reader} depth" in d.log()
        from edgerun.cli import main  # the socket client: `edgerun generate --socket`

        capsys.readouterr()
        argv = ["generate", "--socket", str(sock), "--token-ids", "5,6,7,8", "--max-tokens", "12"]
        assert main(argv) == 0
        assert capsys.readouterr().out.split() == [str(t) for t in ids]
    finally:
        assert d.stop() == 0


def test_plan_that_does_not_fit_is_refused_before_binding(bundle, tmp_path):
    from edgerun.engine.runner import DEMO_MODEL

    profile = tmp_path / "tiny.yaml"
    cpu = (DEMO_MODEL.parents[1] / "configs" / "cpu.yaml").read_text()
    profile.write_text(cpu.replace("memory_cap: 23GiB", "memory_cap: 3.0001GiB"))
    sock = tmp_path / "t.sock"
    d = Daemon(serve_argv("--model", str(bundle), "--device", str(profile), "--socket", str(sock)), sock)
    assert d.proc.wait(60) == 2
    assert "does not fit on" in d.log() and not sock.exists()


def test_a_resident_model_that_does_not_fit_the_profile_is_refused_before_binding(tmp_path):
    """Not only bundles are planned: the demo model held whole is checked against the profile,
    and the refusal names what would fit (a bundle streamed within the plan)."""
    from edgerun.engine.runner import DEMO_MODEL

    profile = tmp_path / "tiny.yaml"
    cpu = (DEMO_MODEL.parents[1] / "configs" / "cpu.yaml").read_text()
    # the demo held whole does not fit; converted to int4 and streamed, it would
    profile.write_text(cpu.replace("memory_cap: 23GiB", "memory_cap: 3.045GiB"))
    sock = tmp_path / "m.sock"
    argv = serve_argv("--profile", str(profile), "--device", "cpu", "--socket", str(sock), "--batch", "1")
    d = Daemon(argv, sock)  # batch 1: the streamed plan the refusal names fits one request at a time
    try:
        assert d.proc.wait(60) == 2
    finally:
        d.stop()
    log = d.log()
    assert "the demo model with every expert resident (16 per layer, fp32): does not fit on" in log
    assert "Stream the experts from a bundle instead: `edgerun convert" in log and not sock.exists()
    assert "(planned: quota " in log  # what would fit, planned


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA (none on this machine)")
def test_a_bundle_whose_every_expert_fits_decodes_one_graph_a_step(bundle, tmp_path):
    """Every expert in a slot: they are read in at load, so the decoder built by the start-up
    probe already finds the slot table on the device and a decode step is one CUDA graph; and
    start-up captured every prompt length's prefill graph, so no request captures one."""
    sock = tmp_path / "g.sock"
    argv = serve_argv("--model", str(bundle), "--quota", "6", "--socket", str(sock), "--device", "cuda")
    d = Daemon(argv, sock)
    try:
        d.wait_health(timeout=300)
        assert re.search(r"probe passed: .*; prefill graphs of 16, 32, 64, .* tokens captured in", d.log()), (
            d.log()
        )
        captured = r'^edgerun_graph_captures_total\{kind="prefill"\} ([0-9.e+]+)$'
        replayed = r'^edgerun_prefill_chunks_total\{mode="graph"\} ([0-9.e+]+)$'
        before = [float(re.search(r, get(sock, "/metrics")[1], re.M).group(1)) for r in (captured, replayed)]
        for prompt in ([5, 6, 7, 8], list(range(5, 45))):  # lengths 16 and 64 padded: captured at start-up
            code, body = post(sock, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
            assert code == 200, body
        _, models = get(sock, "/v1/models")
        kernels = models["data"][0]["edgerun"]["kernels"]
        assert "1 graph(s) per step" in kernels and "expert steps table" in kernels, kernels
        _, metrics = get(sock, "/metrics")
        graph = re.search(r'^edgerun_decode_steps_total\{mode="graph"\} ([0-9.e+]+)$', metrics, re.M)
        assert graph is not None and float(graph.group(1)) >= 10, metrics
        assert _metric_sum(metrics, "edgerun_expert_cache_misses_total") == 0
        after = [float(re.search(r, metrics, re.M).group(1)) for r in (captured, replayed)]
        assert after[0] == before[0] >= 3 and after[1] == before[1] + 2, (
            before,
            after,
        )  # replayed, none captured
    finally:
        assert d.stop() == 0
