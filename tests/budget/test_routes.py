import json

import pytest

from edgerun.errors import ConfigError
from edgerun.models.registry import load_args
from edgerun.tools.routes import RouteTrace, RouteTraceWriter, TraceHeader, read_trace, write_trace
from hf_fixtures import QWEN3_MOE

HEADER = TraceHeader("tiny", "qwen3_moe", 3, (0, 2), 6, 2)


def test_round_trip(tmp_path):
    trace = RouteTrace(HEADER, (((0, 1), (5, 4)), ((2, 3), (4, 5))))
    write_trace(tmp_path / "t.jsonl", trace)
    back = read_trace(tmp_path / "t.jsonl")
    assert back.header == HEADER and back.tokens == trace.tokens
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["edgerun_route_trace"] == 1 and json.loads(lines[0])["top_k"] == 2
    assert json.loads(lines[1]) == {"experts": [[0, 1], [5, 4]]}


def test_predicted_experts_round_trip_and_are_checked(tmp_path):
    trace = RouteTrace(HEADER, (((0, 1), (5, 4)), ((2, 3), (4, 5))), predicted=(((4, 5),), None))
    write_trace(tmp_path / "t.jsonl", trace)
    assert read_trace(tmp_path / "t.jsonl").predicted == trace.predicted
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    assert json.loads(lines[1])["predicted"] == [[4, 5]]  # MoE layers after the first
    bad = tmp_path / "bad.jsonl"
    bad.write_text(lines[0] + "\n" + json.dumps({"experts": [[0, 1], [5, 4]], "predicted": [[4, 9]]}) + "\n")
    with pytest.raises(ConfigError, match="layer 2 must list 2 distinct expert ids in 0..5"):
        read_trace(bad)


def test_writer_streams_and_header_matches_model(tmp_path):
    _, args = load_args({**QWEN3_MOE, "model_type": "qwen3_moe"})
    header = TraceHeader.for_model(args, "tiny")
    assert header == HEADER
    with RouteTraceWriter(tmp_path / "t.jsonl", header) as w:
        w.add([[1, 2], [3, 4]], seq=0)
        w.add([[1, 5], [3, 0]], seq=1)
    assert w.count == 2
    trace = read_trace(tmp_path / "t.jsonl")
    assert trace.tokens[1] == ((1, 5), (3, 0))
    trace.header.check_matches(args)


def test_mismatched_model_is_refused():
    _, args = load_args({**QWEN3_MOE, "model_type": "qwen3_moe", "num_experts": 8})
    with pytest.raises(ConfigError, match="trace num_experts is 6 but the model's is 8"):
        HEADER.check_matches(args, "t.jsonl")


def _write(path, header, *lines):
    path.write_text("\n".join([json.dumps(header), *lines]) + "\n")


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"experts": [[0, 1]]}', "t.jsonl:2: 'experts' must hold 2 lists"),
        ('{"experts": [[0, 1], [4, 6]]}', "t.jsonl:2: layer 2 must list 2 distinct expert ids in 0..5"),
        ('{"experts": [[0, 0], [4, 5]]}', "layer 0 must list 2 distinct"),
        ('{"experts": [[0], [4, 5]]}', "layer 0 must list 2 distinct"),
        ("{not json", "t.jsonl:2: not valid JSON"),
    ],
)
def test_bad_token_lines_name_the_line(tmp_path, line, message):
    _write(tmp_path / "t.jsonl", HEADER.to_dict(), line)
    with pytest.raises(ConfigError, match=message):
        read_trace(tmp_path / "t.jsonl")


def test_bad_headers(tmp_path):
    p = tmp_path / "t.jsonl"
    _write(p, {"experts": [[0, 1]]})
    with pytest.raises(ConfigError, match="t.jsonl:1: not an edgerun route trace header"):
        read_trace(p)
    _write(p, {**HEADER.to_dict(), "edgerun_route_trace": 2})
    with pytest.raises(ConfigError, match="version 2 is not supported"):
        read_trace(p)
    _write(p, {**HEADER.to_dict(), "top_k": 0})
    with pytest.raises(ConfigError, match=r"header key 'top_k' must be an integer in 1\.\.65536, got 0"):
        read_trace(p)
    p.write_text("\n")
    with pytest.raises(ConfigError, match="empty route trace"):
        read_trace(p)
    with pytest.raises(ConfigError, match="route trace not found"):
        read_trace(tmp_path / "missing.jsonl")
