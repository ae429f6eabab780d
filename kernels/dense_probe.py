"""Start-up capability probe for the dense decode kernels (kernels/dense_triton.py,
qlinear_triton.py, decode_triton.py).

A kernel is selected only after it ran on the device and matched its torch reference, never
because a symbol imports. ``probe_dense`` runs the model's own geometry on random inputs in the
model dtype, twice each: for a model with DeltaNet layers, ``delta_decode`` from a random
history and recurrent state; then the model's projection GEMVs (every scheme and shape, each
epilogue, the RMSNorm prologue), the router top-k and attention kernels, the
DeltaNet conv in the in_proj GEMV's launch against the conv's own launch (``conv_fold_cases``:
bit for bit), and the greedy pick (argmax and its logit: exact, so equal to torch's).

- accuracy: max |got - ref| <= TOLERANCE[dtype] * max |ref| for every output and for the
  recurrent state, ref = kernels/dense_reference.py on the same inputs; the conv state, a pure
  shift of stored values, must equal the reference's bit for bit. The kernels round to the model
  dtype wherever the modules do and otherwise differ only in fp32 summation order and
  transcendental ulps (about 1e-6 relative); through those, a rounded intermediate (a conv
  output, beta, the delta-rule output, the normalised value) now and then lands one ulp away,
  and that ulp carries into the final rounding (a few elements in 10^4 at the real geometry,
  max 8e-4 of the scale, under the CPU interpreter). A bf16 ulp is 2^-8 to 2^-7 of a value, so
  two ulps of the largest output are at most 1.6e-2 of the scale: 2e-2 allows that (fp16:
  2^-11 to 2^-10 an ulp, 5e-3; fp32: 1e-4, a hundred times the summation-order noise), and
  still refuses real faults (a wrong head, tap, sign or decay moves the output by O(1) of its
  scale). Non-finite outputs fail.
- determinism: the two runs must be bitwise identical (outputs and both states).

Any exception (no Triton, no CUDA device, a compile error, an unsupported geometry) is a refusal
whose reason says why; the reference then runs. Nothing here reads or changes the environment.
"""

from __future__ import annotations

import torch

from edgerun.kernels.dense_reference import (
    DeltaDims,
    clone_inputs,
    delta_decode_ref,
    random_delta_inputs,
)
from edgerun.kernels.probe import ProbeResult

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


class Refused(Exception):
    """A probe case did not match; the message says which and by how much."""


def probe_dense(
    args, device: torch.device | str, dtype: torch.dtype = torch.bfloat16, gemv: list | tuple = ()
) -> ProbeResult:
    """Run the dense decode kernels at ``args``' geometry (a ModelArgs, or anything with its
    ``hidden_size``, ``num_attention_heads``, ``head_dim``, ``rms_norm_eps``,
    ``norm_unit_offset`` and ``linear_*`` attributes) on ``device`` in ``dtype`` and compare
    with the references; selected only if every case matches within TOLERANCE and repeats bit
    for bit. ``gemv``: the model's projection GEMV cases (scheme, rows, cols, group, epilogue),
    with the router top-k and attention kernels at ``args``' geometry (without: norms and
    DeltaNet only)."""
    kernels = ["delta_decode"] if _has_delta(args) else []
    if gemv:
        kernels += ["qgemv", "router_topk"] + (["attention_decode"] if _has_attention(args) else [])
        kernels += ["greedy"] if getattr(args, "vocab_size", 0) > 0 else []
    name = f"dense_triton[{', '.join(kernels)}]"
    try:
        selected, reason = True, _probe(args, torch.device(device), dtype, gemv)
    except Refused as e:
        selected, reason = False, str(e)
    except Exception as e:  # whatever broke, the reference runs and the reason says what
        selected, reason = False, f"{type(e).__name__}: {e}".strip()
    return ProbeResult(name, selected, reason)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| over max |ref|: the error relative to the output's scale."""
    return float((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def within(what: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    """``rel_err`` of a finite output, or Refused naming ``what`` when it is over ``tol``."""
    if not torch.isfinite(got).all():
        raise Refused(f"{what}: non-finite output")
    err = rel_err(got, ref)
    if err > tol:
        raise Refused(f"{what}: max error {err:.2e} of the output's scale is over {tol:g}")
    return err


def compare(what: str, runs: list[torch.Tensor], ref: torch.Tensor, tol: float) -> float:
    """Every probe's check of a kernel: its first run ``within`` tol of the reference, and a
    second run on the same inputs bit for bit the first."""
    err = within(what, runs[0], ref, tol)
    if not torch.equal(runs[0], runs[1]):
        raise Refused(f"{what}: two runs on the same inputs differ (not deterministic)")
    return err


def _has_delta(args) -> bool:
    return getattr(args, "linear_num_key_heads", 0) > 0


def _has_attention(args) -> bool:
    return any(t == "full_attention" for t in getattr(args, "layer_types", ()))


def _probe(args, device: torch.device, dtype: torch.dtype, gemv=()) -> str:
    if device.type != "cuda":
        raise Refused(f"Triton kernels run on CUDA devices; this one is {device}")
    if not torch.cuda.is_available():
        raise Refused("CUDA is not available to torch")
    try:
        import edgerun.kernels.dense_triton  # noqa: F401
    except ImportError as e:
        raise Refused(f"Triton is not importable: {e}") from e
    worst = run_cases(args, device, dtype, gemv)
    torch.cuda.synchronize(device)
    return (
        f"matched the references on {torch.cuda.get_device_name(device)} in {dtype} (max error "
        f"{worst:.1e} of the output's scale, limit {TOLERANCE[dtype]:g}) and repeated bit for bit"
    )


def run_cases(args, device: torch.device, dtype: torch.dtype, gemv=()) -> float:
    """The probe's cases on ``device`` (CUDA; CPU under Triton's interpreter, for the tests):
    the worst error relative to the output's scale, or Refused saying which case failed."""
    from edgerun.kernels import dense_triton as K
    from edgerun.kernels.decode_reference import probe_cases as decode_cases
    from edgerun.kernels.qlinear_reference import probe_cases as gemv_cases

    if dtype not in TOLERANCE:
        raise Refused(f"no kernel for model dtype {dtype}")
    tol = TOLERANCE[dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    eps = args.rms_norm_eps
    worst = 0.0
    if _has_delta(args):
        dims = DeltaDims.from_args(args)
        why = K.unsupported_delta(dims)
        if why:
            raise Refused(f"delta_decode: {why}")
        inputs = random_delta_inputs(dims, None, gen, device, dtype, eps)
        runs = [clone_inputs(inputs) for _ in range(2)]
        outs = [K.delta_decode(**r) for r in runs]
        ref = clone_inputs(inputs)
        want = delta_decode_ref(**ref)
        worst = max(worst, compare("delta_decode output", outs, want, tol))
        worst = max(worst, compare("delta_decode state", [r["state"] for r in runs], ref["state"], tol))
        if not all(torch.equal(r["conv_state"], ref["conv_state"]) for r in runs):
            raise Refused("delta_decode: the conv state differs from the reference's")
    if gemv:
        plain = [c for c in gemv if c[4] != "conv"]
        worst = max(worst, gemv_cases(plain, device, dtype), decode_cases(args, device, dtype))
        if _has_delta(args):
            conv_fold_cases([c for c in gemv if c[4] == "conv"], args, device, dtype, gen)
        if getattr(args, "vocab_size", 0) > 0:
            greedy_cases(args.vocab_size, device, dtype, gen)
    return worst


def conv_fold_cases(cases: list[tuple], args, device: torch.device, dtype: torch.dtype, gen) -> int:
    """A DeltaNet layer's one-row step with its conv in the in_proj GEMV's launch (``qgemv``'s
    ``conv``, for each case (scheme, rows, cols, group, "conv", norm kind) the model's in_proj
    folds: ``folds_conv``), then ``delta_decode`` on its ``act``, against the same step with the
    conv in a launch of its own: the projection, the output and both states equal bit for bit,
    and again on a second run (every act value reaches the output or the recurrent state, so
    a conv that differs shows). Refused names the case. Returns how many cases folded."""
    from edgerun.kernels import dense_triton as K
    from edgerun.kernels.qlinear_reference import random_norm, random_qweight
    from edgerun.kernels.qlinear_triton import folds_conv, qgemv

    dims = DeltaDims.from_args(args)
    folded = 0
    for scheme, rows, cols, group, _, kind in cases:
        what = f"qgemv {scheme} [{rows}, {cols}] group {group} with the DeltaNet conv in its launch"
        w = random_qweight(scheme, rows, cols, group, gen, device, dtype)
        if not folds_conv(w, cols, dims.conv_dim):
            continue  # the step runs the conv in its own launch, probed with delta_decode
        norm = random_norm(kind, cols, gen, device, dtype)
        x = (torch.randn(1, cols, generator=gen, device=device) * 3).to(dtype)
        inputs = random_delta_inputs(dims, 1, gen, device, dtype, args.rms_norm_eps)
        split = [dims.conv_dim, dims.value_dim, dims.n_v, rows - dims.conv_dim - dims.value_dim - dims.n_v]
        runs = []
        for fold in (False, True, True):
            r = clone_inputs(inputs)
            act = torch.empty(1, dims.conv_dim, dtype=torch.float32, device=device) if fold else None
            y = qgemv(x, w, norm=norm, conv=(r["conv_state"], r["conv_weight"], act) if fold else None)
            qkv, z, b, a = y.split(split, dim=-1)
            a = a[:, : dims.n_v]
            out = K.delta_decode(**{**r, "mixed_qkv": qkv, "z": z, "a": a, "b": b}, act=act)
            runs.append((y, out, r["state"], r["conv_state"]))
        for run, (other, how) in enumerate(((runs[0], "the conv's own launch"), (runs[1], "the first run"))):
            for name, got, want in zip(("projection", "output", "state", "conv state"), runs[run + 1], other):
                if not torch.equal(got, want):
                    raise Refused(f"{what}: the {name} differs from {how}'s")
        folded += 1
    return folded


def greedy_cases(vocab: int, device: torch.device, dtype: torch.dtype, gen: torch.Generator) -> None:
    """``sample_triton.greedy`` against ``torch.argmax`` and ``torch.gather`` on rows of ``vocab``
    logits: random, a tie for the largest (the first index wins), a NaN (it wins), all -inf;
    equal, twice (a split row's scratch is left as found), or Refused naming the row. The second
    run writes its picks to the host too (``direct``, as a one-sequence decode step's greedy
    launch does: pinned slots on a GPU): each row's slot and advanced position checked."""
    from edgerun.kernels.sample_triton import greedy, greedy_scratch

    logits = (torch.randn(4, vocab, generator=gen, device=device) * 4).to(dtype)
    top = logits[1].max()
    logits[1, vocab // 3], logits[1, -1] = top, top
    logits[2, (2 * vocab) // 3] = float("nan")
    logits[3] = float("-inf")
    want = torch.argmax(logits, dim=-1)
    chosen_want = torch.gather(logits, -1, want[:, None])[:, 0]
    scratch = greedy_scratch(4, device)
    pinned = device.type == "cuda"
    start = [6, 3, 0, 9]
    pos = torch.tensor(start, device=device)
    host_token = torch.full((2, 4), -1, dtype=torch.int64, pin_memory=pinned)
    host_chosen = torch.zeros(2, 4, dtype=dtype, pin_memory=pinned)
    for run in range(2):
        token, chosen = torch.full_like(want, -1), torch.zeros_like(chosen_want)
        greedy(logits, token, chosen, scratch, direct=(pos, host_token, host_chosen) if run else None)
        if run:
            if pinned:
                torch.cuda.synchronize(device)  # the host slots are written by the launch itself
            rows, slot = torch.arange(4), torch.tensor(start) % 2
            got_token, got_chosen = host_token[slot, rows], host_chosen[slot, rows]
            same = torch.equal(got_token, token.cpu()) and torch.equal(
                got_chosen.isnan(), chosen.cpu().isnan()
            )
            same = same and torch.equal(got_chosen.nan_to_num(), chosen.cpu().nan_to_num())
            if not same or pos.tolist() != [p + 1 for p in start]:
                raise Refused(
                    f"greedy (direct): host slots hold {got_token.tolist()} for picks {token.tolist()}, "
                    f"positions {pos.tolist()} for {[p + 1 for p in start]}"
                )
        for r in range(4):
            same = bool(chosen[r].isnan()) == bool(chosen_want[r].isnan())
            same = same and (bool(chosen[r].isnan()) or bool(chosen[r] == chosen_want[r]))
            if int(token[r]) != int(want[r]) or not same:
                raise Refused(
                    f"greedy (run {run + 1}): row {r} of {vocab} logits picks {int(token[r])} "
                    f"({float(chosen[r])}) where torch.argmax picks {int(want[r])} ({float(chosen_want[r])})"
                )
