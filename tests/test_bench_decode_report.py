"""``edgerun bench decode``'s markdown report, from a result recorded on a GPU (docs/bench/)."""

import json
from pathlib import Path

from edgerun.bench.decode import markdown

RESULT = Path(__file__).parents[1] / "docs/bench/decode40_2026-12-05/fused_new.json"


def test_the_report_names_a_resident_steps_kernels_and_rate():
    result = json.loads(RESULT.read_text())
    text = markdown(result)
    assert "| resident | 256 | True | 0.03 | 539.2 (538.6-539.4) |" in text
    assert "resident: 325 kernels a step, 3,074 GPU us a step" in text
    del result["configs"][0]["profile"]  # a configuration not profiled (streamed) says nothing of it
    assert "kernels a step" not in markdown(result)


def test_the_report_names_each_place_of_a_layer_where_the_step_was_profiled():
    result = json.loads(
        (Path(__file__).parents[1] / "docs/bench/pick32_2026-12-07/dec/bench_decode.json").read_text()
    )
    text = markdown(result)
    assert (
        "1 (x29): qgemv 7.07, delta_decode 3.17, gated_norm 1.15, qgemv 4.90, qgemv 3.46, gate_up 6.46, down 5.09;"
        in text
    )
    assert "3 (x1): qgemv 86.50, greedy 8.64" in text


def test_a_kernels_chain_cost_is_what_the_step_waits_for_it():
    """With PDL a kernel starts before the one before it ends: each is charged only how far its
    end lies past the latest end before it, so the costs add up to the span."""
    from edgerun.bench.decode import chain_costs

    got = chain_costs([("a", 0.0, 5.0), ("b", 2.0, 9.0), ("a", 8.0, 10.0), ("c", 9.5, 9.8), ("b", 9.9, 12.0)])
    assert got == {
        "span_us": 12.0,
        "chain_us": {"a": 6.0, "b": 6.0, "c": 0.0},
        "chain_steps": [["a", 5.0], ["b", 4.0], ["a", 1.0], ["c", 0.0], ["b", 2.0]],
    }
    assert chain_costs([]) == {"span_us": 0.0, "chain_us": {}, "chain_steps": []}


def test_a_steps_chain_by_place_in_a_layer():
    """``chain_layers``: the chain cut after each MoE layer's last launch, layers of the same
    launch names grouped, each place summarised; on a synthetic chain and on a recorded 40-layer
    step (its 30 DeltaNet and 10 attention layers, the step's head and tail apart)."""
    from edgerun.bench.decode import chain_layers

    steps = [["t", 1.0], ["g", 2.0], ["d", 3.0], ["g", 4.0], ["d", 5.0], ["a", 6.0], ["d", 7.0], ["h", 8.0]]
    rows = chain_layers(steps, end="d")
    assert [(r["kind"], r["at"], r["kernel"], r["n"], r["median"], r["total"]) for r in rows] == [
        ("0 (x1)", 0, "t", 1, 1.0, 1.0),
        ("0 (x1)", 1, "g", 1, 2.0, 2.0),
        ("0 (x1)", 2, "d", 1, 3.0, 3.0),
        ("1 (x1)", 0, "g", 1, 4.0, 4.0),
        ("1 (x1)", 1, "d", 1, 5.0, 5.0),
        ("2 (x1)", 0, "a", 1, 6.0, 6.0),
        ("2 (x1)", 1, "d", 1, 7.0, 7.0),
        ("3 (x1)", 0, "h", 1, 8.0, 8.0),
    ]
    recorded = json.loads(
        (Path(__file__).parents[1] / "docs/bench/pick32_2026-12-07/call2/ab.json").read_text()
    )
    chain = recorded["rows"]["base"]["profile"]["chain_steps"]
    rows = chain_layers(chain)
    kinds = {r["kind"]: [] for r in rows}
    for r in rows:
        kinds[r["kind"]].append(r["kernel"])
    assert list(kinds) == [
        "0 (x1)",
        "1 (x29)",
        "2 (x10)",
        "3 (x1)",
    ]  # layer 0 carries the step's first kernels
    assert kinds["1 (x29)"][1:3] == ["_delta_decode_kernel", "_gated_norm_kernel"]
    assert kinds["2 (x10)"][1:3] == ["_attend_kernel", "_combine_kernel"]
    assert kinds["3 (x1)"] == ["_qgemv_kernel", "_greedy_kernel"]  # the lm_head and the pick
    in_proj = next(r for r in rows if r["kind"] == "1 (x29)" and r["at"] == 0)
    assert (in_proj["median"], in_proj["min"], in_proj["max"]) == (7.07, 6.5, 7.84)
    assert abs(sum(r["total"] for r in rows) - sum(v for _, v in chain)) < 0.5  # rounding of each total


STREAMED = Path(__file__).parents[1] / "docs/bench/stream_2026-12-06/run4.json"


def test_the_report_names_split_reads_in_the_calibration_and_each_streamed_row():
    text = markdown(json.loads(STREAMED.read_text()))
    assert "1: 2.22, 4: 1.89, 8: 1.68, 16: 1.50, 32: 1.71, 1x2: 1.73, 2x2: 2.15" in text
    assert "| 8 GiB, prefetch off, 2 piece(s) | 91 | True | 1.16 | 5.9 (5.8-5.9) | 192.3 |" in text


def test_a_streamed_sweep_runs_each_budget_at_each_depth_and_pieces(monkeypatch, tmp_path):
    """``--read-depth 2,4 --read-pieces 1,2``: each streamed budget runs at the four ways, each
    with its own plan prediction, the calibration measures split blocks for pieces 2 (not 1), and
    a layer's bursts are timed per way. The GPU parts are stand-ins: this checks the sweep's
    plumbing (what reaches run_config and the plan), which a GPU run would otherwise be first to try."""
    from types import SimpleNamespace

    import edgerun.bench.decode as D

    block = 1 << 20
    args = SimpleNamespace(
        num_hidden_layers=2, num_experts=16, num_experts_per_tok=2, hidden_size=64,
        moe_intermediate_size=32, vocab_size=100, moe_layers=[0, 1],
    )  # fmt: skip
    bundle = SimpleNamespace(
        args=args,
        layouts={0: SimpleNamespace(block_bytes=block), 1: SimpleNamespace(block_bytes=block)},
        manifest=SimpleNamespace(
            dense_quant=SimpleNamespace(scheme=SimpleNamespace(label=lambda: "int4 g32"))
        ),
        expert_path=lambda layer: tmp_path / f"L{layer}.bin",
    )
    monkeypatch.setattr(D, "prepare", lambda ns, name: (tmp_path, tmp_path / "b", 0.0, bundle))
    monkeypatch.setattr(D.torch.cuda, "get_device_name", lambda: "stand-in")
    calibrated = []

    def read_bandwidth(paths, bb, queue_depths=(1, 4, 8, 16, 32), seconds_per_depth=2.0, pieces=1):
        burst = 0.5 if not calibrated else 0.0  # the first shape of the first round reads in a burst
        calibrated.append(pieces if len(queue_depths) > 1 else (queue_depths[0], pieces))
        if len(queue_depths) == 1:  # a row's disk read around it: a rate of its own each time
            return [{"queue_depth": queue_depths[0], "pieces": pieces, "gb_per_s": len(calibrated) / 10}]
        return [
            {"queue_depth": d, "pieces": pieces, "gb_per_s": 1.0 + d / 100 + pieces / 10 + burst}
            for d in queue_depths
        ]

    monkeypatch.setattr(D.calibrate, "read_bandwidth", read_bandwidth)
    monkeypatch.setattr(
        D.calibrate,
        "device_copy_bandwidth",
        lambda dev: {
            "d2d_gb_per_s": 3000.0,
            "d2d_gb_per_s_range": [2990.0, 3010.0],
            "h2d_pinned_gb_per_s": 50.0,
        },
    )
    bursts = []
    monkeypatch.setattr(
        D.calibrate,
        "burst_seconds",
        lambda paths, bb, depth, pieces: bursts.append((depth, pieces)) or [{"reads": 1, "median_s": 1e-3}],
    )
    monkeypatch.setattr(D, "dense_bytes", lambda b: (1, 1))
    monkeypatch.setattr(D, "state_bytes", lambda b, c: (1, 1, 1))
    planned = []

    def planned_quota(budget, bundle_dir, capacity, bandwidths, reads, staging=None):
        planned.append((reads["read_depth"], reads["storage_read_single"], bandwidths[2], staging))
        pred = SimpleNamespace(
            misses_per_token=10.0, tok_s=5.0, tok_s_serial=4.0,
            tok_s_layered=reads["read_depth"] / 10 + bandwidths[2] / 1e9, tok_s_prefetch=6.0,
            prefetch_useful_per_token=7.0, prefetch_wasted_per_token=2.0,
        )  # fmt: skip
        return 8, "plan", SimpleNamespace(prediction=pred)

    monkeypatch.setattr(D, "planned_quota", planned_quota)
    ran, acts, policies = [], [], []

    def run_config(name, bundle_dir, b, quota, capacity, prompt, decode, timed, warm_all, depth, host, cpu,
                   pf, reader, staging, pieces, dense_act, expert_act, policy=None):  # fmt: skip
        ran.append((name, depth, pieces, pf))
        acts.append((dense_act, expert_act))
        policies.append(policy)
        med = {"median": 4.0, "min": 4.0, "max": 4.0}
        return {
            "config": name, "quota": quota, "tokens_identical": True, "decode_tps": med, "ttft_s": med,
            "misses_per_token": {"median": 10.0}, "read_gbs": med, "disk_busy": med, "busy_gbs": med,
            "busy_depth": {"median": 2.0 * depth * pieces - 0.25},
        }  # fmt: skip

    monkeypatch.setattr(D, "run_config", run_config)
    argv = ["--dir", str(tmp_path), "--budgets", "8", "--prefetch", "off", "--read-depth", "2,4"]
    assert D.main(argv + ["--read-pieces", "1,2", "--prompt", "4", "--decode", "4", "--repeats", "1"]) == 0
    # three rounds (the default), each shape once a round; then each streamed row's disk read at
    # the bound's shape (depth 32, whole blocks) right before and right after it
    assert calibrated == [1, 2] * 3 + [(32, 1)] * 8
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    assert [round(v, 2) for v in result["storage_read"][0]["gb_per_s_rounds"]] == [1.61, 1.11, 1.11]
    # the bound: the best shape by its median (depth 32, whole blocks, 1.42), not the burst's window
    assert round(result["storage_best_window"], 2) == 1.92
    assert round(result["configs"][0]["bound_tps"] * 10 * block / 1e9, 2) == 1.42
    assert round(result["configs"][0]["bound_tps_best_window"] * 10 * block / 1e9, 2) == 1.92
    assert [round(v, 2) for v in result["configs"][0]["storage_around"]] == [0.7, 0.8]
    assert round(result["configs"][0]["bound_tps_around"] * 10 * block / 1e9, 2) == 0.75  # their mean
    assert [round(v, 2) for v in result["configs"][3]["storage_around"]] == [1.3, 1.4]
    assert bursts == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert [(d, p) for _, d, p, _ in ran] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert acts == [("bf16", "bf16")] * 4  # --dense-act's and --expert-act's defaults reach every run
    assert [n for n, *_ in ran][1] == "8 GiB, prefetch off, depth 2, 2 piece(s)"
    # the quota's plan, then each row's own: its depth, a read alone at its pieces' depth 1, the
    # calibration's bound; and again with the disk as it read around the row (its mean), the read
    # alone scaled by as much
    single = {1: 1.11e9, 2: 1.21e9}
    around = [0.75, 0.95, 1.15, 1.35]
    expect = [(2, 1.11e9, 1.42e9, None)]
    for (d, p), gb_s in zip([(2, 1), (2, 2), (4, 1), (4, 2)], around, strict=True):
        expect += [(d, single[p], 1.42e9, None), (d, single[p] * gb_s / 1.42, gb_s * 1e9, None)]
    assert [tuple(round(v / 1e6) if v and v > 1e3 else v for v in r) for r in planned] == [
        tuple(round(v / 1e6) if v and v > 1e3 else v for v in r) for r in expect
    ]
    result = json.loads((tmp_path / "bench_decode.json").read_text())
    # prefetch off: each row judged by the layered model, at the calibration and at the disk around it
    assert [c["predicted"]["row_model"] for c in result["configs"]] == ["layered"] * 4
    assert [round(c["predicted"]["row_tok_s"], 2) for c in result["configs"]] == [1.62, 1.62, 1.82, 1.82]
    assert [round(c["predicted"]["around"]["row_tok_s"], 2) for c in result["configs"]] == [
        0.95,
        1.15,
        1.55,
        1.75,
    ]
    assert round(result["configs"][0]["predicted"]["around"]["row_error"], 4) == round(0.95 / 4.0 - 1, 4)
    # each streamed row says how many requests the disk had while busy (its own, not another row's)
    rows = [ln for ln in (tmp_path / "bench_decode.md").read_text().splitlines() if "| 400% |" in ln]
    assert [ln.split(" | ")[3] for ln in rows] == ["3.75", "7.75", "7.75", "15.75"]
    md = (tmp_path / "bench_decode.md").read_text()
    first = result["configs"][0]["predicted"]
    assert (
        f"| {first['row_tok_s']:.2f} ({100 * first['row_error']:+.0f}%, layered) | "
        f"0.95 ({100 * first['around']['row_error']:+.0f}%, layered) |" in md
    )
    acts.clear()
    quick = ["--read-pieces", "1", "--prompt", "4", "--decode", "4", "--repeats", "1"]
    assert D.main(argv + quick + ["--dense-act", "int8", "--expert-act", "int8"]) == 0
    assert acts == [("int8", "int8")] * 2  # both reach every run (one a depth)
    policies.clear()
    ran.clear()
    assert D.main(argv + quick + ["--cache-policy", "lfu,lfu-bypass"]) == 0
    assert policies == ["lfu", "lfu-bypass"] * 2  # each depth's run with each policy, named
    assert [n for n, *_ in ran][:2] == [
        "8 GiB, prefetch off, lfu, depth 2",
        "8 GiB, prefetch off, lfu-bypass, depth 2",
    ]


def test_a_row_is_judged_by_the_model_of_the_way_it_decodes():
    """A prefetch row beside the plan's prefetch model, a row without beside the layered one;
    each figure's error is its ratio to the measured rate less one."""
    from types import SimpleNamespace

    from edgerun.bench.decode import predicted_row

    pred = SimpleNamespace(
        misses_per_token=11.0, tok_s=8.0, tok_s_serial=3.0, tok_s_layered=4.0, tok_s_prefetch=6.0,
        prefetch_useful_per_token=7.0, prefetch_wasted_per_token=2.0,
    )  # fmt: skip
    rec = {"decode_tps": {"median": 5.0}, "misses_per_token": {"median": 10.0}}
    on, off = predicted_row(rec, pred, 1), predicted_row(rec, pred, 0)
    assert (on["row_model"], on["row_tok_s"], round(on["row_error"], 6)) == ("prefetch", 6.0, 0.2)
    assert (off["row_model"], off["row_tok_s"], round(off["row_error"], 6)) == ("layered", 4.0, -0.2)
    assert round(on["misses_error"], 6) == 0.1 and round(on["tok_s_error"], 6) == 0.6
    assert predicted_row(rec, pred, 2)["row_model"] == "prefetch"  # two ahead: the same model
