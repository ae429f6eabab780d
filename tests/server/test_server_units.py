"""The daemon's small parts without a daemon: sd_notify, socket paths and binding, options, metrics."""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgerun.config import DEFAULT_PREFILL_LANES, default_prefill_lanes
from edgerun.errors import ConfigError, EdgerunError
from edgerun.server import client, paths
from edgerun.server.cli import serve_options
from edgerun.server.client import UnixHTTPConnection
from edgerun.server.metrics import _escape
from edgerun.server.options import ServeOptions, load_serve_config
from edgerun.server.paths import bind_unix_socket, default_socket_path, find_socket
from edgerun.server.sdnotify import Notifier, watchdog_interval


def test_notifier_is_a_no_op_outside_systemd():
    assert Notifier.from_env({}).notify("READY=1") is False


def test_notifier_sends_to_a_path_and_an_abstract_socket(tmp_path):
    path = tmp_path / "notify"
    abstract = f"edgerun-test-{os.getpid()}"
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as a,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as b,
    ):
        a.bind(str(path))
        b.bind("\0" + abstract)
        assert Notifier.from_env({"NOTIFY_SOCKET": str(path)}).notify("READY=1", "STATUS=up")
        assert a.recv(100) == b"READY=1\nSTATUS=up"
        assert Notifier("@" + abstract).notify("STOPPING=1")
        assert b.recv(100) == b"STOPPING=1"
    assert Notifier(str(tmp_path / "gone")).notify("READY=1") is False  # logged, never raised


def test_watchdog_interval():
    assert watchdog_interval({"WATCHDOG_USEC": "2000000"}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 2.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}) is None  # another process's
    assert watchdog_interval({}) is None


def test_socket_path_discovery(tmp_path):
    assert default_socket_path({"RUNTIME_DIRECTORY": "/run/edgerun", "XDG_RUNTIME_DIR": "/x"}) == (
        default_socket_path({"RUNTIME_DIRECTORY": "/run/edgerun"})
    )
    assert str(default_socket_path({"RUNTIME_DIRECTORY": "/run/edgerun"})) == "/run/edgerun/edgerun.sock"
    assert str(default_socket_path({"XDG_RUNTIME_DIR": "/run/user/7"})) == "/run/user/7/edgerun.sock"
    assert default_socket_path({}).name == "edgerun.sock" and f"edgerun-{os.getuid()}" in str(
        default_socket_path({})
    )
    (tmp_path / "edgerun.sock").touch()
    assert find_socket({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "edgerun.sock"


def test_bind_refuses_a_live_socket_and_a_plain_file_and_replaces_a_stale_one(tmp_path):
    path = tmp_path / "s.sock"
    live = bind_unix_socket(path, mode=0o660)
    try:
        assert os.stat(path).st_mode & 0o777 == 0o660
        with pytest.raises(EdgerunError, match="already serving"):
            bind_unix_socket(path)
    finally:
        live.close()  # the file stays behind, as a crashed daemon's does
    bind_unix_socket(path).close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(EdgerunError, match="not a socket"):
        bind_unix_socket(tmp_path / "file")
    with pytest.raises(EdgerunError, match="longer than"):
        bind_unix_socket(tmp_path / ("x" * 120))
    with pytest.raises(EdgerunError, match="does not exist"):
        bind_unix_socket(tmp_path / "no" / "s.sock", group="no-such-group-edgerun")


class Listener:
    """A Unix socket server in a thread that records what each client sends (issue 19, item 1)."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen()
        self.received = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(2)
                self.received.append(b"".join(iter(functools.partial(conn.recv, 4096), b"")))


def test_client_looks_in_private_and_system_places_before_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "SYSTEM_SOCKET", tmp_path / "run" / "edgerun.sock")
    monkeypatch.setattr(paths.tempfile, "tempdir", str(tmp_path))
    planted = tmp_path / f"edgerun-{os.getuid()}"
    planted.mkdir()
    (planted / "edgerun.sock").touch()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "edgerun.sock").touch()
    assert find_socket({}) == tmp_path / "run" / "edgerun.sock"  # the system socket before /tmp
    (tmp_path / "xdg").mkdir()
    (tmp_path / "xdg" / "edgerun.sock").touch()
    assert find_socket({"XDG_RUNTIME_DIR": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "edgerun.sock"


def test_client_refuses_a_socket_or_directory_an_untrusted_uid_owns(tmp_path):
    (tmp_path / "edgerun.sock").touch()
    me = os.stat(tmp_path).st_uid
    with pytest.raises(paths.UntrustedSocket, match=f"{tmp_path} is owned by uid {me}"):
        find_socket({"XDG_RUNTIME_DIR": str(tmp_path)}, trusted=frozenset({me + 1}))
    assert find_socket({"XDG_RUNTIME_DIR": str(tmp_path)}, trusted=frozenset({me}))


def test_client_sends_nothing_to_a_server_of_an_untrusted_uid(tmp_path, monkeypatch):
    server = Listener(tmp_path / "s.sock")
    me = os.getuid()
    monkeypatch.setattr(client, "check_owner", lambda path, trusted: None)  # the files pass
    conn = UnixHTTPConnection(tmp_path / "s.sock", 5, trusted=frozenset({me + 1}))
    with pytest.raises(paths.UntrustedSocket, match=f"served by a process of uid {me}"):
        conn.request("POST", "/v1/completions", body=b'{"prompt": "secret"}')
    deadline = time.monotonic() + 5
    while not server.received:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert server.received == [b""]


@pytest.mark.skipif(os.getuid() != 0, reason="planting a directory owned by another uid needs root")
@pytest.mark.skipif(paths.SYSTEM_SOCKET.exists(), reason="a system daemon's socket would be found first")
def test_chat_refuses_a_tmp_directory_another_user_planted(tmp_path):
    """The attack: XDG_RUNTIME_DIR unset, another user created /tmp/edgerun-$UID first."""
    planted = tmp_path / f"edgerun-{os.getuid()}"
    planted.mkdir(mode=0o777)
    server = Listener(planted / "edgerun.sock")
    os.chown(planted, 4242, 4242)
    os.chown(planted / "edgerun.sock", 4242, 4242)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "RUNTIME_DIRECTORY")}
    res = subprocess.run(
        [sys.executable, "-m", "edgerun.cli", "chat", "my secret prompt"],
        env={**env, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode != 0 and f"{planted} is owned by uid 4242" in res.stderr, res.stderr
    assert server.received == []


def test_two_daemons_racing_for_a_stale_socket_one_wins(tmp_path, monkeypatch):
    """Item 7: the check-then-unlink window, widened: without the lock several "win"."""
    path = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    is_live = paths._is_live
    monkeypatch.setattr(paths, "_is_live", lambda p: (is_live(p), time.sleep(0.2))[0])
    won, lost = [], []

    def race():
        try:
            won.append(bind_unix_socket(path))
        except Exception as exc:
            lost.append(exc)

    threads = [threading.Thread(target=race) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(won) == 1, (won, lost)
    assert all(isinstance(e, EdgerunError) and "already serving" in str(e) for e in lost), lost
    won[0].close()


def test_serve_config(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("socket_mode: 0640\nmax_body_bytes: 2MiB\nrequest_timeout: 10\nqueue_size: 4\n")
    opts = ServeOptions().merged(load_serve_config(cfg)).merged({"queue_size": 8, "model": None})
    assert (opts.socket_mode, opts.max_body_bytes, opts.request_timeout, opts.queue_size) == (
        0o640,
        2 * 2**20,
        10.0,
        8,
    )
    cfg.write_text("queue_sise: 4\n")
    with pytest.raises(ConfigError, match="did you mean 'queue_size'"):
        load_serve_config(cfg)
    cfg.write_text("queue_size: lots\n")
    with pytest.raises(ConfigError, match="'queue_size' must be int"):
        load_serve_config(cfg)
    with pytest.raises(ConfigError, match="grace_period"):
        ServeOptions(grace_period=0)


def test_engine_process_is_on_by_default_and_off_by_flag_or_key(tmp_path):
    from edgerun.cli import build_parser

    def opts(*argv: str) -> ServeOptions:
        return serve_options(build_parser().parse_args(["serve", *argv]))

    assert opts().engine_process is True
    assert opts("--engine-process", "off").engine_process is False
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("engine_process: false\n")
    assert opts("--config", str(cfg)).engine_process is False
    assert opts("--config", str(cfg), "--engine-process", "on").engine_process is True
    cfg.write_text("engine_process: maybe\n")
    with pytest.raises(ConfigError, match="'engine_process' must be bool"):
        load_serve_config(cfg)


def test_metric_labels_are_escaped():
    assert _escape('a"b\\c\nd') == 'a\\"b\\\\c\\nd'


def _on_uvloop(coro_fn):
    import uvloop

    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(coro_fn(loop))
    finally:
        loop.close()


def test_channel_gathers_tokens_without_waking_the_loop_and_ends_at_once():
    import asyncio
    import threading
    import time

    from edgerun.server.api import Aborted, Channel

    class Ev:
        def __init__(self, i, finish=None):
            self.token_id, self.text, self.finish_reason = i, str(i), finish

    async def scenario(loop):
        ch = Channel(loop)
        wakes = []
        real_wake = ch._wake
        ch._wake = lambda: (wakes.append(1), real_wake())
        # tokens from another thread while the handler waits out a write window: no wake-ups
        t = threading.Thread(target=lambda: [ch.put(Ev(i)) for i in range(5)])
        t0 = time.monotonic()
        t.start()
        loop.call_later(0.01, ch._wake)  # a stale wake-up must not end the window early
        items = await ch.take(any_item=False, timeout=0.1)
        t.join()
        assert time.monotonic() - t0 >= 0.09 and [e.token_id for e in items] == list(range(5))
        assert len(wakes) == 2  # the stale one and the timer: none per token
        # waiting for any token: the next one wakes it
        loop.call_later(0.01, lambda: threading.Thread(target=ch.put, args=(Ev(5),)).start())
        assert [e.token_id for e in await ch.take(any_item=True)] == [5]
        # a final item ends a window at once
        threading.Thread(target=ch.put, args=(Ev(6, "length"),)).start()
        t0 = time.monotonic()
        assert [e.token_id for e in await ch.take(any_item=False, timeout=5)] == [6]
        assert time.monotonic() - t0 < 1
        # an abort from the loop is final even if tokens arrive after it
        ch2 = Channel(loop)
        ch2.put_here(Aborted(499, "client disconnected"))
        ch2.put(Ev(7))
        items = await asyncio.wait_for(ch2.take(any_item=False), 1)
        assert isinstance(items[0], Aborted) and items[1].token_id == 7

    _on_uvloop(scenario)


def test_serve_batch_option_default_and_plan(tmp_path):
    from pathlib import Path

    from edgerun.server.cli import cache_plan, serve_batch
    from edgerun.server.options import DEFAULT_BATCH

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("batch: 6\n")
    assert ServeOptions().merged(load_serve_config(cfg)).batch == 6
    with pytest.raises(ConfigError, match="'batch' must be at least 1, got 0"):
        ServeOptions(batch=0)
    cfg.write_text("batch: 6\nbatch_gemv: rows\n")
    assert ServeOptions().batch_gemv == "planes"
    assert ServeOptions().merged(load_serve_config(cfg)).batch_gemv == "rows"
    with pytest.raises(ConfigError, match="'batch_gemv' must be 'planes' or 'rows', got 'mma'"):
        ServeOptions(batch_gemv="mma")
    cfg.write_text("batch: 6\nprefill_lanes: 4\n")
    assert ServeOptions().prefill_lanes is None  # the plan's, else config.default_prefill_lanes
    assert ServeOptions().merged(load_serve_config(cfg)).prefill_lanes == 4
    with pytest.raises(ConfigError, match="'prefill_lanes' must be at least 1, got 0"):
        ServeOptions(prefill_lanes=0)

    assert serve_batch(ServeOptions(), "cpu") == DEFAULT_BATCH and serve_batch(ServeOptions(), "cuda") == 1
    assert serve_batch(ServeOptions(batch=3), "cuda") == 3  # asked for: refused at load, by name
    profile = Path(__file__).resolve().parents[2] / "configs" / "cpu.yaml"
    plan = cache_plan(ServeOptions(profile=profile, device="cpu", batch=8, context=2048)).summary
    assert "context 2048, batch 8: every expert resident" in plan
    with pytest.raises(
        EdgerunError,
        match=r"at context 2048, batch 100000, .* Largest batch that fits at context 2048: \d+\.",
    ):
        cache_plan(ServeOptions(profile=profile, device="cpu", batch=100_000, context=2048))


def test_prefill_lanes_default_to_the_plans_then_the_devices():
    """Lanes not asked for: a CUDA plan that holds every expert counts up to
    DEFAULT_PREFILL_LANES (a lane a row at most), and serve runs what it counted; without a plan
    the device decides once known (CUDA: up to the default, the CPU: one)."""
    from edgerun.server.cli import cache_plan

    thor = Path(__file__).resolve().parents[2] / "configs" / "jetson_thor.yaml"
    for batch, lanes in ((8, DEFAULT_PREFILL_LANES), (2, 2), (1, 1)):
        got = cache_plan(ServeOptions(profile=thor, batch=batch, context=2048))
        assert got.prefill_lanes == lanes
        assert (f"(prompts in {lanes} lanes)" in got.summary) == (lanes > 1)
    assert cache_plan(ServeOptions(profile=thor, batch=8, context=2048, prefill_lanes=1)).prefill_lanes == 1
    assert cache_plan(ServeOptions(batch=8)).prefill_lanes is None
    assert cache_plan(ServeOptions(batch=8, prefill_lanes=2)).prefill_lanes == 2
    assert default_prefill_lanes("cuda", 8) == DEFAULT_PREFILL_LANES and default_prefill_lanes("cuda", 3) == 3
    assert default_prefill_lanes("cpu", 8) == 1


@pytest.mark.parametrize(
    "device, planned, asked, want",
    [("cuda", None, 8, 4), ("cuda", None, 2, 2), ("cuda", 1, 8, 1), ("cuda", 3, 8, 3), ("cpu", None, 8, 1)],
)
def test_the_engine_loader_enables_the_lanes_planned_else_the_devices(
    monkeypatch, device, planned, asked, want
):
    """What the daemon's engine factory hands ``Runner.enable_batch``: the lanes cache_plan
    settled, else the device's default once the runner is on it."""
    from types import SimpleNamespace

    import edgerun.engine.setup as setup
    import edgerun.server.engine_worker as worker
    from edgerun.server.cli import EngineLoader

    calls = []
    runner = SimpleNamespace(
        device=SimpleNamespace(type=device), enable_batch=lambda size, **kw: calls.append((size, kw))
    )
    rt = SimpleNamespace(device=device, load=lambda *a, **kw: runner)
    monkeypatch.setattr(setup, "runtime", lambda *a, **kw: rt)
    monkeypatch.setattr(worker, "RunnerEngine", lambda *a: a)
    EngineLoader(ServeOptions(batch=asked), prefill_lanes=planned)(lambda line: None)
    assert calls == [(asked, dict(planes=True, lanes=want))]


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(speculative="mtp", batch=4), "'speculative' and 'batch' above 1 do not combine"),
        (dict(prefill_lanes=2, device="cpu"), "'prefill_lanes' above 1 needs CUDA"),
        (dict(prefill_lanes=2, batch=1), "'prefill_lanes' above 1 needs a batch above 1"),
        (dict(prefill_chunk=0), "'prefill_chunk' must be at least 1"),
    ],
)
def test_options_the_engine_would_refuse_after_loading_are_refused_before(kw, says):
    """A usage error found before the socket is bound or the model loads: exit 2 at once."""
    with pytest.raises(ConfigError, match=says):
        ServeOptions(**kw)


def _one_shot_server(path, answers: list[bytes]) -> threading.Thread:
    """A Unix socket that reads each request's head and answers with the next of ``answers``
    (then closes the connection): a daemon that breaks off, for the client's side."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(4)

    def serve():
        with srv:
            for answer in answers:
                conn, _ = srv.accept()
                with conn:
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += conn.recv(65536)
                    head, _, body = data.partition(b"\r\n\r\n")
                    length = next(
                        (
                            int(h.split(b":")[1])
                            for h in head.split(b"\r\n")
                            if h.lower().startswith(b"content-length")
                        ),
                        0,
                    )
                    while len(body) < length:
                        body += conn.recv(65536)
                    conn.sendall(answer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return t


SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
CUT = SSE_HEAD + b'data: {"choices": [{"text": "half"}]}\n\n'  # no [DONE]: the daemon went away
FAILED = SSE_HEAD + b'data: {"error": {"message": "engine error: boom"}}\n\n'
REFUSED = b'HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 40\r\nConnection: close\r\n\r\n{"error": {"message": "no, not this"}}  '
OK = SSE_HEAD + b'data: {"choices": [{"delta": {"content": "fine"}}]}\n\ndata: [DONE]\n\n'


def test_the_client_names_a_cut_stream_a_closed_connection_and_a_bad_socket_path(tmp_path):
    """A stream that ends without [DONE], a connection closed without an answer and a socket
    path too long for AF_UNIX each end the command with its own message and exit 1 (the
    daemon's fault, not the user's); an error inside the stream says so."""
    sock = tmp_path / "d.sock"
    _one_shot_server(sock, [CUT, b"", FAILED, REFUSED])
    c = client.Client(sock, timeout=10)
    body = {"prompt": "x"}
    with pytest.raises(
        client.DaemonUnavailable, match=r"ended the stream before it finished \(no \[DONE\]\)"
    ) as e:
        list(c.stream("/v1/completions", body))
    assert e.value.exit_status == 1
    with pytest.raises(client.DaemonUnavailable, match="closed the connection without answering"):
        list(c.stream("/v1/completions", body))
    with pytest.raises(client.ServerError, match="the stream failed: engine error: boom") as e:
        list(c.stream("/v1/completions", body))
    assert e.value.exit_status == 1
    with pytest.raises(client.ServerError, match="server answered 400: no, not this") as e:
        list(c.stream("/v1/completions", body))
    assert e.value.exit_status == 2
    long = tmp_path / ("x" * 120 + ".sock")
    with pytest.raises(client.DaemonUnavailable, match="cannot connect to .*is `edgerun serve` running"):
        list(client.Client(long).stream("/v1/completions", body))


def test_a_failed_chat_turn_keeps_the_conversation(tmp_path, monkeypatch, capsys):
    """`edgerun chat` reading stdin: a refused message is dropped from the history with an error
    line, the next one is sent without it, and the exit status says a turn failed."""
    import argparse
    import io

    sock = tmp_path / "c.sock"
    seen = []
    real = client.Client.stream

    def spy(self, url, body):
        seen.append([m["content"] for m in body["messages"]])
        return real(self, url, body)

    monkeypatch.setattr(client.Client, "stream", spy)
    _one_shot_server(sock, [OK, REFUSED, OK])
    monkeypatch.setattr("sys.stdin", io.StringIO("one\ntoo long\nthree\n"))
    ns = argparse.Namespace(
        socket=sock,
        system=None,
        message=None,
        max_tokens=4,
        temperature=None,
        top_p=None,
        top_k=None,
        seed=None,
    )
    assert client.chat(ns) == 1
    assert seen == [["one"], ["one", "fine", "too long"], ["one", "fine", "three"]]
    assert "error: server answered 400: no, not this (the message was dropped" in capsys.readouterr().err


def test_the_socket_benches_daemon_takes_a_relative_model_and_leaves_nothing_behind(tmp_path, monkeypatch):
    """`edgerun bench socket|concurrent --model demob` from the directory holding demob: the daemon
    (started from the checkout) gets the path resolved; stopped, its temp dir is gone."""
    import shutil

    from edgerun.bench.serve_socket import over_health, start_daemon, stop_daemon
    from edgerun.engine.runner import DEMO_MODEL

    shutil.copytree(DEMO_MODEL, tmp_path / "demo")
    monkeypatch.chdir(tmp_path)
    daemon, sock = start_daemon(Path("demo"), 1, wait=120)
    assert daemon is not None and over_health(sock) == 200
    stop_daemon(daemon, sock)
    assert daemon.returncode == 0 and not sock.parent.exists()


def test_a_daemon_line_is_one_write(monkeypatch):
    """say() writes its line and newline at once: the request log's lines, written from another
    thread, cannot land between them (journald reads line by line)."""
    from edgerun.server.daemon import say

    writes = []
    monkeypatch.setattr(sys, "stderr", SimpleNamespace(write=writes.append, flush=lambda: None))
    say("ready: serving demo")
    assert writes == ["edgerun serve: ready: serving demo\n"]
