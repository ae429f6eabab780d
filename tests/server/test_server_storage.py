"""A real daemon streaming a bundle that is damaged under it: the request that meets the damage
fails with the file, layer and offset named, the engine is marked failed (/health 503, counted
in /metrics, the watchdog no longer fed) while the daemon stays up, and a restart refuses a
truncated bundle by name."""

from __future__ import annotations

import os
import re
import shutil
import time

import pytest
from server_helpers import Daemon, get, post, serve_argv
from test_server_lifecycle import NotifySocket

from edgerun.bundle.convert import ConvertOptions, convert
from edgerun.bundle.reader import Bundle


@pytest.fixture(scope="module")
def bundle(served_model, tmp_path_factory):
    dst = tmp_path_factory.mktemp("storage-bundle") / "b"
    convert(served_model, dst, ConvertOptions("bf16"))
    return dst


def _serve(path, sock, notify=None) -> Daemon:
    argv = serve_argv("--model", str(path), "--quota", "2", "--socket", str(sock), "--device", "cpu")
    env = {"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"} if notify else None
    return Daemon(argv, sock, env)


@pytest.mark.parametrize("damage", ["truncate", "overwrite"])
def test_a_storage_fault_fails_the_engine_and_a_restart_refuses_the_bundle(bundle, tmp_path, damage):
    path = tmp_path / "b"
    shutil.copytree(bundle, path)
    b = Bundle.open(path)
    layer = b.args.moe_layers[-1]
    f = b.expert_path(layer)
    notify, sock = NotifySocket(tmp_path / "notify"), tmp_path / "s.sock"
    d = _serve(path, sock, notify)
    try:
        d.wait_health(200)
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0}
        assert post(sock, "/v1/completions", body)[0] == 200
        if damage == "truncate":
            os.truncate(f, 0)
        else:
            f.write_bytes(b"\x77" * f.stat().st_size)  # in place: same file, other bytes
        status, answer = post(sock, "/v1/completions", {**body, "prompt": [9, 10, 11, 12, 13]})
        # 5xx bodies and /health name the file without its directories (the log has it whole)
        named = rf"(?<![/\w]){f.name}: (short read of expert \d+'s block at offset \d+|layer {layer} expert \d+'s block \(bytes \[\d+, \d+\)\) fails its checksum)"
        assert status == 500 and re.search(named, answer["error"]["message"]), answer
        status, health = get(sock, "/health")
        assert status == 503 and health["status"] == "failed" and re.search(named, health["message"])
        faults = dict(
            re.findall(
                r'^edgerun_expert_read_faults_total\{kind="(\w+)"\} (\d+)$', get(sock, "/metrics")[1], re.M
            )
        )
        if damage == "truncate":
            assert int(faults["io"]) >= 1 and faults["checksum"] == faults["reread"] == "0"
        else:
            assert int(faults["reread"]) >= int(faults["checksum"]) >= 1 and faults["io"] == "0"
        pings = notify.poll().count("WATCHDOG=1")
        time.sleep(1.5)  # past the moment an engine failure of another kind exits the process
        assert d.proc.poll() is None, "a storage fault ended the daemon"
        assert notify.poll().count("WATCHDOG=1") == pings, "the watchdog was fed after the storage fault"
        assert post(sock, "/v1/completions", body)[0] == 503
    finally:
        assert d.stop() == 1, d.log()
    if damage == "truncate":  # what systemd's restart meets: refused by name, not restarted again
        again = _serve(path, tmp_path / "again.sock")
        try:
            assert again.proc.wait(60) == 2
            assert f"{f}: truncated expert file: 0 bytes" in again.log()
        finally:
            again.stop()
