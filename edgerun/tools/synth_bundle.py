"""Synthetic bundles: a valid bundle of any geometry with random weights, written directly (no
checkpoint to convert), so a benchmark can stream the real Qwen3.6-35B-A3B geometry (about 17 GB
of int4 expert blocks and 5 GB of bf16 dense weights) from a machine's own disk.

Everything but the payload is the bundle package's own: the conversion plan of a header-only
(sparse) checkpoint of the config (``plan_conversion``: inventory, order, layout, file sizes),
convert's destination and free-space checks, its file writer (hashed as written, fsynced,
renamed), journal and manifest builder. So the result equals what ``edgerun convert`` writes for
a bf16 checkpoint of that config in everything but the weights, hashes and ``source``.

The payload is drawn in its stored form. Each expert block is a fixed point of the quantizer:
``quantize_expert`` of the block's dequantized weights returns the same bytes (int4: every group
holds a +-7 and e4m3's top binade holds the largest code, so the power-of-two global and each
group's code are the ones the quantizer picks; int8: every group holds a +-127 and its fp32 scale
has a bf16 mantissa, so absmax / 127 is exact). A block is thus exactly what ``convert`` writes for
a checkpoint holding those weights, and the recorded quantization error is 0. With ``dense``
int8 or int4 (format v2) the resident linear weights are drawn the same way, in their stored form
(values, scales, int4 global), never as floats to quantize. Magnitudes make an expert's output
O(1) for O(1) inputs; dense matrices are N(0, 1/fan_in), norms at their neutral value, so logits
are finite and the router spreads tokens over the experts.

Every part (one dense chunk, one expert) has its own generator keyed by (seed, part): the bytes do
not depend on the thread count. Memory stays bounded: each expert thread holds one block, the
dense writer a few chunks.

    python -m edgerun.tools.synth_bundle OUT --geometry qwen3.6-35b-a3b [--rotate] [--layers N]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from edgerun.bundle import dense_layout as DL
from edgerun.bundle import format as F
from edgerun.bundle.convert import (
    ConversionPlan,
    ConvertOptions,
    Journal,
    Progress,
    _Writer,
    destination,
    finish,
    plan_conversion,
)
from edgerun.bundle.layout import QUANTS, ROTATIONS, BlockLayout
from edgerun.bundle.quant import e4m3_value
from edgerun.errors import ConfigError, EdgerunError
from edgerun.kernels.moe_reference import layout_dims
from edgerun.models.registry import load_args
from edgerun.tools.synth import init_rule

REPO = Path(__file__).resolve().parents[2]
QWEN36_CONFIG = REPO / "configs" / "models" / "qwen3.6-35b-a3b.json"
DENSE_CHUNK = 1 << 22  # elements per generated dense chunk (8 MiB of bf16)
DENSE_PART, EXPERT_PART = 0, 1  # first word of a part's generator key

# int4 nibbles: -8 (0x8) is never written by the quantizer; remapped to 0. Looked up two bytes at
# a time (a uint16 table), which halves the gathers.
_NIBBLES = np.arange(1 << 16, dtype=np.uint16)[:, None] >> np.array([0, 4, 8, 12], np.uint16) & 15
_NO_MINUS8 = (np.where(_NIBBLES == 8, 0, _NIBBLES) << np.array([0, 4, 8, 12], np.uint16)).sum(
    1, dtype=np.uint16
)
_NO_MINUS128 = np.array([0 if b == 0x80 else b for b in range(256)], np.uint8)  # int8 -128 -> 0
Q4_RMS = math.sqrt(17.5)  # rms of q over [-7, 7] with 0 twice as likely (the remapped -8)
Q8_RMS = math.sqrt(2 * 127 * 128 * 255 / 6 / 256)  # same for int8 over [-127, 127]
# Group scale codes: e4m3 16 .. 416 (about 4.7 binades); the largest code of each tensor in e4m3's
# top binade (240 .. 416), and below 448, so the quantizer's global for the tensor is ours.
CODE_LOW, CODE_HIGH, TOP_LOW = 0x58, 0x7D, 0x77
_CODES = np.array([CODE_LOW + b % (CODE_HIGH - CODE_LOW + 1) for b in range(256)], np.uint8)
CODE_RMS = math.sqrt(
    float(e4m3_value(torch.arange(CODE_LOW, CODE_HIGH + 1, dtype=torch.uint8)).square().mean())
)


# --------------------------------------------------------------------------------------------
# Geometries


def qwen36_config() -> dict[str, Any]:
    """Qwen3.6-35B-A3B's config.json (HF ``model_type`` ``qwen3_5_moe``), reproduced from the
    public config in configs/models/qwen3.6-35b-a3b.json: 40 layers (3 Gated DeltaNet, 1 full
    attention, repeating), 256 experts top-8 of width 512 plus a shared expert, hidden 2048, vocab
    248320. A bundle synthesized from it has the real geometry and random weights."""
    if not QWEN36_CONFIG.is_file():
        raise ConfigError(f"{QWEN36_CONFIG}: missing (the real geometry is read from the repository's copy)")
    return json.loads(QWEN36_CONFIG.read_text())


def tiny_config(model_type: str = "qwen3_5_moe") -> dict[str, Any]:
    """A few-hundred-kilobyte model of either architecture, for tests and smoke runs (int4 groups
    of 16 and 32 both fit)."""
    common = dict(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, max_position_embeddings=512,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1,
    )  # fmt: skip
    if model_type == "qwen3_moe":
        return dict(common, model_type="qwen3_moe", num_hidden_layers=2, rope_theta=10000.0)
    if model_type == "qwen3_5_moe":
        return dict(
            common, model_type="qwen3_5_moe", num_hidden_layers=4, shared_expert_intermediate_size=32,
            layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        )  # fmt: skip
    raise ConfigError(f"no tiny geometry for model_type {model_type!r} (qwen3_moe, qwen3_5_moe)")


GEOMETRIES: dict[str, Callable[[], dict[str, Any]]] = {"qwen3.6-35b-a3b": qwen36_config, "tiny": tiny_config}


def with_layers(config: dict[str, Any], n: int) -> dict[str, Any]:
    """``config`` cut to its first ``n`` decoder layers (same per-layer geometry), for smaller runs."""
    cfg = json.loads(json.dumps(config))
    text = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    have = text.get("num_hidden_layers", 0)
    if not 1 <= n <= have:
        raise ConfigError(f"layers must be in 1..{have} (num_hidden_layers), got {n}")
    text["num_hidden_layers"] = n
    if isinstance(text.get("layer_types"), list):
        text["layer_types"] = text["layer_types"][:n]
    if isinstance(text.get("mlp_only_layers"), list):
        text["mlp_only_layers"] = [i for i in text["mlp_only_layers"] if i < n]
    return cfg


# --------------------------------------------------------------------------------------------
# Random parts


def part_rng(seed: int, *key: int) -> np.random.Generator:
    """The generator of one part of the bundle: (DENSE_PART, tensor, chunk) or (EXPERT_PART,
    layer, expert)."""
    return np.random.Generator(np.random.SFC64(np.random.SeedSequence(seed, spawn_key=key)))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n]


@functools.cache
def _normal_table(std: float) -> np.ndarray:
    """bf16 bit patterns of N(0, std^2) at the 65536 quantiles (k + 1/2) / 65536: a uniform
    16-bit draw looked up here is a normal draw (tails cut at 4.3 std), two gathers cheaper than
    drawing fp32 normals and rounding them."""
    u = (torch.arange(1 << 16, dtype=torch.float64) + 0.5) / (1 << 16)
    z = torch.special.erfinv(2 * u - 1) * math.sqrt(2) * std
    table = z.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    table.flags.writeable = False
    return table


def _normal_bf16(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """n draws of N(0, std^2) as bf16 bit patterns (uint16)."""
    return _normal_table(std)[_random_bytes(rng, 2 * n).view(np.uint16)]


def _force_extreme(q: np.ndarray, rng: np.random.Generator, nibbles: bool) -> None:
    """Give every row of ``q`` (uint8 [groups, bytes]) one value of largest magnitude (+-7 in a
    random nibble, or +-127) at a random place, so each group's absmax is a whole number of steps
    of its scale: absmax / 7 (or / 127) is the scale itself."""
    n, width = q.shape
    bits = rng.bit_generator.random_raw(n)
    at = np.arange(0, n * width, width) + (bits % width).astype(np.intp)
    flat = q.reshape(-1)
    negative = (bits >> 32) & 1 == 1
    if not nibbles:
        flat.put(at, np.where(negative, 0x81, 0x7F).astype(np.uint8))  # -127, 127
        return
    shift = (((bits >> 33) & 1) * 4).astype(np.uint8)  # low or high nibble
    seven = np.where(negative, 0x9, 0x7).astype(np.uint8) << shift
    flat.put(at, (flat.take(at) & ~(np.uint8(0xF) << shift)) | seven)


def _int4_weight(rng: np.random.Generator, rows: int, cols: int, g: int) -> np.ndarray:
    """int4 values in [-7, 7], two per byte (uint8 [groups, g / 2]), a +-7 in every group."""
    packed = _NO_MINUS8[_random_bytes(rng, rows * cols // 2).view(np.uint16)].view(np.uint8)
    packed = packed.reshape(rows * cols // g, g // 2)
    _force_extreme(packed, rng, nibbles=True)
    return packed


def _int4_codes(rng: np.random.Generator, n: int) -> np.ndarray:
    """n group scale codes (e4m3 bits), one of them in e4m3's top binade."""
    codes = _CODES[_random_bytes(rng, n)]
    codes[rng.integers(codes.size)] = rng.integers(TOP_LOW, CODE_HIGH + 1)
    return codes


def _int4_global_exponent(std: float) -> int:
    """The power of two whose global scale gives int4 weights of about ``std``."""
    return round(math.log2(std / (Q4_RMS * CODE_RMS)))


def _int4(rng: np.random.Generator, rows: int, cols: int, g: int, vary: bool):
    """(packed uint8 [rows * cols / 2], codes uint8 [rows * cols / g], global) of one projection."""
    packed = _int4_weight(rng, rows, cols, g)
    codes = _int4_codes(rng, packed.shape[0])
    # weights ~ 1/sqrt(fan_in); the global, a power of two, varies by a binade either way when
    # ``vary`` (down only: it scales the expert's output linearly, gate_up would square it)
    exp = _int4_global_exponent(1 / math.sqrt(cols))
    return packed, codes, math.ldexp(1.0, exp + (int(rng.integers(-1, 2)) if vary else 0))


def _int8_weight(rng: np.random.Generator, rows: int, cols: int, g: int) -> np.ndarray:
    """int8 values in [-127, 127] (as uint8 [groups, g]), a +-127 in every group."""
    q = _NO_MINUS128[_random_bytes(rng, rows * cols)].reshape(rows * cols // g, g)
    _force_extreme(q, rng, nibbles=False)
    return q


def _int8_scales(rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    """n fp32 scales for weights ~ 1/sqrt(cols), each with a bf16 mantissa (q * scale is exact)."""
    scale = np.exp2(rng.random(n, dtype=np.float32) - 0.5) / np.float32(math.sqrt(cols) * Q8_RMS)
    return (scale.view(np.uint32) & 0xFFFF0000).view(np.float32)


def _int8(rng: np.random.Generator, rows: int, cols: int, g: int):
    """(q int8 as uint8 [rows * cols], scales fp32 [rows * groups]) of one projection."""
    q = _int8_weight(rng, rows, cols, g)
    return q, _int8_scales(rng, q.shape[0], cols)


def check_layout(layout: BlockLayout) -> None:
    """Refuse the one scheme whose blocks cannot be drawn as the quantizer's fixed points."""
    if layout.quant == "int8" and layout.rotation == "hadamard":
        raise ConfigError(
            "synthetic int8 blocks cannot be rotated: a rotation's fp32 rounding moves the fp32 scales "
            "the quantizer would recompute (use int4, or int8 without the rotation)"
        )


def random_block(layout: BlockLayout, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
    """One random expert block (uint8 [block_bytes]) and, for int4, its two global scales (fp32
    [2]), as ``quantize_expert`` would write them for the block's own dequantized weights."""
    check_layout(layout)
    D, I = layout_dims(layout)
    block = np.zeros(layout.block_bytes, np.uint8)
    gscales = np.zeros(2, np.float32) if layout.quant == "int4" else None

    def put(name: str, a: np.ndarray) -> None:
        c = layout.component(name)
        block[c.offset : c.offset + c.nbytes] = a.reshape(-1).view(np.uint8)

    for i, (proj, rows, cols) in enumerate((("gate_up", 2 * I, D), ("down", D, I))):
        if layout.quant == "bf16":
            put(f"{proj}.weight", _normal_bf16(rng, rows * cols, 1 / math.sqrt(cols)))
        elif layout.quant == "int8":
            q, scales = _int8(rng, rows, cols, layout.group_size or cols)
            put(f"{proj}.weight", q)
            put(f"{proj}.scales", scales)
        else:
            packed, codes, gscales[i] = _int4(rng, rows, cols, layout.group_size, proj == "down")
            put(f"{proj}.weight", packed)
            put(f"{proj}.scales", codes)
    return block, gscales


def _dense_init(name: str, shape: tuple[int, ...], unit_offset: bool) -> tuple[str, float]:
    """``edgerun.tools.synth.init_rule`` with matrices N(0, 1/fan_in), so activations stay O(1)
    through 40 layers of random weights."""
    return init_rule(name, shape, unit_offset, matrix_std=1.0 / math.sqrt(math.prod(shape[1:])))


# --------------------------------------------------------------------------------------------
# Writing


def _sparse_checkpoint(src: Path, config: dict[str, Any], tokenizer_from: Path | None) -> None:
    """config.json, a tokenizer, and model.safetensors whose header lists every tensor (bf16,
    experts fused) over a hole: what ``plan_conversion`` reads, at no disk cost. Fixed mtimes keep
    the conversion key of an interrupted run the same, so a rerun resumes it."""
    arch, args = load_args(config)
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps(config, indent=1))
    tensors = [(s.name, "BF16", s.shape, math.prod(s.shape) * 2) for s in arch.tensor_specs(args)]
    header = F.safetensors_header(tensors)
    with open(src / "model.safetensors", "wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(t[3] for t in tensors))
    os.utime(src / "model.safetensors", ns=(0, 0))
    if tokenizer_from is None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        # one word per id ("t0" .. "t{V-1}"), so any generated id decodes
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(args.vocab_size)}, unk_token="t0"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.save(str(src / "tokenizer.json"))
        return
    if not (tokenizer_from / "tokenizer.json").is_file():
        raise ConfigError(f"{tokenizer_from}: no tokenizer.json to copy into the bundle")
    for name in F.TOKENIZER_REQUIRED + F.TOKENIZER_OPTIONAL:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, src / name)


def _in_order(
    pool: ThreadPoolExecutor, fn: Callable, jobs: Iterable, ahead: int
) -> Iterator[tuple[Any, Any]]:
    """(job, fn(job)) for each job, computed on ``pool``, yielded in job order; at most ``ahead``
    results in flight (bounded memory)."""
    it = iter(jobs)
    window: collections.deque[tuple[Any, Future]] = collections.deque()
    for job in it:
        window.append((job, pool.submit(fn, job)))
        if len(window) >= ahead:
            break
    while window:
        job, fut = window.popleft()
        for nxt in it:
            window.append((nxt, pool.submit(fn, nxt)))
            break
        yield job, fut.result()


def _dense_chunks(plan: ConversionPlan) -> list[tuple[int, str, str, int, int, int]]:
    """(tensor index, stored name, kind, first, count, total) of every dense chunk, in file order.
    kind ``plain``: elements [first, first + count) of ``total``; a quantized weight's ``weight``
    and ``scales``: rows [first, first + count) of ``total``; its ``global``: the one value."""
    out = []
    for i, r in enumerate(plan.resident):
        if r.scheme == DL.PLAIN:
            n = math.prod(r.entry.shape)
            out += [(i, r.name, "plain", s, min(DENSE_CHUNK, n - s), n) for s in range(0, n, DENSE_CHUNK)]
            continue
        R, C = r.entry.shape
        rows = max(1, DENSE_CHUNK // C)
        for kind, name in (("weight", r.name), ("scales", r.name + DL.SCALES)):
            out += [(i, name, kind, s, min(rows, R - s), R) for s in range(0, R, rows)]
        if r.scheme == "int4":
            out.append((i, r.name + DL.GLOBAL, "global", 0, 1, 1))
    return out


def _write_dense(
    plan: ConversionPlan, dst: Path, seed: int, pool: ThreadPoolExecutor, ahead: int, between: Callable
) -> tuple[F.FileRecord, dict[str, str]]:
    """dense.safetensors: chunks drawn on ``pool``, hashed (per stored tensor and whole file) and
    written here in file order; ``between()`` runs after each chunk. A quantized weight is drawn
    in its stored form, as expert blocks are: values with a largest magnitude in every group and
    scales that make them N(0, 1/fan_in) (no float weights, no quantizer)."""
    unit_offset = plan.args.norm_unit_offset

    def draw(job: tuple) -> np.ndarray:
        i, name, kind, start, n, _ = job
        r = plan.resident[i]
        how, value = _dense_init(r.name, r.entry.shape, unit_offset)
        if kind == "plain":
            rng = part_rng(seed, DENSE_PART, i, start // DENSE_CHUNK)
            if how == "normal":
                return _normal_bf16(rng, n, value).view(np.uint8)
            x = np.full(n, value) if how == "const" else rng.random(n) * value
            return torch.from_numpy(x).to(torch.bfloat16).view(torch.uint8).numpy()
        C = r.entry.shape[1]
        g = r.group or C
        rng = part_rng(seed, DENSE_PART, i, int(kind == "scales"), start)  # keyed by the first row
        if kind == "global":  # weights of std ``value`` (a matrix's N(0, 1/fan_in))
            return np.array([math.ldexp(1.0, _int4_global_exponent(value))], np.float32).view(np.uint8)
        if r.scheme == "int4":
            a = _int4_weight(rng, n, C, g) if kind == "weight" else _int4_codes(rng, n * C // g)
        else:
            a = _int8_weight(rng, n, C, g) if kind == "weight" else _int8_scales(rng, n * C // g, C)
        return a.reshape(-1).view(np.uint8)

    w = _Writer(dst / F.DENSE)
    w.write(plan.dense_header)
    hashes: dict[str, str] = {}
    h = None
    for (_, name, _, start, n, total), data in _in_order(pool, draw, _dense_chunks(plan), ahead):
        if start == 0:
            h = F.new_hash(F.PART_DIGEST)
        w.write(data)
        h.update(data)
        if start + n == total:
            hashes[name] = h.hexdigest()
        between(data.nbytes)
    return w.commit(), hashes


def _write_layer(plan: ConversionPlan, dst: Path, layer: int, seed: int) -> tuple:
    """One layer's expert file (and int4 sidecar), expert by expert: (layer, record, the blocks'
    hashes and checksums as the journal records them, sidecar record or None). The written pages are dropped from the page cache after the fsync,
    so a following read of the file, direct or buffered, comes from the disk."""
    lay, E = plan.layout, plan.args.num_experts
    w = _Writer(dst / F.expert_file(layer))
    sidecar = np.zeros((E, 2), np.float32) if lay.quant == "int4" else None
    blocks = {"blocks": [], "xxh3": []}
    for e in range(E):
        block, gscales = random_block(lay, part_rng(seed, EXPERT_PART, layer, e))
        w.write(block)
        blocks["blocks"].append(F.part_hash(block))
        blocks["xxh3"].append(F.block_checksum(block))
        if sidecar is not None:
            sidecar[e] = gscales
    record = w.commit()
    fd = os.open(dst / F.expert_file(layer), os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    side = None
    if sidecar is not None:
        s = _Writer(dst / F.sidecar_file(layer))
        s.write(sidecar.view(np.uint8).reshape(-1))
        side = s.commit()
    return layer, record, blocks, side


def _cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def synth_bundle(
    out_dir: str | Path,
    config: dict[str, Any],
    quant: str = "int4",
    group_size: int | None = None,
    rotation: str = "none",
    seed: int = 0,
    threads: int | None = None,
    tokenizer_from: str | Path | None = None,
    log: TextIO | None = None,
    dense: str = DL.PLAIN,
    lm_head: str | None = None,
    dense_group: int | None = None,
) -> Path:
    """Write a bundle of ``config`` (an HF config.json dict) with random weights into ``out_dir``;
    returns it. Experts in ``quant`` (``group_size`` None: the scheme's default; ``rotation``
    "none" or "hadamard"), dense weights bf16, their linear weights quantized as ``dense``,
    ``lm_head`` and ``dense_group`` say (convert's ``--dense``, ``--lm-head``, ``--dense-group``).
    ``threads`` (default: the CPUs this process may use) draw the payload; the bytes do not depend
    on it. The tokenizer is copied from
    ``tokenizer_from``, or is a word-per-id tokenizer of the config's vocabulary.

    Refuses, before writing a byte, a destination that holds anything else or lacks the space (with
    the numbers). A directory that already holds this exact bundle is left as it is; an interrupted
    run resumes (finished files re-hashed and kept)."""
    dst = Path(out_dir)
    if rotation not in ROTATIONS:
        raise ConfigError(f"rotation {rotation!r} is not supported (supported: {', '.join(ROTATIONS)})")
    threads = max(1, threads or _cpu_count())
    options = ConvertOptions(
        quant, group_size, rotation == "hadamard", dense=dense, lm_head=lm_head, dense_group=dense_group
    )
    tok = None if tokenizer_from is None else Path(tokenizer_from).resolve()
    with tempfile.TemporaryDirectory(prefix="edgerun-synth-") as tmp:
        src = Path(tmp) / "checkpoint"
        _sparse_checkpoint(src, config, tok)
        plan = plan_conversion(src, options)
        plan.check()
        check_layout(plan.layout)
        plan.source = {
            "path": "synthetic",
            "config_blake2b": plan.source["config_blake2b"],
            "files": [],
            "synthetic": {
                "generator": "edgerun.tools.synth_bundle",
                "weights": "random (not a trained model)",
                "seed": seed,
                "tokenizer": str(tok) if tok else "word per id (generated)",
            },
        }
        payload = sum(v for k, v in plan.file_sizes().items() if k not in plan.tokenizer)
        bar = Progress(payload, log)
        with destination(plan, dst, bar) as state:
            if isinstance(state, F.Manifest):
                bar.log(f"{dst}: already this synthetic bundle; nothing to do")
                return dst
            _write_payload(plan, dst, state, seed, threads, bar)
            finish(plan, state, src, dst)
    bar.close()
    bar.log(
        f"{dst}: synthetic bundle complete (random weights): {len(plan.experts)} expert files, "
        f"block_bytes {plan.layout.block_bytes}"
    )
    return dst


def _write_payload(
    plan: ConversionPlan, dst: Path, journal: Journal, seed: int, threads: int, bar: Progress
) -> None:
    """Expert layers on one pool (a layer per thread, expert by expert) while this thread writes
    dense.safetensors from chunks a second pool draws; finished files are journalled here."""
    lay = plan.layout
    layers = [
        x.layer
        for x in plan.experts
        if not (
            F.expert_file(x.layer) in journal.done
            and (lay.quant != "int4" or F.sidecar_file(x.layer) in journal.done)
        )
    ]
    dense_threads = max(1, threads // 8)  # drawing is cheap; hashing and writing here is the bound
    experts = ThreadPoolExecutor(max(1, threads - dense_threads), thread_name_prefix="synth-experts")
    dense = ThreadPoolExecutor(dense_threads, thread_name_prefix="synth-dense")
    pending = {experts.submit(_write_layer, plan, dst, layer, seed) for layer in layers}
    block_bytes = plan.args.num_experts * lay.block_bytes

    def collect(block: bool = False) -> None:
        done = {f for f in pending if f.done()}
        if block and not done:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            pending.discard(f)
            layer, record, blocks, side = f.result()
            if side is not None:
                journal.finish(F.sidecar_file(layer), side)
            # the blocks are the quantizer's fixed points: no error against their own weights
            journal.finish(F.expert_file(layer), record, **blocks, err2=0.0, ref2=0.0)
            bar.advance(block_bytes, f"layer {layer}")

    def dense_progress(n: int) -> None:
        bar.advance(n, "dense")
        collect()

    try:
        if F.DENSE not in journal.done:
            record, tensors = _write_dense(plan, dst, seed, dense, 2 * dense_threads, dense_progress)
            # quantized weights are drawn in their stored form: no error against their own values
            quant = {r.name: {"err2": 0.0, "ref2": 0.0} for r in plan.resident if r.scheme != DL.PLAIN}
            journal.finish(F.DENSE, record, tensors=tensors, quant=quant)
        while pending:
            collect(block=True)
    finally:
        for pool in (experts, dense):
            pool.shutdown(wait=True, cancel_futures=True)


# --------------------------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m edgerun.tools.synth_bundle",
        description="Write a bundle with random weights (a benchmark input, not a model).",
    )
    p.add_argument("out", type=Path, help="bundle directory to create")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    p.add_argument("--quant", choices=QUANTS, default="int4")
    p.add_argument("--group", type=int, default=None, help="group size (default: the scheme's)")
    p.add_argument("--rotate", action="store_true", help="Hadamard rotation over each group")
    DL.add_dense_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--tokenizer-from", type=Path, default=None, help="copy tokenizer files from this dir")
    ns = p.parse_args(argv)
    try:
        config = GEOMETRIES[ns.geometry]()
        if ns.layers is not None:
            config = with_layers(config, ns.layers)
        t0 = time.perf_counter()
        out = synth_bundle(
            ns.out, config, ns.quant, ns.group, "hadamard" if ns.rotate else "none", ns.seed, ns.threads,
            ns.tokenizer_from, log=sys.stderr, dense=ns.dense, lm_head=ns.lm_head, dense_group=ns.dense_group,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        m = F.read_manifest(out)
    except (EdgerunError, OSError) as exc:
        print(f"synth_bundle: error: {exc}", file=sys.stderr)
        return 1
    experts = sum(r.file_bytes for r in m.layers)
    total = sum(r.bytes for r in m.files.values())
    print(
        f"{out}: {ns.geometry} (random weights), {m.quant.scheme} group {m.quant.group_size} rotation "
        f"{m.quant.rotation}, dense {m.dense_quant.scheme.label()}: bytes {total} ({total / 2**30:.2f} GiB; "
        f"experts {experts}, dense "
        f"{m.files[m.dense_file].bytes}), {len(m.layers)} layers x {m.layers[0].num_experts} blocks, "
        f"block_bytes {m.layers[0].block_bytes}, seconds {seconds:.1f} ({total / seconds / 1e9:.2f} GB/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
