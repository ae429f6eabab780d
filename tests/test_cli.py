import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from edgerun.cli import build_parser, main
from edgerun.engine.runner import Runner
from edgerun.engine.sampler import SamplingParams


def test_generate_token_ids_matches_runner(hf_checkpoints, capsys):
    ckpt = hf_checkpoints["qwen3_moe"][1]
    assert (
        main(
            ["generate", "--model", str(ckpt), "--token-ids", "3,4,5", "--max-tokens", "6", "--device", "cpu"]
        )
        == 0
    )
    out, err = capsys.readouterr()
    expected = Runner.load(ckpt, device="cpu").generate_ids([3, 4, 5], SamplingParams(max_tokens=6))
    assert out.split() == [str(t) for t in expected]
    assert "edgerun generate: model" in err and "fallbacks: none" in err  # provenance line
    assert "prompt 3 tok, generated 6 tok" in err and "decode" in err and "peak memory" in err
    # TTFT and the prefill rate, apart from the decode rate
    line = re.search(r"TTFT (\d+) ms, prefill ([0-9.]+) tok/s, decode ([0-9.]+) tok/s", err)
    assert line and float(line.group(2)) > 0 and float(line.group(3)) > 0, err


def test_generate_errors_are_one_clear_line(hf_checkpoints, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "hi"]) == 2
    assert "no config.json found" in capsys.readouterr().err
    ckpt = hf_checkpoints["qwen3_moe"][1]
    assert main(["generate", "--model", str(ckpt), "--token-ids", "1,500", "--device", "cpu"]) == 2
    assert "token id 500 is outside the vocabulary" in capsys.readouterr().err
    assert (
        main(
            ["generate", "--model", str(ckpt), "--token-ids", "1", "--max-tokens", "1000", "--device", "cpu"]
        )
        == 2
    )
    assert "exceeds the context of 512 tokens" in capsys.readouterr().err


def test_console_entry_point_runs():
    res = subprocess.run([sys.executable, "-m", "edgerun.cli", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "generate" in res.stdout


def test_bench_lists_the_benchmarks_and_runs_one(capsys, tmp_path):
    import torch

    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("decode:", "streaming:", "socket:"))
    with pytest.raises(SystemExit) as exc:
        main(["bench", "streaming", "--help"])  # the benchmark's own options
    assert exc.value.code == 0 and "--workdir" in capsys.readouterr().out
    if not torch.cuda.is_available():
        assert main(["bench", "decode", "--dir", str(tmp_path)]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err
        assert list(tmp_path.iterdir()) == []  # refused before writing anything


def test_version_module_entry_and_help_defaults():
    """``edgerun --version``, ``python -m edgerun``, and every option's default in its help."""
    from edgerun import __version__

    run = [sys.executable, "-m", "edgerun"]
    out = subprocess.run([*run, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"edgerun {__version__}"
    out = subprocess.run([*run, "generate", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    assert "--prefill-chunk PREFILL_CHUNK prompt tokens a prefill step takes at once (default: 512)" in text
    assert "(0: all) (default: 0)" in text  # a zero default is still shown
    assert "(default: None)" not in text and "(default: )" not in text


def test_an_unknown_flag_gets_the_subcommands_usage_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--bogus", "hi"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: edgerun generate") and "unrecognized arguments: --bogus" in err


def test_generate_over_a_socket_refuses_flags_the_daemon_would_ignore(tmp_path, capsys):
    argv = ["generate", "--socket", str(tmp_path / "s.sock"), "--model", str(tmp_path), "--quota", "4", "hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--model, --quota would be ignored" in err and "drop them, or drop --socket" in err
    assert main([*argv, "--device", "cpu"]) == 2  # one name per setting, though it has two spellings
    assert "--model, --device, --quota would be ignored" in capsys.readouterr().err


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_cli_makes_idle_openmp_threads_sleep_unless_the_user_chose(preset):
    """OMP_WAIT_POLICY is read when torch loads OpenMP: the CLI sets PASSIVE first (a user's value
    wins), so a decode beside other busy processes does not spin its threads against them."""
    code = (
        "import os, sys\n"
        "from edgerun.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | (
        {"OMP_WAIT_POLICY": preset} if preset else {}
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split()[-2:] == [preset or "PASSIVE", "False"], out.stdout + out.stderr


def test_a_small_model_gets_one_cpu_thread_unless_asked(hf_checkpoints, capsys):
    """Tiny models decode fastest on one thread, idle or loaded (benchmarks/threads_under_load.py):
    chosen and said so in the start-up line; --threads wins."""
    import torch

    ckpt = hf_checkpoints["qwen3_moe"][1]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        argv = ["generate", "--model", str(ckpt), "--token-ids", "3", "--max-tokens", "1", "--device", "cpu"]
        assert main(argv) == 0
        assert (
            "threads 1 (a small model decodes fastest on one thread; --threads sets it)"
            in capsys.readouterr().err
        )
        assert main([*argv, "--threads", "2"]) == 0
        err = capsys.readouterr().err
        assert "threads 2; cpu " in err and "small model" not in err  # then the CPU's bf16 hardware
    finally:
        torch.set_num_threads(before)


ROOT = Path(__file__).resolve().parents[1]


def test_the_start_up_line_is_several_short_lines(capsys):
    assert main(["generate", "--token-ids", "3", "--max-tokens", "1", "--device", "cpu"]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith("edgerun generate: model demo (")
    shown = [line.strip().split(" ")[0] for line in lines[1:6]]
    assert shown == ["device", "experts", "kernels:", "fallbacks:", "loaded"], lines
    assert all(len(line) <= 160 for line in lines[:6]), lines


def test_a_resident_model_is_planned_against_the_profile(tmp_path, capsys):
    """Not only bundles: the demo held whole is planned, its summary stated, and refused (naming
    what would fit) when the profile is too small."""
    argv = ["generate", "--token-ids", "3", "--max-tokens", "1", "--device", "cpu", "--profile"]
    assert main([*argv, str(ROOT / "configs" / "cpu.yaml")]) == 0
    assert "every expert resident (fp32)" in capsys.readouterr().err
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(
        (ROOT / "configs" / "cpu.yaml").read_text().replace("memory_cap: 23GiB", "memory_cap: 3.045GiB")
    )
    assert main([*argv, str(tiny)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgerun generate: error: the demo model with every expert resident")
    assert "Stream the experts from a bundle instead" in err and "(planned: quota " in err


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--warm", "w.json"],
            "--warm sets up expert streaming, but the experts of the demo model are held resident",
        ),
        (["--read-mode", "direct"], "--read-mode sets up expert streaming"),
        (
            ["--quota", "4"],
            "--quota streams routed experts from an edgerun bundle; the demo model is not one",
        ),
        (
            ["--expert-kernel", "triton"],
            "--expert-kernel triton: Triton kernels run on CUDA, and this runs on the cpu",
        ),
        (["--dense-kernel", "triton"], "--dense-kernel triton: Triton kernels run on CUDA"),
        (["--graphs", "on"], "--graphs on: CUDA graphs need CUDA"),
        (
            ["--profile", str(ROOT / "configs" / "rtx5070.yaml")],
            "describes a CUDA device (sm 12.0), but this runs on the cpu (--device cpu)",
        ),
    ],
)
def test_no_flag_is_silently_ignored(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w.json").write_text('{"frequencies": {"0": [1, 2]}}')
    assert main(["generate", "--token-ids", "3", "--max-tokens", "1", "--device", "cpu", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgerun generate: error: ") and message in err, err


def test_old_spellings_still_work_for_one_release(capsys):
    """--torch-device is --device now (as in generate); it still works, saying so on stderr."""
    from edgerun.server.cli import serve_options

    parser = build_parser()
    ns = parser.parse_args(["serve", "--torch-device", "cpu", "--bundle", "b", "--device", "x.yaml"])
    opts = serve_options(ns)
    assert (opts.device, opts.model, opts.profile) == ("cpu", Path("b"), Path("x.yaml"))
    err = capsys.readouterr().err
    for old, new in (
        ("--torch-device", "--device"),
        ("--bundle", "--model"),
        ("--device PROFILE", "--profile"),
    ):
        assert f"edgerun serve: warning: {old} is deprecated and goes in the next release; use {new}" in err
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--device", "cpu", "--torch-device", "cuda"])
    assert "the device is already given" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--device", "gpu"])
    assert "'gpu' is not cpu or cuda (a device profile is --profile FILE)" in capsys.readouterr().err


def test_serve_yaml_old_keys_still_work(tmp_path, capsys):
    from edgerun.errors import ConfigError
    from edgerun.server.options import load_serve_config

    cfg = tmp_path / "serve.yaml"
    cfg.write_text("bundle: /b\ndevice_profile: /p.yaml\ntorch_device: cpu\n")
    assert load_serve_config(cfg) == {"model": Path("/b"), "profile": Path("/p.yaml"), "device": "cpu"}
    err = capsys.readouterr().err
    assert "warning: key 'device_profile' is deprecated and goes in the next release; use 'profile'" in err
    cfg.write_text("bundle: /b\nmodel: /m\n")
    with pytest.raises(ConfigError, match="keys 'bundle' and 'model' are one setting"):
        load_serve_config(cfg)


def test_loading_draws_bars_only_when_asked_or_on_a_terminal():
    """generate --progress: a tqdm bar of the weights loaded on stderr; without it (stderr a pipe,
    not a terminal) none; the text on stdout is the same either way."""
    run = [sys.executable, "-m", "edgerun.cli", "generate", "--max-tokens", "3", "--ignore-eos", "-q", "In"]
    shown = subprocess.run([*run, "--progress"], capture_output=True, text=True, timeout=120)
    plain = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and plain.returncode == 0, shown.stderr + plain.stderr
    assert "load weights" in shown.stderr and "tensor" in shown.stderr
    assert "load weights" not in plain.stderr and "\r" not in plain.stderr
    assert shown.stdout == plain.stdout


def test_trace_reads_a_text_and_simulate_studies_and_replays_prefetch(tmp_path, capsys):
    """`trace --text`: every token of the text its own step, with the prefetcher's predictions;
    `simulate --prefetch-depth` and `--study` print their tables; bad combinations are errors."""
    text = tmp_path / "t.txt"
    text.write_text((ROOT / "tests" / "data" / "kjv_heldout.txt").read_text()[:3000])
    out = tmp_path / "r.jsonl"
    assert main(["trace", "--text", str(text), "--segment", "200", "--out", str(out), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    n = int(re.search(r"(\d+) tokens, (\d+) steps", err).group(1))
    assert f"{n} tokens, {n} steps" in err
    assert main(["simulate", str(out), "--quota", "4", "--prefetch-depth", "2"]) == 0
    table = capsys.readouterr().out
    assert re.search(r"^lfu +4 +\d+ +[\d.]+ +\d+/\d+/\d+$", table, re.M), table
    assert re.search(r"^belady +4 +\d+ +[\d.]+$", table, re.M), table
    # two layers ahead: the trace carries the predictions from two layers back too
    assert main(["simulate", str(out), "--quota", "4", "--prefetch-depth", "4", "--prefetch-ahead", "2"]) == 0
    assert re.search(r"^lfu +4 +\d+ +[\d.]+ +\d+/\d+/\d+$", capsys.readouterr().out, re.M)
    old = tmp_path / "old.jsonl"  # a trace from before prefetch two ahead
    old.write_text("".join(re.sub(r',"predicted2":\[[^a-z]*?\]\]', "", line) for line in out.open()))
    assert "predicted2" in out.read_text() and "predicted2" not in old.read_text()
    assert main(["simulate", str(old), "--quota", "4", "--prefetch-depth", "4", "--prefetch-ahead", "2"]) == 2
    assert "has no 'predicted2' experts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:  # bad usage at the flag parser
        main(["simulate", str(out), "--quota", "4", "--prefetch-ahead", "3"])
    assert bad.value.code == 2 and "1 or 2, got '3'" in capsys.readouterr().err
    assert main(["simulate", str(out), "--quota", "4", "--study", "2"]) == 0
    rows = capsys.readouterr().out
    assert all(re.search(rf"^{p} +4 ", rows, re.M) for p in ("lru", "lfu-decay", "pinned\\+lru", "belady"))
    # the per-layer rows: x LRU/layer is 1 on its own row, x Belady (same split) on Belady's
    assert re.search(r"^lru/layer +4 +[\d.]+ +[\d.]+ +1\.000 ", rows, re.M), rows
    assert re.search(r"^belady/lfu-layer +4 +[\d.]+ +[\d.]+ +[\d.]+ +1\.000 ", rows, re.M), rows
    assert main(["trace", "prompt", "--text", str(text), "--out", str(out), "--device", "cpu"]) == 2
    assert "give either prompts or --text FILE" in capsys.readouterr().err
    # bad combinations are errors before anything runs (found by an audit: these ran, or traced)
    for argv, says in (
        (
            ["simulate", str(out), "--quota", "4", "--prefetch-depth", "-1"],
            "--prefetch-depth must be 0 or more",
        ),
        (
            ["simulate", str(out), "--quota", "4", "--study", "2", "--policy", "lru"],
            "--study replays its own",
        ),
        (["trace", "--text", str(text), "--segment", "0", "--out", str(out)], "--segment must be at least 1"),
        (["trace", "x", "--out", str(tmp_path / "no" / "r.jsonl")], "no directory"),
    ):
        assert main(argv) == 2, argv
        assert says in capsys.readouterr().err, argv
    assert main(["simulate", str(out), "--quota", "99"]) == 0  # above the experts: said, then used
    assert "quota above the 16 experts a layer has: 16 used" in capsys.readouterr().err


def test_a_context_past_the_models_is_said_and_a_prefill_chunk_below_1_refused(
    hf_checkpoints, capsys, caplog
):
    """``--context`` above the model's maximum runs at its maximum and says so (no flag is
    silently changed); ``--prefill-chunk 0`` is bad usage (exit 2), not a traceback."""
    ckpt = str(hf_checkpoints["qwen3_moe"][1])
    argv = ["generate", "--model", ckpt, "--token-ids", "3", "--max-tokens", "1", "--device", "cpu"]
    with caplog.at_level("WARNING"):
        assert main([*argv, "--context", "99999999"]) == 0
    assert "context 99999999 is more than the model's 512 (max_position_embeddings): 512 used" in caplog.text
    capsys.readouterr()
    for bad in ("0", "-1", "x"):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--prefill-chunk", bad])
        assert (
            e.value.code == 2 and "--prefill-chunk: a whole number of at least 1" in capsys.readouterr().err
        )


def test_read_depth_and_pieces_out_of_range_are_bad_usage_before_anything_loads(capsys):
    """``--read-depth`` below 1 and ``--read-pieces`` outside 1..64 are refused by the flag parser
    (exit 2, the flag named), for generate and serve alike, before a model is looked at."""
    for cmd in (["generate", "--token-ids", "3"], ["serve"]):
        for flag, bad, why in (
            ("--read-depth", "0", "a whole number of at least 1, got '0'"),
            ("--read-pieces", "0", "a whole number of at least 1, got '0'"),
            ("--read-pieces", "65", "at most 64, got '65'"),
        ):
            with pytest.raises(SystemExit) as e:
                main([*cmd, "--model", "/nonexistent", flag, bad])
            assert e.value.code == 2 and f"argument {flag}: {why}" in capsys.readouterr().err


def test_first_contact_defects_stay_fixed(tmp_path, capsys):
    """Found by following the README as a newcomer: output piped into `head` ends quietly; a
    missing bundle path is bad input (2); chat without a daemon is no daemon (1); convert with no
    arguments shows its usage; plan takes convert's --group; the bench helps say whole sentences."""
    run = [sys.executable, "-m", "edgerun.cli"]
    head = subprocess.run(
        f"{' '.join(run)} generate --max-tokens 60 --ignore-eos 'And God said' | head -c 5",
        shell=True, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert "Traceback" not in head.stderr and "BrokenPipeError" not in head.stderr, head.stderr
    assert main(["verify", str(tmp_path / "nothing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["chat", "--socket", str(tmp_path / "none.sock"), "hi"]) == 1
    assert "cannot connect" in capsys.readouterr().err
    assert main(["convert"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: edgerun convert") and "the arguments src and dst are required" in err
    for bench in ("decode", "prefill", "streaming"):
        out = subprocess.run(
            [*run, "bench", bench, "--help"], capture_output=True, text=True, timeout=60
        ).stdout
        desc = out.split("\n\n")[1]
        assert desc.rstrip().endswith("."), (bench, desc)


def test_the_start_up_line_counts_a_bundles_parameters_as_its_checkpoints(tmp_path, capsys):
    """Streamed experts and packed int4 bytes do not change how many parameters the model has."""
    from edgerun.bundle.convert import ConvertOptions, convert
    from edgerun.engine.runner import DEMO_MODEL

    ckpt = DEMO_MODEL
    convert(ckpt, tmp_path / "b", ConvertOptions("int4", dense="int4"))
    counts = []
    for model in (ckpt, tmp_path / "b"):
        argv = ["generate", "--model", str(model), "--token-ids", "3", "--max-tokens", "1", "--device", "cpu"]
        assert main([*argv, "--quota", "2"] if model != ckpt else argv) == 0
        counts.append(re.search(r"top-\d+, ([0-9.]+M) params\)", capsys.readouterr().err).group(1))
    assert counts[0] == counts[1]
