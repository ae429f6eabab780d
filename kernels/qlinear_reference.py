"""A dense linear layer over a ``QWeight`` as the model computes it, random weights, and the
probe cases that hold ``qgemv`` (kernels/qlinear_triton.py) to it.

Shape legend: N = tokens (rows of x), R = weight rows (output features), C = columns (input
features), S = R // 2 (``silu_mul``: gate rows [0, S), up rows [S, 2S)).

``qlinear_ref`` is the torch the model runs, op for op, in the model dtype (x.dtype): the weight
dequantized exactly in fp32 and rounded to x.dtype (exact for int4 in bf16 and fp32: q * e4m3 *
2^k has at most 7 significant bits; int8 values are rounded there), one ``F.linear`` (sums in
fp32, bias added, rounded once), then the epilogue in torch's own ops, each rounding its result
to x.dtype. Importing this module does not import Triton.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from edgerun.bundle.quant import quantize_int4, quantize_int8
from edgerun.kernels.dense_probe import TOLERANCE, compare
from edgerun.kernels.dense_probe import Refused as Mismatch  # the probes' one refusal
from edgerun.kernels.dense_reference import rms_norm_ref
from edgerun.kernels.qweight import QWeight, dequantize

EPILOGUES = ("none", "silu_mul", "residual", "gated")
# TOLERANCE[dtype]: max |got - ref| allowed, relative to max |ref|, dense_probe's for its reasons
# (rounding where the reference rounds, fp32 summation order otherwise; a rounded intermediate may
# land one ulp away). In bf16 / fp16 the reference also rounds every dequantized int8 weight to
# the model dtype (2^-9 of a weight, relative, in bf16), which the kernel does not: about 1e-3 of
# the output's scale, inside the bf16 limit of 2e-2 (fp16: 2^-12 a weight, inside 5e-3).


def qlinear_ref(
    x: torch.Tensor,
    w: QWeight,
    bias: torch.Tensor | None = None,
    epilogue: str = "none",
    out: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    *,
    exact_weight: bool = False,
    norm: tuple[torch.Tensor, float, bool] | None = None,
    norm_out: torch.Tensor | None = None,
    matmul=None,
) -> torch.Tensor:
    """x [N, C] @ w.T (+ bias) in x.dtype, then the epilogue. ``norm`` (weight, eps,
    unit_offset): x is first replaced by ``rms_norm_ref`` of it, which ``norm_out`` (if given)
    receives too. The epilogues:

    - ``none``: y [N, R], written into ``out`` if given;
    - ``silu_mul``: silu(y[:, :S]) * y[:, S:] [N, S] (into ``out`` if given);
    - ``residual``: ``out`` [N, R] (the residual) += y in place, and returned;
    - ``gated``: sigmoid(gate) * y, gate [N, 1] logits (into ``out`` if given).

    ``matmul``: computes x @ w.T in its stead (a kernel over the stored bytes), the epilogue as
    here. ``exact_weight``: the weight's exact fp32 values, not rounded to x.dtype (fp32 products and
    sums, y rounded once): what ``qgemv`` computes. It differs from the default only for int8
    weights in bf16 / fp16 (and fp32 summation order). A weight whose ``act`` is int8 (W4A8)
    multiplies each row of x (normalised first) as ``quantize_x_ref`` quantizes it, its int8 values
    times their group's scale, in fp64 (exact), then as ``exact_weight``."""
    if norm is not None:
        x = rms_norm_ref(x, *norm)
        if norm_out is not None:
            norm_out.copy_(x)
    if epilogue not in EPILOGUES:
        raise ValueError(f"epilogue {epilogue!r} is not one of {', '.join(EPILOGUES)}")
    if matmul is not None:  # another kernel's x @ w.T (kernels/qlinear_cpu.py), then the same epilogue
        y = matmul(x) if bias is None else matmul(x) + bias
    elif w.act == "int8":
        from edgerun.kernels.qlinear_w4a8 import quantize_x_ref

        xq = torch.stack([_int8_values(row, quantize_x_ref) for row in x])
        y = F.linear(xq, dequantize(w).double(), None if bias is None else bias.double()).to(x.dtype)
    elif exact_weight:
        y = F.linear(x.float(), dequantize(w), None if bias is None else bias.float()).to(x.dtype)
    else:
        y = F.linear(x, w.weight if w.scheme == "plain" else dequantize(w).to(x.dtype), bias)
    if epilogue == "residual":
        if out is None:
            raise ValueError("epilogue 'residual' needs out (the residual [N, R]) to add into")
        return out.add_(y)
    if epilogue == "silu_mul":
        S = y.shape[1] // 2
        y = F.silu(y[:, :S]) * y[:, S:]
    elif epilogue == "gated":
        if gate is None:
            raise ValueError("epilogue 'gated' needs gate (logits [N, 1])")
        y = torch.sigmoid(gate) * y
    return y if out is None else out.copy_(y)


def _int8_values(row: torch.Tensor, quantize) -> torch.Tensor:
    """fp64 [C]: the values a W4A8 kernel multiplies for x's ``row``: q times its group's scale."""
    q, scale = quantize(row)
    return (q.double().reshape(scale.numel(), -1) * scale.double()[:, None]).reshape(-1)


def random_qweight(
    scheme: str,
    R: int,
    C: int,
    group: int,
    gen: torch.Generator,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> QWeight:
    """A random [R, C] weight (normal, std C^-1/2) stored as ``scheme`` by the bundle's own
    quantizers: real bytes, int4 codes in the range quantize_int4 writes. ``dtype`` is a plain
    weight's dtype; ``group`` is ignored for plain, C for int8 with one scale per row."""
    src = torch.randn(R, C, generator=gen, device=device) * C**-0.5
    if scheme == "plain":
        return QWeight("plain", src.to(dtype))
    if scheme == "int8":
        q, scales = quantize_int8(src, group)
        return QWeight("int8", q, scales, group=group)
    if scheme == "int4":
        packed, codes, gscale = quantize_int4(src, group)
        row_scale = torch.full((R,), gscale, dtype=torch.float32, device=device)
        return QWeight("int4", packed, codes, row_scale, group)
    raise ValueError(f"scheme {scheme!r} is not plain, int8 or int4")


def epilogue_inputs(
    epilogue: str, w: QWeight, N: int, gen: torch.Generator, device, dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(out, gate) a call with this epilogue needs: a random residual for ``residual``, random
    logits for ``gated``, else None."""
    if epilogue == "residual":
        return torch.randn(N, w.rows, generator=gen, device=device).to(dtype), None
    if epilogue == "gated":
        return None, (torch.randn(N, 1, generator=gen, device=device) * 2).to(dtype)
    return None, None


NORMS = ("none", "unit", "plain")  # no norm prologue; RMSNorm scaling by (1 + w); by w


def random_norm(
    kind: str, C: int, gen: torch.Generator, device, dtype
) -> tuple[torch.Tensor, float, bool] | None:
    """A trained-like RMSNorm (weight, eps, unit_offset) of ``kind`` (NORMS), or None."""
    if kind == "none":
        return None
    center = 0.0 if kind == "unit" else 1.0
    return (torch.randn(C, generator=gen, device=device) * 0.3 + center).to(dtype), 1e-6, kind == "unit"


def probe_cases(
    shapes: list[tuple],
    device: torch.device | str,
    dtype: torch.dtype,
    tokens: int = 1,
    planes: bool = False,
    act: str = "bf16",
) -> float:
    """Run ``qgemv`` (``planes``: ``qgemv_planes`` on the weight repacked) against ``qlinear_ref``
    on random weights for each case (scheme, R, C, group, epilogue[, norm]), twice: the worst
    error relative to the output's scale, or Mismatch if a case is over TOLERANCE[dtype], not
    finite, or does not repeat bit for bit. A case with a norm (NORMS) also checks the
    normalised x the kernel writes out. ``act`` int8: each weight takes int8 activations (W4A8;
    int4 g32 cases), against the reference that quantizes x the same way. On CUDA, or on CPU under
    Triton's interpreter (the tests)."""
    from edgerun.kernels import qlinear_planes as P
    from edgerun.kernels.qlinear_triton import qgemv, unsupported

    def gemv(x, w, bias, epilogue, out, gate, norm, norm_out):
        if not planes:
            return qgemv(x, w, bias, epilogue, out, gate, norm=norm, norm_out=norm_out)
        pw = P.planes_weight(w)
        return P.qgemv_planes(
            x, pw, bias, epilogue, out, gate, norm, norm_out, count=P.planes_counters(pw, x.device)
        )

    if dtype not in TOLERANCE:
        raise Mismatch(f"no kernel for model dtype {dtype}")
    tol = TOLERANCE[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    worst = 0.0
    for case in shapes:
        scheme, R, C, group, epilogue = case[:5]
        kind = case[5] if len(case) > 5 else "none"
        what = f"{'qgemv_planes' if planes else 'qgemv'} {scheme} [{R}, {C}] group {group} {epilogue}" + (
            f" norm {kind}" if kind != "none" else ""
        )
        w = random_qweight(scheme, R, C, group, gen, device, dtype)
        if act != "bf16":
            w = dataclasses.replace(w, act=act)
            w.check(what)
            what += f" {act} activations"
        why = P.planes_unsupported(w, dtype) if planes else unsupported(w)
        if why:
            raise Mismatch(f"{what}: {why}")
        x = (torch.randn(tokens, C, generator=gen, device=device) * 3).to(dtype)
        residual, gate = epilogue_inputs(epilogue, w, tokens, gen, device, dtype)
        norm = random_norm(kind, C, gen, device, dtype)
        normed = None if norm is None else torch.empty_like(x)
        ref = qlinear_ref(
            x,
            w,
            None,
            epilogue,
            None if residual is None else residual.clone(),
            gate,
            norm=norm,
            norm_out=normed,
        )
        runs, outs = [], []
        for _ in range(2):
            out = None if residual is None else residual.clone()
            no = None if norm is None else torch.empty_like(x)
            runs.append(gemv(x, w, None, epilogue, out, gate, norm, no))
            outs.append(no)
        checks = [(what, runs, ref)] + ([(f"{what}: normalised x", outs, normed)] if norm is not None else [])
        for name, got, want in checks:
            worst = max(worst, compare(name, got, want, tol))
    return worst


def rows_alone_mismatch(
    gemv, w: QWeight, rows: int, gen: torch.Generator, device, dtype, alone: bool = True
) -> str | None:
    """``gemv`` (``qgemv``) on N = 1..rows random rows (``alone``: each row by programs of its
    own; else one pass over all rows, each in accumulators of its own), with every epilogue and
    a norm prologue: each row must equal that row run alone (N = 1), bit for bit (a batch's
    step, engine/graphs.RowSteps). None, or what differs."""
    C = w.cols
    for epilogue in (
        ("none", "silu_mul", "residual", "gated") if w.rows % 2 == 0 else ("none", "residual", "gated")
    ):
        norm = random_norm("unit", C, gen, device, dtype)
        x = torch.randn(rows, C, generator=gen, device=device).to(dtype)
        out, gate = epilogue_inputs(epilogue, w, rows, gen, device, dtype)
        width = w.rows // 2 if epilogue == "silu_mul" else w.rows
        for n in range(1, rows + 1):
            nout = torch.empty(n, C, dtype=dtype, device=device)
            got = gemv(x[:n], w, None, epilogue, None if out is None else out[:n].clone(), None if gate is None else gate[:n],
                       norm=norm, norm_out=nout, alone=alone)  # fmt: skip
            for r in range(n):
                one_out = torch.empty(1, C, dtype=dtype, device=device)
                one = gemv(x[r : r + 1], w, None, epilogue, None if out is None else out[r : r + 1].clone(),
                             None if gate is None else gate[r : r + 1], norm=norm, norm_out=one_out, alone=True)  # fmt: skip
                if not torch.equal(got[r], one[0]) or not torch.equal(nout[r], one_out[0]):
                    return f"{w.scheme} {list(w.weight.shape)} {epilogue}: row {r} of {n} differs from the row alone"
            if got.shape != (n, width):
                return f"{epilogue}: output {list(got.shape)}, expected {[n, width]}"
    return None
