"""The daemon's lifecycle: readiness over a fake NOTIFY_SOCKET, /health while loading, 429, timeouts,
engine errors and engine death, SIGTERM draining, a long prefill, a flood of connections, socket
activation and stale sockets."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_engine import DIE, FATAL, HANG, RAISE, SLOW
from server_helpers import ROOT, Daemon, get, post, serve_argv

from edgerun.engine.runner import DEMO_MODEL
from edgerun.server.client import UnixHTTPConnection

FAKE = Path(__file__).with_name("fake_daemon.py")


class NotifySocket:
    """What systemd would receive: every sd_notify datagram, with its arrival order."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        self.messages: list[str] = []

    def poll(self) -> list[str]:
        while True:
            try:
                self.messages += self.sock.recv(4096).decode().split("\n")
            except BlockingIOError:
                return self.messages

    def wait_for(self, text: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.poll():
            assert time.monotonic() < deadline, f"no {text!r} in {self.messages}"
            time.sleep(0.02)


def fake_argv(sock: Path, *args: str) -> list[str]:
    return [sys.executable, str(FAKE), "--socket", str(sock), *args]


def open_stream(sock: Path, body: dict):
    conn = UnixHTTPConnection(sock, 30)
    conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": True}).encode())
    resp = conn.getresponse()
    return conn, resp


def metric(sock: Path, name: str) -> float:
    text = get(sock, "/metrics")[1]
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


# ---- the real daemon: READY=1 only after loading, WATCHDOG=1, STOPPING=1, SIGTERM drains -----------


def test_real_daemon_notifies_and_drains_on_sigterm(served_model, tmp_path):
    notify = NotifySocket(tmp_path / "notify")
    sock = tmp_path / "edgerun.sock"
    grace = 2.0
    model = [] if (DEMO_MODEL / "config.json").is_file() else ["--model", str(served_model)]
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "800000"}
    daemon = Daemon(
        serve_argv(*model, "--socket", str(sock), "--device", "cpu", "--grace-period", str(grace), "-v"),
        sock,
        env,
    )
    try:
        saw_loading = False
        deadline = time.monotonic() + 60
        while True:
            assert time.monotonic() < deadline and daemon.proc.poll() is None, daemon.log()
            before = list(notify.poll())
            try:
                status, body = get(sock, "/health")
            except OSError:
                continue
            if status == 503:
                assert body["status"] == "loading" and "READY=1" not in before
                saw_loading = True
            if status == 200:
                break
            time.sleep(0.02)
        notify.wait_for("READY=1")
        assert any(m.startswith("STATUS=loading model") for m in notify.messages)
        assert saw_loading or "READY=1" in notify.messages
        notify.wait_for("WATCHDOG=1", timeout=5)

        body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        conn, resp = open_stream(sock, body)
        assert resp.status == 200 and resp.readline().startswith(b"data: ")
        events = []
        reader = threading.Thread(target=lambda: events.extend(resp.read().split(b"\n\n")))
        reader.start()
        t0 = time.monotonic()
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(grace + 10) == 0, daemon.log()
        elapsed = time.monotonic() - t0
        reader.join(10)
        assert elapsed < grace + 3, f"took {elapsed:.1f} s to exit with a {grace} s grace period"
        notify.wait_for("STOPPING=1")
        assert events and b"data: [DONE]" in events  # finished in time, or told why it stopped
        assert not sock.exists()
        log = daemon.log()
        assert re.search(r"edgerun serve: GET /health -> 200 in \d+\.\d{3} s \(uid \d+\)", log), log  # -v
        assert "edgerun serve: POST /v1/completions -> 200 in " in log
        # the start-up line, readable: a few short lines
        start = log[log.index("edgerun serve: model ") :].splitlines()
        assert start[1].startswith("  device cpu, dtype float32, threads ") and start[4].startswith(
            "  fallbacks:"
        )
    finally:
        daemon.stop()


def test_a_long_prefill_feeds_the_watchdog_and_stops_for_a_disconnect_and_sigterm(tmp_path):
    """Item 9: the engine pings WATCHDOG=1 between prefill chunks (a prefill longer than
    WatchdogSec is not killed), and a prefill stops at the next chunk when its client leaves or
    the grace period after SIGTERM ends."""
    notify = NotifySocket(tmp_path / "notify")
    sock = tmp_path / "prefill.sock"
    argv = serve_argv("--socket", str(sock), "--device", "cpu", "--threads", "1")
    argv += ["--prefill-chunk", "4", "--grace-period", "0.2"]
    daemon = Daemon(argv, sock, {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "600000"})
    body = {"prompt": [5 + i % 50 for i in range(1500)], "max_tokens": 1}  # seconds of prefill
    try:
        daemon.wait_health(200)
        notify.wait_for("WATCHDOG=1")
        request = threading.Thread(target=post, args=(sock, "/v1/completions", body))
        pings = [time.monotonic()]
        request.start()
        while request.is_alive():
            if notify.poll().count("WATCHDOG=1") + 1 > len(pings):
                pings.append(time.monotonic())
            time.sleep(0.005)
        pings.append(time.monotonic())
        assert pings[-1] - pings[0] > 1.0, "the prefill was too short to test"
        assert max(b - a for a, b in zip(pings, pings[1:])) < 0.6, "WatchdogSec passed without a ping"

        in_prefill = 'edgerun_requests_cancelled_total{phase="prefill"}'
        cancelled, prompt = metric(sock, in_prefill), metric(sock, "edgerun_prompt_tokens_total")
        conn, resp = open_stream(sock, body)
        time.sleep(0.5)  # prefilling
        conn.close()
        t0 = time.monotonic()
        while metric(sock, "edgerun_requests_running"):
            assert time.monotonic() - t0 < 1.0, "the prefill went on after its client left"
            time.sleep(0.01)
        assert metric(sock, in_prefill) == cancelled + 1
        ran = metric(sock, "edgerun_prompt_tokens_total") - prompt  # whole chunks of 4, not the prompt
        assert 0 < ran < len(body["prompt"]) and ran % 4 == 0, ran
        assert f"cancelled in prefill after {ran:.0f} of 1500 prompt tokens" in daemon.log()

        request = threading.Thread(target=post, args=(sock, "/v1/completions", body))
        request.start()
        time.sleep(0.5)
        daemon.proc.send_signal(signal.SIGTERM)
        assert daemon.proc.wait(10) == 0
        request.join(10)
        stopped = float(re.search(r"stopped in ([0-9.]+) s", daemon.log()).group(1))
        assert stopped < 1.0, daemon.log()  # the grace period, then one chunk
        stops = re.findall(r"cancelled in prefill after (\d+) of 1500 prompt tokens", daemon.log())
        assert len(stops) == 2 and 0 < int(stops[1]) < 1500, daemon.log()  # the disconnect, then SIGTERM
    finally:
        daemon.stop()


# ---- a scripted engine: loading, queue full, timeouts, engine errors ------------------------------


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    d = tmp_path_factory.mktemp("fake")
    sock = d / "fake.sock"
    proc = Daemon(fake_argv(sock, "--load-delay", "1.5", "--queue-size", "1", "--request-timeout", "2"), sock)
    yield proc
    assert proc.stop() == 0, proc.log()


def test_loading_answers_503_then_ready(fake):
    deadline = time.monotonic() + 30
    while not fake.sock.exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status, body = get(fake.sock, "/health")
    if status == 503:  # (unless this test ran after the others)
        assert body["status"] == "loading"
        conn = UnixHTTPConnection(fake.sock, 10)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200 or resp.getheader("Retry-After") == "1"  # loading: ask again
        conn.request("POST", "/v1/completions", body=b'{"prompt": [1]}')
        resp = conn.getresponse()
        assert resp.status == 503 and resp.getheader("Retry-After") == "1"
        assert "loading" in json.loads(resp.read())["error"]["message"]
    fake.wait_health(200)


def test_queue_full_is_429_with_retry_after(fake):
    fake.wait_health(200)
    a = open_stream(fake.sock, {"prompt": [SLOW, 1], "max_tokens": 30, "return_token_ids": True})
    assert a[1].readline().startswith(b"data: ")  # running
    b = open_stream(fake.sock, {"prompt": [SLOW, 2], "max_tokens": 30})  # waiting in the queue
    assert metric(fake.sock, "edgerun_queue_depth") == 1
    conn = UnixHTTPConnection(fake.sock, 10)
    conn.request("POST", "/v1/completions", body=b'{"prompt": [1], "max_tokens": 2}')
    resp = conn.getresponse()
    assert resp.status == 429 and resp.getheader("Retry-After") == "1"
    assert "busy" in json.loads(resp.read())["error"]["message"]
    for c, r in (a, b):
        r.close()
        c.close()
    deadline = time.monotonic() + 10
    while metric(fake.sock, "edgerun_requests_running") or metric(fake.sock, "edgerun_queue_depth"):
        assert time.monotonic() < deadline, "slots not freed after the clients left"
        time.sleep(0.05)
    assert post(fake.sock, "/v1/completions", {"prompt": [1], "max_tokens": 2})[0] == 200


def test_stream_chunks_arrive_as_tokens_do(fake):
    fake.wait_health(200)
    t0 = time.monotonic()
    conn, resp = open_stream(fake.sock, {"prompt": [SLOW, 1], "max_tokens": 10, "return_token_ids": True})
    arrivals, ids = [], []
    for line in resp:
        if line.startswith(b"data: {"):
            arrivals.append(time.monotonic() - t0)
            ids += json.loads(line[6:])["choices"][0].get("token_ids", [])
    conn.close()
    assert ids == [(1 + i + 1) % 97 for i in range(10)]
    # a token every 50 ms: each goes out on its own (the 20 ms write window holds none back long)
    assert len(arrivals) >= 8 and arrivals[0] < arrivals[-1] - 0.3


def test_request_timeout(fake):
    fake.wait_health(200)
    t0 = time.monotonic()
    status, body = post(fake.sock, "/v1/completions", {"prompt": [SLOW, 1], "max_tokens": 60})
    assert status == 504 and "timeout of 2 s" in body["error"]["message"]
    assert time.monotonic() - t0 < 5
    conn, resp = open_stream(fake.sock, {"prompt": [SLOW, 1], "max_tokens": 60})
    events = resp.read().split(b"\n\n")
    conn.close()
    assert b'"timeout"' in events[-3] and events[-2] == b"data: [DONE]"
    deadline = time.monotonic() + 5
    while metric(fake.sock, "edgerun_requests_running"):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_engine_error_fails_only_that_request(fake):
    fake.wait_health(200)
    status, body = post(fake.sock, "/v1/completions", {"prompt": [RAISE], "max_tokens": 3})
    message = body["error"]["message"]
    assert status == 500 and "injected engine error reading L03.bin" in message
    assert "/srv/edgerun" not in message  # a server error names files, not the daemon's layout
    assert get(fake.sock, "/health")[0] == 200
    status, body = post(fake.sock, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3})
    assert status == 200 and body["usage"]["completion_tokens"] == 3


def test_engine_stats_feed_metrics(fake):
    fake.wait_health(200)
    text = get(fake.sock, "/metrics")[1]
    assert 'edgerun_fallbacks_total{kind="cpu_reference"} 2' in text
    assert 'edgerun_expert_bytes_read_total{layer="0",experts="fake"} 4096' in text
    assert "edgerun_request_failures_total 1" in text


def test_prompts_are_measured_before_and_tokenized_off_the_event_loop(tmp_path):
    """A prompt that takes 1.5 s to tokenize does not hold up /health; one whose bytes cannot
    fit the context (64 tokens, a byte per token) is refused without being tokenized."""
    sock = tmp_path / "tok.sock"
    daemon = Daemon(fake_argv(sock, "--tokenize-s", "1.5"), sock)
    try:
        daemon.wait_health(200)
        t0 = time.monotonic()
        status, body = post(sock, "/v1/completions", {"prompt": "x" * 300, "max_tokens": 2})
        assert status == 400 and time.monotonic() - t0 < 1.0
        assert body["error"]["code"] == "context_length_exceeded" and "300 bytes" in body["error"]["message"]
        slow = threading.Thread(
            target=post, args=(sock, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
        )
        slow.start()
        time.sleep(0.3)  # tokenizing now
        t0 = time.monotonic()
        assert get(sock, "/health")[0] == 200
        assert time.monotonic() - t0 < 0.5
        slow.join(10)
    finally:
        daemon.stop()


@pytest.mark.parametrize("engine_process", ["on", "off"])
def test_dead_engine_reports_failed_and_exits_nonzero(tmp_path, engine_process):
    notify = NotifySocket(tmp_path / "notify")
    sock = tmp_path / "fatal.sock"
    argv = fake_argv(sock, "--engine-process", engine_process)
    daemon = Daemon(argv, sock, {"NOTIFY_SOCKET": str(notify.path)})
    try:
        daemon.wait_health(200)
        status, body = post(sock, "/v1/completions", {"prompt": [FATAL], "max_tokens": 3})
        assert status == 500 and "engine failed" in body["error"]["message"]
        status, body = get(sock, "/health")
        assert status == 503 and body["status"] == "failed" and "device is lost" in body["message"]
        assert daemon.proc.wait(10) == 1
        notify.wait_for("STOPPING=1")
        assert any("engine failed" in m for m in notify.messages if m.startswith("STATUS="))
    finally:
        daemon.stop()


def test_a_killed_engine_process_fails_the_engine_and_stops_the_watchdog(tmp_path):
    """The engine's process killed (SIGKILL, as the OOM killer does) mid-request: the request
    fails with 500, /health says failed and why, the watchdog pings stop, and the daemon exits
    1 (restarted) within a second or two, never hanging on the dead child."""
    notify = NotifySocket(tmp_path / "notify")
    sock = tmp_path / "die.sock"
    daemon = Daemon(fake_argv(sock), sock, {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"})
    try:
        daemon.wait_health(200)
        notify.wait_for("WATCHDOG=1", timeout=5)
        child = re.search(r"engine in a process of its own \(pid (\d+)", daemon.log())
        assert child is not None, daemon.log()
        status, body = post(sock, "/v1/completions", {"prompt": [DIE], "max_tokens": 3})
        assert status == 500 and "died: killed by SIGKILL" in body["error"]["message"], body
        pings = notify.poll().count("WATCHDOG=1")
        status, body = get(sock, "/health")
        assert status == 503 and body["status"] == "failed", body
        assert f"the engine process (pid {child.group(1)}) died: killed by SIGKILL" in body["message"]
        assert daemon.proc.wait(10) == 1
        assert notify.poll().count("WATCHDOG=1") == pings, "pinged after the engine died"
        notify.wait_for("STOPPING=1")
    finally:
        daemon.stop()


def test_the_engine_process_dies_with_the_daemon(tmp_path):
    """A daemon killed outright (SIGKILL: no drain, no stop message) leaves no engine process."""
    sock = tmp_path / "orphan.sock"
    daemon = Daemon(fake_argv(sock), sock)
    try:
        daemon.wait_health(200)
        child = int(re.search(r"engine in a process of its own \(pid (\d+)", daemon.log()).group(1))
        os.kill(child, 0)  # alive
        daemon.proc.kill()
        daemon.proc.wait(5)
        deadline = time.monotonic() + 5
        while _alive(child):
            assert time.monotonic() < deadline, f"engine process {child} outlived its daemon"
            time.sleep(0.05)
    finally:
        daemon.stop()


def test_a_closed_terminals_sighup_drains_the_daemon_and_spares_its_engine(tmp_path):
    """A terminal that closes sends SIGHUP to its process group: the engine process ignores it,
    and the daemon stops as for SIGTERM (a drain, exit 0, its socket removed), not at once."""
    sock = tmp_path / "hup.sock"
    daemon = Daemon(fake_argv(sock), sock)
    try:
        daemon.wait_health(200)
        child = int(re.search(r"engine in a process of its own \(pid (\d+)", daemon.log()).group(1))
        os.kill(child, signal.SIGHUP)
        time.sleep(0.3)
        assert _alive(child) and get(sock, "/health")[0] == 200
        daemon.proc.send_signal(signal.SIGHUP)
        assert daemon.proc.wait(15) == 0, daemon.log()
        assert "signal SIGHUP" in daemon.log() and not sock.exists()
    finally:
        daemon.stop()


def test_a_daemon_whose_stderr_closed_still_stops_on_sigterm(tmp_path):
    """`edgerun serve ... 2>&1 | head -3`: once nobody reads its messages, the daemon serves on,
    and SIGTERM still drains it, stops its engine and removes its socket."""
    import subprocess

    sock = tmp_path / "pipe.sock"
    proc = subprocess.Popen(fake_argv(sock), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        proc.stderr.readline()
        proc.stderr.close()  # the reader went away
        deadline = time.monotonic() + 30
        while True:
            assert time.monotonic() < deadline and proc.poll() is None
            try:
                if get(sock, "/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0 and not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:  # a zombie (killed, not yet reaped by init) counts as gone
        return open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("engine_process", ["on", "off"])
def test_a_hung_engine_stops_the_watchdog_pings(tmp_path, engine_process):
    """WATCHDOG=1 comes from the engine thread (and only while the loop is alive too), so an
    engine stuck in a step stops the pings and systemd's WatchdogSec restarts the service; the
    pings resume once the step returns."""
    notify = NotifySocket(tmp_path / "notify")
    sock = tmp_path / "hang.sock"
    daemon = Daemon(
        fake_argv(sock, "--engine-process", engine_process),
        sock,
        {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"},
    )
    try:
        daemon.wait_health(200)
        notify.wait_for("WATCHDOG=1", timeout=5)
        done = threading.Thread(
            target=post, args=(sock, "/v1/completions", {"prompt": [HANG], "max_tokens": 2})
        )
        done.start()
        time.sleep(1.0)  # the engine is inside the 4 s step now
        before = notify.poll().count("WATCHDOG=1")
        time.sleep(2.0)  # five watchdog periods of 0.4 s
        assert notify.poll().count("WATCHDOG=1") == before, "pinged while the engine was stuck"
        done.join(10)
        deadline = time.monotonic() + 5
        while notify.poll().count("WATCHDOG=1") == before:
            assert time.monotonic() < deadline, "pings did not resume after the step returned"
            time.sleep(0.05)
    finally:
        daemon.stop()


def test_load_failure_exits_nonzero(tmp_path):
    sock = tmp_path / "bad.sock"
    daemon = Daemon(fake_argv(sock, "--load-error", "no such weights"), sock)
    try:
        assert daemon.proc.wait(30) == 1
        assert "loading the model failed: RuntimeError: no such weights" in daemon.log()
    finally:
        daemon.stop()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_a_cuda_device_not_there_exits_1_to_be_restarted(tmp_path):
    """No CUDA device (at boot, before the driver is up) is no configuration error: exit 1, which
    systemd restarts (RestartPreventExitStatus=2 keeps exit 2 for a bad serve.yaml)."""
    sock = tmp_path / "nocuda.sock"
    daemon = Daemon(serve_argv("--socket", str(sock), "--device", "cuda"), sock)
    try:
        assert daemon.proc.wait(60) == 1
        assert "no CUDA device is available" in daemon.log()
    finally:
        daemon.stop()


def test_a_flood_of_idle_and_slow_connections_leaves_health_answering(tmp_path):
    """300 connections from one uid that never complete a request: the daemon keeps at most
    max_connections_per_uid (64) of them, closing the longest-waiting for each newcomer, and
    closes the rest after header_timeout; /health answers at once throughout."""
    sock = tmp_path / "flood.sock"
    daemon = Daemon(fake_argv(sock, "--header-timeout", "2"), sock)
    flood = []
    try:
        daemon.wait_health(200)
        for i in range(300):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(sock))
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")  # a head that never ends
            flood.append(s)
        for _ in range(5):
            t0 = time.monotonic()
            assert get(sock, "/health")[0] == 200
            assert time.monotonic() - t0 < 1.0
        time.sleep(0.2)
        still_open = sum(not _closed(s) for s in flood)
        assert still_open <= 64
        assert metric(sock, 'edgerun_connections_closed_total{reason="evicted"}') >= 300 - 64
        time.sleep(2.5)  # past header_timeout: the rest are closed, a started head with a 408
        answers = [_read_all(s) for s in flood]
        assert any(a.startswith(b"HTTP/1.1 408") for a in answers)
        assert all(a == b"" or a.startswith(b"HTTP/1.1 408") for a in answers)
        for s in flood:
            s.close()
        deadline = time.monotonic() + 5
        while metric(sock, "edgerun_connections_open") > 1:  # 1: the one asking
            assert time.monotonic() < deadline, "the daemon still holds flood connections"
            time.sleep(0.05)
    finally:
        for s in flood:
            s.close()
        daemon.stop()


def _closed(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False


def _read_all(s: socket.socket) -> bytes:
    s.settimeout(5)
    return b"".join(iter(lambda: s.recv(65536), b""))


# ---- the socket: systemd's (activation), a dead daemon's (replaced), a live one's (refused) --------


def test_socket_activation_serves_on_fd_3(tmp_path):
    path = tmp_path / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    fd = listener.fileno()
    # as systemd does: the socket on fd 3, LISTEN_PID naming the process that execs the daemon
    shim = (
        f"import os, sys; os.dup2({fd}, 3); os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    argv = [sys.executable, "-c", shim, *fake_argv(tmp_path / "unused.sock")]
    daemon = Daemon(argv, path, pass_fds=(fd,))
    listener.close()
    try:
        daemon.wait_health(200, timeout=30)
        assert not (tmp_path / "unused.sock").exists()
        # the --socket it was given applies to nothing under activation, and it says so
        assert "serving the socket systemd passed (fd 3)" in daemon.log()
    finally:
        assert daemon.stop() == 0
    assert path.exists()  # systemd's socket: not ours to remove


def test_stale_socket_is_replaced_and_a_live_one_is_not(tmp_path):
    sock = tmp_path / "s.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock))
    stale.close()  # the file stays; nobody listens: a dead daemon's
    first = Daemon(fake_argv(sock), sock)
    try:
        first.wait_health(200, timeout=30)
        second = Daemon(fake_argv(sock), sock.with_name("s2.sock"))
        assert second.proc.wait(30) == 2
        second.stop()
        assert "another daemon is already serving" in second.log()
        assert get(sock, "/health")[0] == 200
    finally:
        assert first.stop() == 0
    assert not sock.exists()
