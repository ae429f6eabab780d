"""The Gated DeltaNet delta rule over a prompt chunk on CUDA: flash-linear-attention's chunked
Triton kernels (``fla-core``, the library transformers itself runs for this layer), selected by a
start-up probe against the torch reference (``dense_reference.delta_rule_chunked``).

Why a library: the chunked form (a WY representation of each 64-token chunk, a triangular solve,
then the state carried across chunks) is several tuned kernels; fla-core maintains them for
this exact layer and its outputs match our fp32 reference within the tolerance below on an H200
(docs/benchmarks.md: 2-15x faster than the torch reference at 512-4096 tokens).

Numerics: inputs go in as fp32 (the reference's precision). fla-core multiplies with TF32
tensor cores, so it differs from the fp32 reference by about 2e-3 of the output's scale at the
Qwen3.6 geometry (bf16 inputs: 6e-3); TOLERANCE = 1e-2 leaves a margin of 5 and still refuses a
wrong head, gate or state (O(1) of the scale). fla-core autotunes its tiles once per process, so
two processes may differ within that tolerance; within a process the bits repeat (probed).

Used for bf16 / fp16 models only: an fp32 model keeps the reference's fp32 precision.
Importing this module imports neither fla-core nor Triton.
"""

from __future__ import annotations

import torch

from edgerun.kernels.dense_reference import delta_rule_chunked, l2norm
from edgerun.kernels.probe import ProbeResult

TOLERANCE = 1e-2
NAME = "fla-core chunk_gated_delta_rule"


def fla_version() -> str | None:
    """fla-core's version, or None when it is not installed (the package imports Triton)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fla-core")
    except PackageNotFoundError:
        return None


def delta_rule_fla(q, k, v, g, beta, state):
    """The delta rule of one chunk through fla-core, in its layout: q, k [B, T, Hk, Dk] fp32 (q
    L2-normalised and scaled, k normalised), v [B, T, Hv, Dv], g and beta [B, T, Hv], state
    [B, Hv, Dk, Dv] fp32; value head h reads key head h // (Hv / Hk) (grouped heads, as
    ``repeat_interleave`` pairs them). -> (out [B, T, Hv, Dv], final state); ``state`` is not
    written."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0, initial_state=state, output_final_state=True)


def reference_bthk(q, k, v, g, beta, state):
    """``delta_rule_fla``'s contract through the torch reference (``delta_rule_chunked``)."""
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    out, final = delta_rule_chunked(*(t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta)), state)
    return out.transpose(1, 2), final


def random_inputs(dims, tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``delta_rule_fla``'s arguments at ``dims``' geometry (``DeltaDims``), random, on ``gen``'s
    device: q and k L2-normalised (q scaled), v normal, log decays in (-2, 0], beta in (0, 1), a
    state of scale 0.1. The probe's, the tests' and the benchmark's case."""
    dev, T = gen.device, tokens

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=dev)

    q = l2norm(rand(1, T, dims.n_k, dims.dk)) * dims.dk**-0.5
    k = l2norm(rand(1, T, dims.n_k, dims.dk))
    v = rand(1, T, dims.n_v, dims.dv)
    g = -torch.rand(1, T, dims.n_v, generator=gen, device=dev) * 2
    beta = torch.rand(1, T, dims.n_v, generator=gen, device=dev)
    return q, k, v, g, beta, rand(1, dims.n_v, dims.dk, dims.dv) * 0.1


def probe_chunk(dims, device: torch.device | str, tokens: int = 200) -> ProbeResult:
    """Run ``delta_rule_fla`` at the model's DeltaNet geometry (``DeltaDims``) on random inputs
    from a random state, twice: selected when both outputs and states are within TOLERANCE of
    the reference (relative to their scale) and the runs are bitwise equal. ``tokens`` is not a
    multiple of 64, so a partial chunk is covered."""
    device = torch.device(device)
    try:
        if device.type != "cuda":
            raise RuntimeError(f"fla-core's kernels run on CUDA; the device is {device}")
        version = fla_version()
        if version is None:
            raise RuntimeError("fla-core is not installed (pip install 'edgerun[gpu]')")
        q, k, v, g, beta, s0 = random_inputs(dims, tokens, torch.Generator(device=device).manual_seed(0))
        want, want_s = reference_bthk(q, k, v, g, beta, s0.clone())
        runs = [delta_rule_fla(q, k, v, g, beta, s0.clone()) for _ in range(2)]
        torch.cuda.synchronize(device)
        worst = 0.0
        for what, i, ref in (("output", 0, want), ("state", 1, want_s)):
            got = runs[0][i].float()
            err = float((got - ref).abs().max() / ref.abs().max())
            if not err <= TOLERANCE:  # NaN fails too
                raise RuntimeError(
                    f"{what} differs from the reference by {err:.1e} of its scale (limit {TOLERANCE:g})"
                )
            if not torch.equal(runs[0][i], runs[1][i]):
                raise RuntimeError(f"{what}: two runs on the same inputs differ")
            worst = max(worst, err)
        return ProbeResult(
            f"{NAME} {version}",
            True,
            f"matched the reference within {worst:.1e} of the output's scale (limit {TOLERANCE:g}) and repeated",
        )
    except Exception as e:  # any failure (import, compile, mismatch) refuses, with its reason
        why = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
        return ProbeResult(NAME, False, why)
