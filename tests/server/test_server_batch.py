"""The daemon decoding requests together (issue 18), the demo model at batch 3: requests that join
and leave mid-stream get the tokens each gets alone; a client that disconnects frees its slot at
once for a queued request; SIGTERM drains a full batch (every request finishes); /metrics shows
the batch, queue waits and inter-token latencies."""

from __future__ import annotations

import json
import re
import signal
import threading
import time

import pytest
from server_helpers import Daemon, get, post, serve_argv

from edgerun.server.client import UnixHTTPConnection

BATCH = 3


class Stream:
    """A streamed completion read on a thread: its token ids, finish reason, and whether [DONE] came."""

    def __init__(self, sock, prompt: list[int], max_tokens: int) -> None:
        body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        self.conn = UnixHTTPConnection(sock, 60)
        self.conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({**body, "stream": True, "return_token_ids": True}).encode(),
        )
        self.resp = self.conn.getresponse()
        assert self.resp.status == 200
        self.ids: list[int] = []
        self.finish, self.done = None, False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.resp:
                if line.startswith(b"data: [DONE]"):
                    self.done = True
                elif line.startswith(b"data: "):
                    choice = json.loads(line[6:])["choices"][0]
                    self.ids += choice.get("token_ids", [])
                    self.finish = choice.get("finish_reason") or self.finish
        except (OSError, ValueError):
            pass  # the test hung up

    def wait_tokens(self, n: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.ids) < n:
            assert time.monotonic() < deadline, f"{len(self.ids)} of {n} tokens"
            time.sleep(0.005)

    def hang_up(self) -> None:
        """The client goes away mid-stream."""
        self.conn.sock.shutdown(2)
        self.join()
        self.conn.close()

    def join(self, timeout: float = 60.0) -> Stream:
        self.thread.join(timeout)
        assert not self.thread.is_alive()
        return self


def alone(sock, prompt: list[int], max_tokens: int) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    status, out = post(sock, "/v1/completions", {**body, "return_token_ids": True})
    assert status == 200, out
    return out["choices"][0]["token_ids"]


def metrics(sock) -> str:
    return get(sock, "/metrics")[1]


def value(text: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)} (\S+)$", text, re.M).group(1))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    sock = tmp_path_factory.mktemp("batch") / "edgerun.sock"
    d = Daemon(
        serve_argv("--socket", str(sock), "--device", "cpu", "--batch", str(BATCH), "--grace-period", "30"),
        sock,
    )
    d.wait_health()
    yield d
    d.stop()


def test_requests_joining_and_leaving_mid_stream_get_their_tokens_alone(daemon):
    sock = daemon.sock
    long = Stream(sock, [5, 17, 3, 44, 9], 60)
    long.wait_tokens(5)
    short = Stream(sock, [1, 2, 3], 8)  # joins mid-stream, leaves long before the first
    late = Stream(sock, [42, 42, 42, 7], 20)
    for s in (long, short, late):
        s.join()
        assert s.done and s.finish == "length"
    assert long.ids == alone(sock, [5, 17, 3, 44, 9], 60)
    assert short.ids == alone(sock, [1, 2, 3], 8)
    assert late.ids == alone(sock, [42, 42, 42, 7], 20)
    text = metrics(sock)
    steps = {
        int(k): float(n)
        for k, n in re.findall(r'^edgerun_batch_steps_total\{rows="(\d+)"\} (\S+)$', text, re.M)
    }
    assert steps[BATCH] > 0 and steps[1] > 0, steps  # full steps, and the first request's alone
    assert value(text, "edgerun_batch_capacity") == BATCH
    assert value(text, "edgerun_inter_token_seconds_count") > 60
    assert value(text, "edgerun_queue_wait_seconds_count") >= 6
    assert (
        "a 3-row batch step equals its rows' one-row steps, bit for bit (batch 3; torch kernels)"
        in daemon.log()
    )  # the start-up probe
    meta = get(sock, "/v1/models")[1]["data"][0]["edgerun"]
    assert meta["batch"] == BATCH and "batch: up to 3 requests decode together" in meta["provenance"]


def test_a_disconnected_client_frees_its_slot_for_a_queued_request(daemon):
    sock = daemon.sock
    before = metrics(sock)
    cancelled = float(
        re.search(r'^edgerun_requests_cancelled_total\{phase="decode"\} (\S+)$', before, re.M).group(1)
    )
    streams = [Stream(sock, [9, i + 1], 100_000 // 64) for i in range(BATCH)]  # the batch full, for a while
    for s in streams:
        s.wait_tokens(2)
    waiting = Stream(sock, [3, 4, 5], 5)  # queued: no slot
    time.sleep(0.3)
    assert waiting.ids == [] and value(metrics(sock), "edgerun_queue_depth") == 1
    streams[0].hang_up()
    t0 = time.monotonic()
    waiting.join(20)
    assert waiting.done and len(waiting.ids) == 5
    assert time.monotonic() - t0 < 10 and all(not s.done for s in streams[1:])  # long before they end
    text = metrics(sock)
    now = float(re.search(r'^edgerun_requests_cancelled_total\{phase="decode"\} (\S+)$', text, re.M).group(1))
    assert now == cancelled + 1
    for s in streams[1:]:
        s.hang_up()


def test_sigterm_drains_a_full_batch(daemon):
    sock = daemon.sock
    deadline = time.monotonic() + 20
    while value(metrics(sock), "edgerun_requests_running") > 0:  # the last test's clients, gone
        assert time.monotonic() < deadline
        time.sleep(0.05)
    streams = [Stream(sock, [11, i + 2, 7], 150) for i in range(BATCH)]
    for s in streams:
        s.wait_tokens(3)
    assert value(metrics(sock), "edgerun_batch_running") == BATCH
    daemon.proc.send_signal(signal.SIGTERM)
    assert daemon.proc.wait(60) == 0, daemon.log()
    for s in streams:
        s.join()
        assert s.done and s.finish == "length" and len(s.ids) == 150
