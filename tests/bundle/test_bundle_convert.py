"""`edgerun convert`: dry run (headers only), refusals before writing, restartability after a
kill, layout independence, and bounded memory."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from synthetic import measure, write_checkpoint

from edgerun.bundle import convert as C
from edgerun.bundle import format as F
from edgerun.bundle.cli import main
from edgerun.bundle.convert import ConvertOptions, convert, natural_key, plan_conversion
from edgerun.errors import CheckpointError
from hf_fixtures import rewrite

REPO = Path(__file__).resolve().parents[2]


def _no_payload_reads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a payload was read")

    monkeypatch.setattr(C.Source, "read", refuse)
    monkeypatch.setattr("edgerun.safetensors_io.MappedFiles.tensor", refuse)


def test_dry_run_classifies_every_tensor(sources, tmp_path, monkeypatch, capsys):
    src = rewrite(sources["qwen3_5_moe"], tmp_path / "mm", fused=True, multimodal=True)
    (src / "tokenizer.json").write_bytes((sources["qwen3_5_moe"] / "tokenizer.json").read_bytes())
    _no_payload_reads(monkeypatch)
    assert (
        main(["convert", str(src), str(tmp_path / "out"), "--quant", "int4", "--group", "16", "--dry-run"])
        == 0
    )
    brief = capsys.readouterr().out
    assert brief.splitlines()[0].endswith("0 unknown") and "(-v lists every tensor)" in brief
    assert "embed_tokens" not in brief  # the per-tensor list only with -v
    argv = ["convert", str(src), str(tmp_path / "out"), "--quant", "int4", "--group", "16", "--dry-run", "-v"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(brief.replace("(-v lists every tensor)\n", ""))  # the summary comes first
    names = [ln.split()[-3] for ln in out.split("\ntensors:\n")[1].splitlines()]
    assert names == sorted(names, key=natural_key) and len(names) > 10
    assert natural_key("layers.2.w") < natural_key("layers.10.w")  # numbers by value, not by text
    assert not (tmp_path / "out").exists()
    lines = {ln.split()[-3]: ln.split()[0] for ln in out.splitlines() if ln.startswith("  ") and "[" in ln}
    assert lines["model.language_model.embed_tokens.weight"] == "resident"
    assert lines["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"] == "resident"
    assert lines["model.language_model.layers.0.mlp.experts.gate_up_proj"] == "expert"
    assert lines["model.visual.blocks.0.attn.qkv.weight"] == "ignored"
    assert lines["mtp.fc.weight"] == "ignored"
    assert "0 unknown" in out
    plan = plan_conversion(src, ConvertOptions("int4", 16))
    assert f"block_bytes {plan.layout.block_bytes} " in out
    for category in ("embeddings", "deltanet", "attention", "shared_experts", "routers", "experts", "total"):
        assert f"\n  {category} " in out


def test_unknown_tensor_is_an_error(sources, tmp_path, capsys):
    src = rewrite(
        sources["qwen3_moe"], tmp_path / "src", extra={"model.layers.0.mlp.bogus.weight": torch.zeros(2)}
    )
    (src / "tokenizer.json").write_bytes((sources["qwen3_moe"] / "tokenizer.json").read_bytes())
    assert main(["convert", str(src), str(tmp_path / "out"), "--dry-run"]) == 2
    cap = capsys.readouterr()
    row = next(ln for ln in cap.out.splitlines() if "model.layers.0.mlp.bogus.weight" in ln)
    assert row.split()[0] == "unknown" and "1 unknown" in cap.out
    assert "unknown tensor 'model.layers.0.mlp.bogus.weight'" in cap.err
    with pytest.raises(CheckpointError, match="unknown tensor 'model.layers.0.mlp.bogus.weight'"):
        convert(src, tmp_path / "out", ConvertOptions())
    assert not (tmp_path / "out").exists()


def test_missing_tokenizer_is_refused(sources, tmp_path):
    src = rewrite(sources["qwen3_moe"], tmp_path / "src")
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        convert(src, tmp_path / "out", ConvertOptions())


def test_free_space_checked_before_writing(sources, tmp_path, monkeypatch):
    class Usage:
        free = 10_000

    monkeypatch.setattr(C.shutil, "disk_usage", lambda p: Usage)
    with pytest.raises(F.BundleError, match=r"the bundle needs [\d,]+ more bytes .* has 10,000 bytes free"):
        convert(sources["qwen3_moe"], tmp_path / "out", ConvertOptions("int8"))
    assert not (tmp_path / "out").exists()


KILLER = """
import os, signal, sys
from edgerun.bundle.convert import ConvertOptions, convert
layer = int(sys.argv[3])
def kill(l, e):
    if l == layer and e == 2:
        os.kill(os.getpid(), signal.SIGKILL)
convert(sys.argv[1], sys.argv[2], ConvertOptions("int4", 16), on_block=kill)
"""


def test_killed_conversion_resumes_to_the_same_bundle(sources, tmp_path, capsys):
    src = sources["qwen3_moe"]
    plan = plan_conversion(src, ConvertOptions("int4", 16))
    first, second = (x.layer for x in plan.experts)  # MoE layers 0 and 2
    whole = tmp_path / "whole"
    convert(src, whole, ConvertOptions("int4", 16))

    dst = tmp_path / "resumed"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", KILLER, str(src), str(dst), str(second)], env=env)
    assert proc.returncode == -signal.SIGKILL
    assert not (dst / F.MANIFEST).exists() and (dst / C.JOURNAL).exists()
    done = dst / F.expert_file(first)
    assert done.is_file() and (dst / (F.expert_file(second) + ".tmp")).is_file()
    before = done.stat()
    # an unfinished bundle is named as such, by verify, plan and generate alike
    from edgerun.cli import main as edgerun

    for argv in (
        ["verify", str(dst)],
        ["plan", "--profile", str(REPO / "configs" / "cpu.yaml"), "--model", str(dst)],
    ):
        assert edgerun(argv) in (1, 2)
    assert edgerun(["generate", "--model", str(dst), "--token-ids", "1", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count(f"{dst}: an unfinished bundle: a conversion into it stopped before writing") == 3
    assert "run the same `edgerun convert SRC" in err

    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        convert(src, dst, ConvertOptions("int4", 16), log=f)
    assert "converting it again" not in log.read_text()
    assert (
        "resuming an unfinished conversion: 3 file(s) finished before and re-hashed intact are kept"
        in log.read_text()
    )
    after = done.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)  # skipped, not rewritten
    assert (dst / F.MANIFEST).read_bytes() == (whole / F.MANIFEST).read_bytes()
    assert not list(dst.rglob("*.tmp")) and not (dst / C.JOURNAL).exists()


def test_resume_redoes_a_damaged_finished_layer(sources, tmp_path):
    src = sources["qwen3_moe"]
    whole = tmp_path / "whole"
    m = convert(src, whole, ConvertOptions("int8"))
    dst = tmp_path / "dst"

    class Stop(Exception):
        pass

    def stop(layer, e):
        if layer == m.layers[1].layer:
            raise Stop

    with pytest.raises(Stop):
        convert(src, dst, ConvertOptions("int8"), on_block=stop)
    damaged = dst / m.layers[0].file
    data = bytearray(damaged.read_bytes())
    data[100] ^= 0x40
    damaged.write_bytes(bytes(data))
    log = tmp_path / "log.txt"
    with open(log, "w") as f:
        convert(src, dst, ConvertOptions("int8"), log=f)
    assert f"{m.layers[0].file}: missing or changed since it was finished" in log.read_text()
    assert (dst / F.MANIFEST).read_bytes() == (whole / F.MANIFEST).read_bytes()


def test_destination_refusals(sources, bundles, tmp_path):
    src = sources["qwen3_moe"]
    done = bundles("qwen3_moe", "int8")
    again = convert(src, done, ConvertOptions("int8"))  # same conversion: nothing to do
    assert again == F.read_manifest(done)
    with pytest.raises(
        F.BundleError, match="already holds a complete bundle of another source or quantization"
    ):
        convert(src, done, ConvertOptions("int4", 16))
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(F.BundleError, match="is not empty and holds no unfinished conversion"):
        convert(src, other, ConvertOptions())

    partial = tmp_path / "partial"
    with pytest.raises(RuntimeError):
        convert(
            src, partial, ConvertOptions("int8"), on_block=lambda *_: (_ for _ in ()).throw(RuntimeError())
        )
    with pytest.raises(F.BundleError, match="unfinished conversion with a different quant"):
        convert(src, partial, ConvertOptions("int4", 16))


def test_bundle_bytes_do_not_depend_on_the_source_layout(sources, bundles, tmp_path):
    ref = F.read_manifest(bundles("qwen3_5_moe", "int4", 16))
    for name, kw in {
        "fused": dict(fused=True),
        "sharded": dict(shards=3),
        "mm": dict(fused=True, multimodal=True),
    }.items():
        src = rewrite(sources["qwen3_5_moe"], tmp_path / name, **kw)
        (src / "tokenizer.json").write_bytes((sources["qwen3_5_moe"] / "tokenizer.json").read_bytes())
        (src / "tokenizer_config.json").write_bytes(
            (sources["qwen3_5_moe"] / "tokenizer_config.json").read_bytes()
        )
        (src / "chat_template.jinja").write_bytes(
            (sources["qwen3_5_moe"] / "chat_template.jinja").read_bytes()
        )
        m = convert(src, tmp_path / f"b-{name}", ConvertOptions("int4", 16))
        data = {k: v for k, v in m.files.items() if k != "generation_config.json"}
        assert data == {k: v for k, v in ref.files.items() if k != "generation_config.json"}, name


def test_peak_rss_does_not_grow_with_layers(tmp_path):
    # 2 vs 8 MoE layers of 16 experts (3 MiB of bf16 experts per layer), each converted in a
    # child process: a converter that kept what it read would grow by >= 18 MiB between the two.
    small = measure(tmp_path / "small", 2, 16, 256, 128, "int4")
    big = measure(tmp_path / "big", 8, 16, 256, 128, "int4")
    assert big["expert_bytes"] - small["expert_bytes"] >= 18 * 2**20
    assert big["peak_rss"] - small["peak_rss"] < 4 * 2**20, (small, big)


def test_dry_run_of_a_qwen36_shaped_checkpoint_reads_headers_only(tmp_path, capsys):
    # Qwen3.6-35B-A3B's text inventory (transformers' Qwen3_5MoeTextConfig defaults: 40 layers,
    # 256 experts, hidden 2048, expert width 512) over a sparse file: ~67 GB that is never read.
    import transformers as tf

    cfg = tf.Qwen3_5MoeTextConfig().to_dict()
    cfg["model_type"] = "qwen3_5_moe"
    payload = write_checkpoint(tmp_path / "src", cfg, sparse=True)
    assert payload > 60e9
    assert (
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--quant", "int4", "--dry-run"]) == 0
    )
    out = capsys.readouterr().out
    # int4 g32: gate_up 1024x2048/2 + 1024x64 e4m3, down 2048x256 + 2048x16 e4m3 = 1,671,168 = 408 x 4096
    assert "block_bytes 1671168 (408 x 4096" in out
    assert "40 MoE layers x 256 experts" in out
    assert (
        main(["convert", str(tmp_path / "src"), str(tmp_path / "out"), "--quant", "int8", "--dry-run"]) == 0
    )
    # int8 per row: 1024x2048 + 1024x4 fp32 + 2048x512 + 2048x4 fp32 = 3,158,016 = 771 x 4096
    assert "block_bytes 3158016 (771 x 4096" in capsys.readouterr().out
    assert json.loads((tmp_path / "src" / "config.json").read_text())["num_experts"] == 256


def test_dense_dtype_on_request_only(sources, bundles, tmp_path):
    from edgerun.bundle.reader import load_bundle_model
    from edgerun.safetensors_io import read_header

    kept, _ = read_header(bundles("qwen3_moe", "int8") / F.DENSE)
    assert {e.dtype for e in kept.values()} == {"F32"}  # the fp32 source's dtype, untouched
    dst = tmp_path / "b"
    m = convert(sources["qwen3_moe"], dst, ConvertOptions("int8", dense_dtype="bf16"))
    cast, _ = read_header(dst / F.DENSE)
    assert {e.dtype for e in cast.values()} == {"BF16"} and m.dtype == "BF16" and m.dense_dtype == "bf16"
    model, _, _ = load_bundle_model(dst)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_the_dense_file_data_starts_64_byte_aligned(bundles):
    """A mapped dense.safetensors' tensors start as aligned as the bytes before them allow: its
    data on a 64-byte boundary (the CPU's int8 kernel reads weights in place only where aligned)."""
    with open(bundles("qwen3_moe", "int8") / F.DENSE, "rb") as f:
        assert (8 + int.from_bytes(f.read(8), "little")) % 64 == 0


def test_a_second_conversion_into_the_same_directory_is_refused(sources, tmp_path):
    import fcntl
    import os

    dst = tmp_path / "out"
    dst.mkdir()
    fd = os.open(dst, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as a conversion in another process holds it
    try:
        with pytest.raises(F.BundleError, match="another conversion is writing into it"):
            convert(sources["qwen3_moe"], dst, ConvertOptions("int8"))
        assert list(dst.iterdir()) == []  # nothing written
    finally:
        os.close(fd)
    convert(sources["qwen3_moe"], dst, ConvertOptions("int8"))
    assert (dst / F.MANIFEST).is_file()


def test_every_rename_that_publishes_a_file_is_followed_by_a_directory_fsync(sources, tmp_path, monkeypatch):
    """A rename is durable only once its directory is fsynced: after a crash, a bundle whose
    manifest was renamed in must not come back without it (or with an expert file missing)."""
    events = []
    replace, fsync = os.replace, os.fsync

    def logged_replace(src, dst):
        replace(src, dst)
        events.append(("rename", Path(dst).parent))

    def logged_fsync(fd):
        fsync(fd)
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))

    monkeypatch.setattr(os, "replace", logged_replace)
    monkeypatch.setattr(os, "fsync", logged_fsync)
    dst = tmp_path / "out"
    convert(sources["qwen3_moe"], dst, ConvertOptions("int4", 16))
    renames = [i for i, (kind, _) in enumerate(events) if kind == "rename"]
    assert len(renames) >= 4 and events[renames[-1]][1] == dst  # the manifest, last
    for i, nxt in zip(renames, renames[1:] + [len(events)]):
        assert ("fsync", events[i][1]) in events[i + 1 : nxt], f"{events[i][1]}: renamed into, not fsynced"


def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise(sources, tmp_path):
    """A tqdm bar (bytes, rate, the tensor or layer at hand) only where asked or on a terminal;
    a file or pipe gets one line per finished file and no carriage returns."""
    import io

    tty, plain = io.StringIO(), io.StringIO()
    convert(sources["qwen3_moe"], tmp_path / "a", ConvertOptions("int8"), log=tty, tty=True)
    convert(sources["qwen3_moe"], tmp_path / "b", ConvertOptions("int8"), log=plain)
    assert "\r" in tty.getvalue() and "B/s" in tty.getvalue() and "layer 2 expert" in tty.getvalue()
    assert "\r" not in plain.getvalue() and "B/s" not in plain.getvalue()
    assert "bundle complete" in plain.getvalue() and "bundle complete" in tty.getvalue()
