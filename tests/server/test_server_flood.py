"""What a flood of connections costs the daemon's loop, and who pays for long prompts (issue 19)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from edgerun.server.api import TOKENIZE_NICE, ApiOptions, App
from edgerun.server.http import Connection, Limits
from edgerun.server.metrics import Metrics


async def _flood(tmp_path, n: int, limits: Limits) -> tuple[int, list[bytes]]:
    """``n`` connections that never complete a request (every other one a started head):
    the tasks the server holds for them once they wait, and what each finally reads."""
    conns: list[Connection] = []

    async def accept(reader, writer) -> None:
        conn = Connection(reader, writer, None, limits, lambda: False, lambda path, status: None)
        conns.append(conn)
        await conn.run()

    path = str(tmp_path / "flood.sock")
    server = await asyncio.start_unix_server(accept, path, limit=limits.max_line)
    before = len(asyncio.all_tasks())
    clients = []
    for i in range(n):
        reader, writer = await asyncio.open_unix_connection(path)
        if i % 2:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nX-Slow: ")
        clients.append((reader, writer))
    while len(conns) < n or any(c.idle and not c.inp.head for c in conns[1::2]):
        await asyncio.sleep(0.01)  # every slow head has been read into
    await asyncio.sleep(0.05)
    tasks = len(asyncio.all_tasks()) - before
    answers = [await asyncio.wait_for(r.read(), 5) for r, _ in clients]
    for _, w in clients:
        w.close()
    server.close()
    await server.wait_closed()
    return tasks, answers


def test_a_connection_waiting_for_its_head_costs_one_task(tmp_path):
    """The header and read timeouts run in the connection's own task: a flood reopened as fast
    as the daemon closes it pays for one task per connection, not three (asyncio.wait_for on
    3.10-3.11 wraps each wait in a task of its own). The timeouts still answer: nothing for a
    connection that sent nothing, 408 for a head that never ended."""
    if sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout is 3.11+; 3.10 waits with wait_for")
    limits = Limits(header_timeout=0.3, read_timeout=5.0)
    tasks, answers = asyncio.run(_flood(tmp_path, 20, limits))
    assert tasks == 20
    assert all(a == b"" for a in answers[0::2])
    assert all(a.startswith(b"HTTP/1.1 408 ") and b"within 0.3 s" in a for a in answers[1::2])


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux only")
def test_prompts_are_tokenized_at_a_lower_priority_than_the_loop():
    app = App(None, Metrics(), ApiOptions())
    try:
        tid = threading.get_native_id()
        mine = os.getpriority(os.PRIO_PROCESS, tid)
        theirs = app.tokenizing.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        ).result(10)
        assert theirs == min(mine + TOKENIZE_NICE, 19)
        assert os.getpriority(os.PRIO_PROCESS, tid) == mine  # the loop's thread keeps its own
    finally:
        app.tokenizing.shutdown()
