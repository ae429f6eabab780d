"""The decode path, top to bottom: load, prefill (chunked), one decode step, generate.

The runner owns the model and its device. ``generate`` yields text deltas as tokens arrive and
leaves the request's statistics in the final :class:`Event` (``finish_reason`` set). Before the
first token it yields an empty event after each prefill chunk, where a caller may feed a
watchdog, or stop (closing the generator) without waiting for the rest of the prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from edgerun.budget.planner import static_capacity
from edgerun.cache.reader import READ_FALLBACKS
from edgerun.config import CacheConfig
from edgerun.engine.batch import DecodeBatch, Row
from edgerun.engine.events import Event, GenerationStats, SpeculativeStats
from edgerun.engine.graphs import (
    PREFILL_GRAPH_TOKENS,
    DecodeCounters,
    DecodeGraphs,
    PrefillGraphs,
    PrefillLanes,
    RowSteps,
    expert_mode,
    greedy_pick,
    rows_unsupported,
)
from edgerun.engine.policy import KernelPolicy, Resolved, resolve
from edgerun.engine.request import Limits, Request, check_request
from edgerun.engine.sampler import NonFiniteLogits, Sampler, SamplingParams
from edgerun.engine.setup import default_device
from edgerun.engine.spec_steps import SPEC_HEADROOM, SpecSteps, chain_unsupported
from edgerun.engine.speculative import MtpDrafter, SpeculativeConfig, accept, draft_chooser
from edgerun.engine.streaming import HeldExperts, StreamingExperts, hold_resident_experts, resident_layout
from edgerun.errors import ConfigError, EdgerunError
from edgerun.models.args import ModelArgs
from edgerun.models.layers import MAX_GEMV_ROWS, DecodeState, SparseMoe, exact_rows, planes_cases
from edgerun.models.providers import ProviderPolicy, Resolution
from edgerun.tokenizer import StreamDecoder, Tokenizer

DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo"
log = logging.getLogger(__name__)


def peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    # the process's high-water mark (Linux reports KiB); getrusage's can lag the current
    # resident size, which a peak is never below
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    peak = max(peak, int(line.split()[1]) * 1024)
    except OSError:
        pass
    return peak


class Runner:
    def __init__(
        self,
        model: torch.nn.Module,
        args: ModelArgs,
        tokenizer: Tokenizer | None,
        device: str | torch.device = "cpu",
        max_context: int | None = None,
        prefill_chunk: int = 512,
    ) -> None:
        self.model = model
        self.args = args
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        if not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ConfigError(f"prefill_chunk must be at least 1, got {prefill_chunk!r}")
        if max_context and max_context > args.max_position_embeddings:
            log.warning(
                "context %d is more than the model's %d (max_position_embeddings): %d used",
                max_context, args.max_position_embeddings, args.max_position_embeddings,
            )  # fmt: skip
        self.max_context = min(max_context or args.max_position_embeddings, args.max_position_embeddings)
        self.prefill_chunk = prefill_chunk
        eos = tokenizer.eos_token_ids if tokenizer else args.eos_token_ids
        self.eos_ids = frozenset(eos or args.eos_token_ids)
        self.load_summary = ""
        self.cache = None  # ExpertCache when experts stream
        self.provider: Resolution | None = None  # the architecture's provenance, set by load()
        self.kernels: Resolved = resolve(KernelPolicy(), self.device)  # load() resolves the request
        self.decoder = None  # DecodeGraphs on CUDA, sized for the longest request so far
        self.warm_tokens = 0  # decode steps run by ``warm_up`` whose expert lookups the cache counted
        self.steps = DecodeCounters()  # decode steps by how they ran, across decoder rebuilds
        self.prefill_graphs = True  # prompts' first chunks through PrefillGraphs where they can be
        # a batch's prompts' first chunks in this many lanes at once (engine/graphs.PrefillLanes;
        # 1: one after another on the decoder's own prefill graphs)
        self.prefill_lanes = 1
        self.lanes: PrefillLanes | None = None
        self.routes = None  # a RouteRecorder (engine/trace.py) that also takes the decoder's steps
        self._fallback_steps: dict[str, int] = {}  # engine steps run under each kernel/graph/pool fallback
        self.load_fallbacks: dict[str, tuple[str, int]] = {}  # kind -> (reason, blocks) loading took
        self.threads_note: str | None = None  # why the CPU thread count is what it is, if chosen
        self.nonfinite_logits = 0  # requests stopped because a step's logits were NaN or infinite
        self.sampled = {"device": 0, "host": 0}  # sampled (not greedy) tokens by where they were drawn
        self.batch: DecodeBatch | None = None  # set by enable_batch: requests decode together
        self.row_steps: RowSteps | None = None  # the batch's steps on CUDA
        self.speculative: SpeculativeConfig | None = None  # set by enable_speculative
        self.spec_totals = SpeculativeStats()  # across requests
        self.spec_plain_requests = 0  # sampled requests that decoded plainly (SpeculativeConfig.sampled)
        self.row_step_s = 0.0  # a plain one-row decode step's time, probed by enable_speculative
        self.last_speedup = 0.0  # the last speculative request's decode rate over 1 / row_step_s
        self.window_note = ""  # CUDA: how a verify window's projections run, as its probe found
        self.window_fallbacks: dict[str, str] = {}  # the window probe's, by kind
        self.planes = 0  # projections on the tensor-core GEMV (a batch's, ``_use_planes``)
        self.planes_refused: str | None = None  # why its probe kept them off it

    def enable_batch(self, size: int, planes: bool = True, lanes: int = 1) -> None:
        """Decode up to ``size`` requests together (engine/batch.py): each one's generator
        joins a slot of one state pool and its decode steps are multi-row steps over every
        request decoding; refused, saying why, where it cannot run. 1: one request at a time.
        ``planes``: on CUDA, the large int4 projections on the tensor-core GEMV (``_use_planes``).
        ``lanes``: on CUDA, joiners' first prompt chunks prefill in that many lanes at once
        (engine/graphs.PrefillLanes); at most ``size``."""
        if size < 1:
            raise EdgerunError(f"batch must be >= 1, got {size}")
        if lanes < 1:
            raise EdgerunError(f"prefill lanes must be >= 1, got {lanes}")
        if lanes > 1 and (size < 2 or self.device.type != "cuda"):
            raise EdgerunError(
                f"prefill lanes {lanes}: lanes prefill a CUDA batch's prompts (batch {size} on "
                f"{self.device}); use 1"
            )
        if size > 1 and self.speculative is not None:
            raise EdgerunError("speculative decoding and batched decoding do not combine yet; choose one")
        if size > 1 and self.device.type == "cuda":
            why = rows_unsupported(
                self.kernels.dense == "triton", self._expert_modes(), self.model.model.layers
            )
            if why:
                raise EdgerunError(f"batched decoding on {self.device}: {why}; serve with batch 1")
        if size > MAX_GEMV_ROWS and self.kernels.dense == "triton":
            raise EdgerunError(
                f"batch {size}: a step's GEMVs take at most {MAX_GEMV_ROWS} rows; --batch {MAX_GEMV_ROWS} is the most"
            )
        fits = self._rows_fit(size) if size > 1 and self.kernels.dense == "triton" else None
        if fits is not None:  # a step's lookup holds every row's experts at once
            self._refuse_rows(f"batch {size}: a step of {size} rows", size, "B", f"--batch {fits} fits")
        self.batch, self.row_steps = None, None
        self.prefill_lanes, self.lanes = min(lanes, size), None
        self.model.share_rows(False)
        self._use_planes(size if planes else 1)
        if size > 1:
            self.batch = DecodeBatch(
                self.model, size, self.max_context, self.device, self.batch_step, self._advance_rows
            )
            if self.kernels.dense == "triton":  # the fused kernels: static steps over the pool
                self.model.share_rows(True)  # one GEMV for all rows, unless the probe refuses it
                self._build_row_steps()
                if self.planes_refused:
                    self.row_steps.own_fallbacks["batch_gemv_planes"] = self.planes_refused

    def _use_planes(self, size: int) -> None:
        """A batch of ``size`` > 1 on CUDA runs its large int4 projections on the tensor-core GEMV
        (``Model.use_planes``), whose cost hardly grows with a step's rows, for every row count
        (its bits are not ``qgemv``'s, so one-row steps too), once it matched the reference on
        this device at 1 and ``size`` rows; otherwise (a mismatch, or a kernel the device cannot
        build) they stay on ``qgemv`` (a fallback, named in ``fallbacks`` and counted a step).
        1 (a batch-1 daemon, or serve --batch-gemv rows) puts them back on ``qgemv``."""
        from edgerun.kernels.qlinear_reference import Mismatch, probe_cases

        on = size > 1 and self.kernels.dense == "triton" and self.device.type == "cuda"
        taken = self.model.use_planes(on)
        self.planes_refused = None
        if taken:
            dtype = self.model.model.embed_tokens.weight.dtype
            try:
                for n in sorted({1, size}):
                    probe_cases(planes_cases(taken), self.device, dtype, tokens=n, planes=True)
            except Exception as exc:  # a mismatch, or a kernel this device cannot build: named, not fatal
                self.model.use_planes(False)
                taken = []
                why = str(exc) if isinstance(exc, Mismatch) else f"{type(exc).__name__}: {exc}"
                self.planes_refused = f"the batch's projections on qgemv (2+ rows cost more): {why}"
        self.planes = len(taken)

    def _build_row_steps(self) -> None:
        self.row_steps = RowSteps(
            self.model, self.args, self.cache, self.kernels, self.device, self.batch.pool, self.steps
        )

    @torch.inference_mode()
    def probe_batch(self) -> str:
        """The batch's promise, checked before serving: for each row count n (on CUDA every one
        from 2 to B, each its own graphs and kernels; elsewhere min(B, 3)), n sequences at
        different positions, each one's step alone against its row of one n-row step, bit for
        bit, twice (on CUDA the first pass captures, the second replays), so no request pays for
        a capture either. On CUDA the projections first run each step's rows in one GEMV
        (``Model.share_rows``); if a row then differs, they run each row by programs of its own
        (the weight read per row, slower: a fallback, named and counted) and the probe runs
        again. Raises :class:`EdgerunError` naming what differs; returns the line to log."""
        b = self.batch
        counts = range(2, b.size + 1) if self.row_steps is not None else [min(b.size, 3)]
        shared = self.row_steps is not None  # built only with the Triton dense kernels
        try:
            self._probe_counts(counts)
        except EdgerunError as exc:
            if not shared:
                raise
            self.model.share_rows(False)
            self._build_row_steps()
            self.row_steps.own_fallbacks["batch_gemv"] = (
                f"each row's projections by programs of its own (weights read per row): {exc}"
            )
            self._probe_counts(counts)
            shared = False
        how = (
            "projections: one GEMV for all rows" if shared else "projections: each row by its own programs"
        ) if self.row_steps is not None else "torch kernels"  # fmt: skip
        how += f", {self.planes} of them on the tensor-core GEMV" if self.planes else ""
        n = ", ".join(str(c) for c in counts)
        return f"a {n}-row batch step equals its rows' one-row steps, bit for bit (batch {b.size}; {how})"

    def _probe_counts(self, counts) -> None:
        for n in counts:
            prompts = [list(range(1, r + 2)) for r in range(n)]  # lengths 1..n: each row its own position
            tokens = [r + 3 for r in range(n)]
            for _ in range(2):
                alone = [self._probe_rows([p], [t])[0] for p, t in zip(prompts, tokens, strict=True)]
                together = self._probe_rows(prompts, tokens)
                differs = f"row {{r}} of a {n}-row decode step differs from its sequence's one-row step"
                check_rows("batch probe", alone, together, differs + "; serve with batch 1")

    def _probe_rows(self, prompts: list[list[int]], tokens: list[int], steps: int = 1) -> torch.Tensor:
        """Sequences joined to the batch, prefilled with ``prompts``, stepped together ``steps``
        times (first with ``tokens``, then each row's greedy token), then freed: the last step's
        logits [N, V]."""
        rows = []
        try:
            for p in prompts:
                rows.append(self.batch.join(len(p) + steps))
                self.prefill(rows[-1].state, p)
            for _ in range(steps):
                logits, _ = self.batch_step([r.slot for r in rows], [r.state for r in rows], tokens)
                tokens = logits.argmax(-1).tolist()
            return logits
        finally:
            for r in rows:
                self._settle(r)
                self.batch.leave(r)

    def _advance_rows(self, rows: list[Row]) -> list[int] | None:
        """The batch's step over its fed ``rows``: on CUDA (``RowSteps.advance``) greedy rows run
        a step ahead, unless a route recorder needs each step's routes before the next runs;
        elsewhere None (the batch runs :meth:`batch_step`). Returns the row counts of the steps
        queued."""
        if self.row_steps is None:
            return None
        sizes = self.row_steps.advance(rows, pipeline=self.routes is None)
        for _ in sizes:
            self._count_step()
        return sizes

    def _expert_modes(self) -> dict[int, str]:
        """How a decode step would run each MoE layer's experts (``DecodeGraphs``' modes)."""
        layers = self.model.model.layers
        return {
            i: expert_mode(layer.mlp.experts, self.kernels)[0]
            for i, layer in enumerate(layers)
            if isinstance(layer.mlp, SparseMoe)
        }

    @torch.inference_mode()
    def batch_step(self, slots: list[int], states: list[DecodeState], tokens: list[int]):
        """One step of the batch's fed rows (row n: ``tokens[n]`` continues ``states[n]``, the
        pool's entry ``slots[n]``): (logits [N, V], greedy picks or None), each row bit for bit
        the sequence's own step whichever rows share it. CUDA: ``RowSteps``, whose graphs also
        choose each row's greedy token (the fused kernels under Triton's interpreter too);
        the CPU's torch kernels: :meth:`decode_rows`."""
        if self.row_steps is None:
            return self.decode_rows(states, tokens), None
        logits, picked, chosen = self.row_steps.step(slots, [s.pos for s in states], tokens)
        for s in states:
            s.pos += 1
        self._count_step()
        return logits, list(zip(picked, chosen, strict=True))

    def enable_speculative(self, config: SpeculativeConfig | None) -> None:
        """Decode by drafting with the model's MTP head (loaded before: ``load_mtp``) and verifying
        the drafts; refused, saying why, where it cannot run. None: plain decoding."""
        if config is not None:
            if self.batch is not None:
                raise EdgerunError("speculative decoding and batched decoding do not combine yet; choose one")
            if getattr(self.model, "mtp", None) is None:
                raise EdgerunError("speculative mtp: the model's MTP head is not loaded")
            if self.device.type == "cuda":  # verify windows run the decode step's kernels (graphs.py)
                why = rows_unsupported(
                    self.kernels.dense == "triton", self._expert_modes(), self.model.model.layers, True
                )
                if why:
                    raise EdgerunError(f"speculative mtp on {self.device}: {why}; run without --speculative")
            self._check_window_quota(config.draft_tokens)
            self.row_step_s = self._probe_row_step()
            if self.device.type == "cuda":
                self.window_note = self._probe_windows(config.draft_tokens)
        self.speculative = config

    def _check_window_quota(self, draft_tokens: int) -> None:
        """A verify window of K + 1 rows may route to top_k x (K + 1) distinct experts per layer;
        a streamed layer's quota must hold them all (as it holds one step's top_k), else refused,
        naming the draft count that fits."""
        fits = self._rows_fit(draft_tokens + 1)
        if fits is not None:
            hint = f"--draft-tokens {min(fits - 1, 4)} fits" if fits >= 2 else "no draft count fits"
            what = f"speculative mtp with {draft_tokens} draft token(s): a verify window"
            self._refuse_rows(what, draft_tokens + 1, "(K + 1)", hint)

    def _rows_fit(self, rows: int) -> int | None:
        """None where a streamed layer's quota holds every expert a step of ``rows`` rows may
        route to (top_k x rows, at most E); else the most rows it holds."""
        if self.cache is None:
            return None
        k, E = self.args.num_experts_per_tok, self.args.num_experts
        quota = min(self.cache.quotas.values())
        return None if quota >= min(E, k * rows) else quota // k

    def _refuse_rows(self, what: str, rows: int, label: str, hint: str) -> None:
        k, E = self.args.num_experts_per_tok, self.args.num_experts
        need = min(E, k * rows)
        quota = min(self.cache.quotas.values())
        raise ConfigError(
            f"{what} needs up to top_k x {label} = {need} experts per layer, the expert cache's quota is "
            f"{quota}: {hint} (or raise the quota to {need})"
        )

    @torch.inference_mode()
    def _probe_windows(self, draft_tokens: int) -> str:
        """A verify window's promise on CUDA, checked before serving: each window of 2..K + 1
        rows, its row j bit for bit the one-row step at its position (twice: the first pass
        captures, the second replays). The projections first run a window's rows in one GEMV
        (``Model.share_rows``, the weight read once); if a row then differs, each row by
        programs of its own (the weight read per row: a fallback, named and counted) and the
        probe runs again. Raises :class:`EdgerunError` naming what differs; returns the line
        the start-up shows. ``auto`` shares only the projections whose weight is larger than the
        GPU's L2 cache (``--window-rows shared``: all of them): a smaller one's rows, each by
        programs of its own, read it again from L2 in parallel, which a window of a few rows on a
        small model finishes sooner than one pass taking its rows one after another."""
        alone = self.kernels.window_rows == "alone"
        above = l2_bytes(self.device) if self.kernels.window_rows == "auto" else 0
        shared = self.model.share_rows(not alone, above)
        try:
            self._probe_window_rows(draft_tokens + 1)
            if alone:
                how = "each row by its own programs (by request)"
            elif above:
                how = (
                    f"one GEMV for all rows for the {shared} weight(s) larger than L2 "
                    f"({above / 2**20:.0f} MiB), each row by its own programs below"
                )
            else:
                how = "one GEMV for all rows"
        except EdgerunError as exc:
            if alone:
                raise
            self.model.share_rows(False)
            self.window_fallbacks["verify_gemv"] = (
                f"each row's projections by programs of its own (weights read per row): {exc}"
            )
            self._probe_window_rows(draft_tokens + 1)
            how = "each row by its own programs"
        finally:
            self.decoder.reset()
        rows = ", ".join(str(n) for n in range(2, draft_tokens + 2))
        return f"verify windows of {rows} rows equal their one-row steps, bit for bit (projections: {how})"

    def _probe_window_rows(self, most: int) -> None:
        counted = dataclasses.replace(self.steps)  # the probe's steps are not the engine's
        prompt, tokens = [1, 2, 3], [4, 5, 6, 7, 8][:most]
        try:
            for n in range(2, most + 1):
                for _ in range(2):
                    state = self.decoder.reset()
                    self.prefill(state, prompt)
                    alone = [self.decoder.step(t).clone() for t in tokens[:n]]
                    state = self.decoder.reset()
                    self.prefill(state, prompt)
                    logits, _ = self.decoder.verify(tokens[:n], most)
                    differs = f"row {{r}} of a {n}-row window differs from the one-row step at its position"
                    check_rows("verify window probe", alone, logits, differs)
        finally:
            vars(self.steps).update(vars(counted))

    @torch.inference_mode()
    def _probe_row_step(self, steps: int = 8) -> float:
        """The median time of a plain one-row decode step (after two warm-up steps), the rate a
        speculative request's is compared with (``GenerationStats.speedup``): on CUDA the
        decoder's step (graphs where they replay), which the probe's steps warm up and capture;
        not counted among the engine's steps."""
        if self.device.type == "cuda":
            c = self.steps
            counted = (c.graph_steps, c.mixed_steps, c.eager_steps)
            with torch.inference_mode(False):  # as a request makes it, so a request can reset it
                self.new_state(steps + 3)
            self.decoder.step(0)
            times = []
            for i in range(steps + 2):
                torch.cuda.synchronize(self.device)
                t = time.perf_counter()
                self.decoder.step(i + 1)
                torch.cuda.synchronize(self.device)
                times.append(time.perf_counter() - t)
            c.graph_steps, c.mixed_steps, c.eager_steps = counted
            self.decoder.reset()
            return statistics.median(times[2:])
        state = self.model.new_state(1, steps + 3, device=self.device)
        self.model(torch.zeros(1, 1, dtype=torch.long, device=self.device), state)
        times = []
        for i in range(steps + 2):
            t = time.perf_counter()
            self.model(torch.full((1, 1), i + 1, dtype=torch.long, device=self.device), state, last_only=True)
            times.append(time.perf_counter() - t)
        return statistics.median(times[2:])

    @property
    def limits(self) -> Limits:
        return Limits(self.args.vocab_size, self.max_context)

    def set_kernels(self, request: KernelPolicy) -> None:
        """Resolve the kernel policy against the device (probing each kernel) and hand the
        result to every part that runs one."""
        layouts = list(self.cache.bundle.layouts.values()) if self.cache else []
        layouts += [m.layout for m in self.model.modules() if isinstance(m, HeldExperts)]
        # resident stacked experts on CUDA: held as bf16 blocks where the Triton expert kernel is
        # selected (probed on that layout), so they run its table mode as a bundle's held experts do
        hold = (
            resident_layout(self.model, self.args, self.device)
            if request.experts in ("auto", "triton")
            else None
        )
        dtype = self.model.model.embed_tokens.weight.dtype
        self.kernels = resolve(
            request,
            self.device,
            list(dict.fromkeys(layouts + ([hold] if hold is not None else []))),
            self.args.num_experts_per_tok,
            self.args,
            dtype,
            self.model.gemv_cases(),
        )
        split = any(getattr(m, "split", None) is not None for m in self.model.modules())
        if self.kernels.moe.act == "int8" and split:  # asked for by name: refused, not fallen back from
            raise ConfigError(
                "--expert-act int8 does not combine with --cpu-experts: the CPU's share of a split step "
                "takes x as it is, so a step's experts would see two different x"
            )
        if hold is not None and self.kernels.moe.impl == "triton":
            n = hold_resident_experts(self.model, hold, self.kernels.moe, self.device)
            self.load_summary += (
                f"; routed experts held as bf16 blocks for the expert kernels ({n / 2**20:.1f} MiB)"
            )
        elif hold is not None and not layouts:  # refused: the stacked experts run torch's products
            self.kernels.choices["experts"] = "torch (stacked resident weights)"
        for module in self.model.modules():
            if isinstance(module, (StreamingExperts, HeldExperts)):
                module.policy = self.kernels.moe
        if self.cache is not None and self.kernels.moe.impl == "cpu":
            self.cache.pack_held()  # layers that hold every expert: their CPU layout made at load
        self.model.use_kernels(
            self.kernels.dense == "triton", self.kernels.delta_chunk, self.kernels.cpu_dense
        )
        self._use_int8_activations(dtype)
        self.decoder = None

    def _use_int8_activations(self, dtype: torch.dtype) -> None:
        """``--dense-act int8``: the projections ``int8_worth`` names take int8 activations in
        their decode GEMV, once ``qgemv`` matched the reference that quantizes x the same way on
        this device, at their tile and with the decoder's norm prologue, and repeated bit for bit.
        Asked for by name, so a mismatch refuses to load (no fallback to bf16 x)."""
        from edgerun.kernels.qlinear_reference import Mismatch, probe_cases
        from edgerun.models.layers import int8_cases

        taken = self.model.use_int8_activations(self.kernels.dense_act == "int8")
        if self.kernels.dense_act != "int8":
            return
        if not taken:
            self.kernels.choices["dense activations"] = (
                "bf16: int8 asked for, and no projection is int4 in groups of 32 with 16 rows a program "
                "(8,448 rows or more)"
            )
            return
        norm = "unit" if self.args.norm_unit_offset else "plain"
        try:
            worst = probe_cases(int8_cases(taken, norm), self.device, dtype, act="int8")
        except Mismatch as exc:
            self.model.use_int8_activations(False)
            raise EdgerunError(f"--dense-act int8 refused on {self.device}: {exc}") from None
        self.kernels.choices["dense activations"] = (
            f"int8 per 32 columns (W4A8) in {len(taken)} int4 projections' decode GEMV (matched the reference "
            f"within {worst:.1e} of the output's scale and repeated bit for bit), x as it is in the rest and in prompts"
        )

    def fallbacks(self) -> dict[str, str]:
        """Every fallback in force, by kind, with its reason."""
        out = dict(self.kernels.fallbacks) | {k: why for k, (why, _) in self.load_fallbacks.items()}
        if self.cache is not None:
            out.update(self.cache.fallbacks())
        if self.decoder is not None:
            out.update(self.decoder.fallbacks)
            if self.decoder.head_step is not None:  # the MTP head's draft step, by its own name
                out.update({f"mtp_{k}": v for k, v in self.decoder.head_step.fallbacks.items()})
        if self.row_steps is not None:
            out.update(self.row_steps.fallbacks)
        return out | self.window_fallbacks

    def fallback_counts(self) -> dict[str, int]:
        """How often each fallback in force was taken: reads for the read fallbacks (buffered
        reads, pageable staging), engine steps (prefill chunks and decode steps) for the rest."""
        reads = self.cache.fallback_reads() if self.cache is not None else {}
        loaded = {k: n for k, (_, n) in self.load_fallbacks.items()}
        counts = reads | loaded | self._fallback_steps
        return {kind: counts.get(kind, 0) for kind in self.fallbacks()}

    def _count_step(self) -> None:
        for kind in self.fallbacks():
            if kind not in READ_FALLBACKS:
                self._fallback_steps[kind] = self._fallback_steps.get(kind, 0) + 1

    def decode_counts(self) -> dict[str, int]:
        c = self.steps
        return {"graph": c.graph_steps, "mixed": c.mixed_steps, "eager": c.eager_steps}

    def prefill_counts(self) -> dict[str, int]:
        """Prompt chunks by how they ran: replayed from a prefill graph, or eagerly."""
        return {"graph": self.steps.prefill_graph_chunks, "eager": self.steps.prefill_eager_chunks}

    def capture_counts(self) -> dict[str, int]:
        """CUDA graphs captured so far: decode graph sets (one per static state size) and prefill
        graphs (one per padded length and lane)."""
        return {"decode": self.steps.captures, "prefill": self.steps.prefill_captures}

    def kernel_summary(self) -> str:
        text = self.kernels.describe()
        text += f"; {self.decoder.describe()}" if self.decoder is not None else ""
        text += f"; {self.row_steps.describe()}" if self.row_steps is not None else ""
        text += f"; {self.planes} projection(s) on the tensor-core GEMV" if self.planes else ""
        return text + (
            f"; a batch's prompts prefill in {self.prefill_lanes} lanes" if self.prefill_lanes > 1 else ""
        )

    @classmethod
    def load(
        cls,
        model_dir: str | Path | None = None,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        providers: ProviderPolicy | None = None,
        cache: CacheConfig | None = None,
        kernels: KernelPolicy | None = None,
        log=None,
        speculative: SpeculativeConfig | None = None,
        **kw,
    ) -> Runner:
        """A model dir is an HF checkpoint or an edgerun bundle (``manifest.json``). For a bundle,
        ``cache`` streams the routed experts through an expert cache it configures; without it
        the experts are dequantized into resident tensors. ``kernels`` is resolved against the
        device once the model is loaded; ``log`` (a callable) hears what loading decided.
        ``speculative``: also load the MTP head and decode speculatively with it."""
        from edgerun.bundle.format import MANIFEST

        model_dir = Path(model_dir) if model_dir else DEMO_MODEL
        device = device or default_device()
        if dtype is None and torch.device(device).type == "cpu":
            dtype = torch.float32  # CPU matmuls are fastest and exact-matching in fp32
        expert_cache, unchecked = None, {}
        if cache is None:  # held whole: refused here, by name, if its weights alone cannot fit
            from edgerun.budget.planner import PLANNED_DTYPES
            from edgerun.engine.setup import check_resident_fits

            # None: the checkpoint's own (bf16 counted: a lower bound where it is fp32)
            width = PLANNED_DTYPES.get(str(dtype or torch.bfloat16).removeprefix("torch."), "bf16")
            check_resident_fits(model_dir, str(device), width, mtp=speculative is not None)
        if (model_dir / MANIFEST).is_file():
            if cache is not None:
                from edgerun.engine.streaming import load_streaming_model

                model, args, expert_cache, report = load_streaming_model(
                    model_dir,
                    cache,
                    dtype=dtype,
                    device=device,
                    providers=providers,
                    log=log,
                    expert_kernel=(kernels or KernelPolicy()).experts,
                )
            else:
                from edgerun.bundle.reader import Bundle, load_bundle_model

                bundle = Bundle.open(model_dir, providers=providers)
                model, args, report = load_bundle_model(bundle, dtype=dtype, device=device)
                if bundle.unchecked:
                    blocks = sum(r.num_experts for r in bundle.manifest.layers if r.block_xxh3 is None)
                    unchecked = {"unchecked_blocks": (bundle.unchecked, blocks)}
        elif cache is not None:
            raise EdgerunError(
                f"{model_dir}: streaming (a quota) needs an edgerun bundle; run `edgerun convert` first"
            )
        else:
            from edgerun.models.checkpoint import load_model

            model, args, report = load_model(model_dir, dtype=dtype, device=device, providers=providers)
        tok = (
            Tokenizer.from_dir(model_dir, args.eos_token_ids)
            if (model_dir / "tokenizer.json").is_file()
            else None
        )
        runner = cls(model, args, tok, device, **kw)
        runner.load_summary = report.summary()
        runner.provider = report.provider
        runner.cache = expert_cache
        runner.load_fallbacks = unchecked
        if speculative is not None:  # before the kernels are chosen: probed and selected with the model's
            runner._load_mtp(model_dir, providers)
        runner.set_kernels(kernels or KernelPolicy())
        if speculative is not None:
            runner.enable_speculative(speculative)
        return runner

    def _load_mtp(self, model_dir: Path, providers: ProviderPolicy | None) -> None:
        from edgerun.bundle.format import MANIFEST
        from edgerun.models.checkpoint import load_mtp, read_entries

        if (model_dir / MANIFEST).is_file():
            from edgerun.bundle.reader import Bundle

            entries = Bundle.open(model_dir, providers=providers).dense
        else:
            entries = read_entries(model_dir)[0]
        dtype = self.model.model.embed_tokens.weight.dtype
        # on CUDA, a bundle served through the expert cache runs its experts from blocks: the
        # head's too (``hold_mtp_experts``: a quarter of the bytes at int4), loaded on the host
        # and quantized an expert at a time on the device, which never holds them stacked (the
        # CPU keeps them stacked: quantizing Qwen3.6's 256 there would add about a minute to loading);
        # a model held whole holds the head's with its own, as bf16 blocks (``set_kernels``)
        held = self.cache is not None and self.device.type == "cuda"
        report = load_mtp(
            self.model, self.args, entries, dtype, "cpu" if held else self.device, str(model_dir)
        )
        self.load_summary += f"; MTP head {report.tensors} tensors ({report.bytes / 2**20:.1f} MiB)"
        if held:
            from edgerun.engine.streaming import REFERENCE, hold_mtp_experts

            # the reference kernel until set_kernels hands every expert step the resolved one
            n = hold_mtp_experts(self.model, self.cache, REFERENCE, self.device)
            self.model.mtp.to(self.device)
            scheme = self.cache.bundle.manifest.quant.scheme
            self.load_summary += f", its routed experts held as {scheme} blocks ({n / 2**20:.1f} MiB)"

    # ---- the decode path ----------------------------------------------------------------

    def new_state(self, total_len: int) -> DecodeState:
        """A fresh decode state for ``total_len`` tokens. On CUDA it is the decoder's static
        state (graphs replay over fixed buffers), re-sized to the next power of two when a
        request needs more than it holds."""
        if self.device.type != "cuda" and self.decoder is None:
            return self.model.new_state(1, total_len, device=self.device)
        if self.decoder is None or self.decoder.capacity < total_len:
            capacity = static_capacity(total_len, self.max_context)
            self.decoder = None  # free the old buffers and graphs first
            self.decoder = DecodeGraphs(
                self.model, self.args, self.cache, self.kernels, self.device, capacity, self.steps
            )
        return self.decoder.reset()

    def prefill(self, state: DecodeState, ids: list[int]) -> torch.Tensor:
        """Consume the prompt in chunks of ``prefill_chunk`` tokens; returns the last logits [V]."""
        for chunk in self.prefill_chunks(state, ids):
            logits = chunk
        if self.batch is not None:
            for row in self.batch.rows:
                if row.state is state:
                    self._settle(row)
        return logits

    def _settle(self, row: Row) -> None:
        """The main stream waits (the host does not) for the prefill lane's work on ``row``
        (its slot's state, its first logits): before either is read, and before its slot is
        freed for another sequence."""
        if row.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(row.ready)
            row.ready = None

    @torch.inference_mode()
    def prefill_chunks(
        self, state: DecodeState, ids: list[int], drafter: MtpDrafter | None = None
    ) -> Iterator[torch.Tensor]:
        """:meth:`prefill` one chunk at a time: yields each chunk's last logits [V]. A
        ``drafter`` (speculative decoding) also gets every row's hidden state, and its head
        consumes the rows whose next token the prompt holds."""
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = tokens[:, start : start + self.prefill_chunk]
            if drafter is None and start == 0 and self._a_row(state):
                logits = self._prefill_row(state, chunk)
            else:
                # with a drafter or not, a chunk runs alike (a first chunk from a graph where one
                # replays): a speculative prompt leaves plain decoding's state, bit for bit
                logits = self._prefill_graphed(state, chunk, start)
                hidden = self.decoder.prefill.hidden.clone() if logits is not None and drafter else None
                if logits is None:
                    self.steps.prefill_eager_chunks += 1
                    if drafter is None:  # through the model's forward: its hooks see the chunk
                        logits = self.model(chunk, state, last_only=True)[0, -1]
                    else:
                        hidden = self.model.hidden(chunk, state)
                        logits = self.model.lm_head(hidden[:, -1:])[0, -1]
                if drafter is not None:
                    drafter.extend(hidden)
                    drafter.catch_up(ids)
            self._count_step()
            yield logits

    @contextmanager
    def eager_prefill(self) -> Iterator[None]:
        """Every prompt chunk eager within (a profile's forward hooks, a graph-vs-eager timing)."""
        self.prefill_graphs = False
        try:
            yield
        finally:
            self.prefill_graphs = True

    def _a_row(self, state: DecodeState) -> bool:
        """Whether ``state`` is a sequence of the batch whose steps run the fused kernels."""
        return self.row_steps is not None and any(r.state is state for r in self.batch.rows)

    def _prefill_row(self, state: DecodeState, chunk: torch.Tensor) -> torch.Tensor:
        """A batch sequence's first chunk: prefilled on the one-sequence state (on CUDA the
        decoder's static state, through its prefill graphs where they replay; counted as
        either), then copied into the sequence's entry of the pool (KV 0..n, the DeltaNet
        states): a prompt of a batch costs what it costs alone. Its last logits [V], a copy
        (other sequences prefill before this one samples). With prefill lanes, in the next lane
        (``PrefillLanes``) at the same time as the other joiners' prompts."""
        tokens = min(self.prefill_chunk, self.max_context)
        if self.prefill_lanes > 1 and (self.decoder is None or self.decoder.capacity < tokens):
            self.new_state(tokens)  # the decoder the lanes' graphs belong to
        if self.prefill_lanes > 1 and self._graphs_replay(self.decoder.state):
            ran = self._prefill_lanes(tokens).run(chunk, state)
            if ran is not None:
                row = next(r for r in self.batch.rows if r.state is state)
                logits, row.ready = ran  # the lane's work: waited for before its first use
                return logits
        scratch = self.new_state(tokens)
        logits = self._prefill_graphed(scratch, chunk, 0)
        if logits is None:
            self.steps.prefill_eager_chunks += 1
            logits = self.model(chunk, scratch, last_only=True)[0, -1]
        scratch.copy_into(state)
        return logits.clone()  # the graph's output buffer: the next sequence's prefill reuses it

    def _prefill_lanes(self, tokens: int) -> PrefillLanes:
        """The decoder's prefill lanes (a scratch state of ``tokens`` each), made on first use."""
        if self.lanes is None or self.lanes.decoder is not self.decoder:
            limit = min(self.prefill_chunk, PREFILL_GRAPH_TOKENS)
            self.lanes = PrefillLanes(self.decoder, self.prefill_lanes, tokens, limit)
        return self.lanes

    @torch.inference_mode()
    def capture_prefill(self) -> str | None:
        """Serve's start-up, after its probe made the decoder: the prefill graph of every padded
        length a prompt's first chunk replays at (``PrefillGraphs.buckets``) captured now, each
        lane's with prefill lanes, so no request's TTFT pays for a capture (each otherwise
        captures the first time a prompt of its length comes). Returns the line to log (a
        failed capture named: that length prefills eagerly, a counted fallback), or None where
        prompts replay no graph (not CUDA, graphs off, an expert step that cannot be captured)."""
        t, tokens = time.perf_counter(), min(self.prefill_chunk, self.max_context)
        if self.batch is not None and self.device.type == "cuda":
            self.new_state(tokens)  # the static state a batch sequence's first chunk prefills on
        d = self.decoder
        if d is None or not self._graphs_replay(d.state) or self._prefill_graphs(d).why_eager is not None:
            return None  # (why_eager: graphs off, or an expert step that cannot be captured)
        if self.batch is not None and self.prefill_lanes > 1:
            sets = self._prefill_lanes(tokens).lanes
        else:
            sets = [d.prefill]
        for graphs in sets:
            for b in graphs.buckets:
                graphs.prepare(b)
        held = sorted({b for g in sets for b, graph in g.graphs.items() if graph is not None})
        failed = sorted({b for g in sets for b, graph in g.graphs.items() if graph is None})
        lanes = f" in each of {len(sets)} lanes" if len(sets) > 1 else ""
        line = (
            f"prefill graphs of {', '.join(map(str, held)) or 'no length'} tokens{lanes} captured "
            f"in {time.perf_counter() - t:.1f} s"
        )
        if failed:
            line += (
                f"; {', '.join(map(str, failed))} tokens prefill eagerly: {d.fallbacks.get('prefill_graphs')}"
            )
        return line

    def _prefill_graphed(self, state: DecodeState, chunk: torch.Tensor, start: int) -> torch.Tensor | None:
        """The chunk through the decoder's prefill graphs (``engine/graphs.PrefillGraphs``): its
        last logits, or None where it does not replay (not the decoder's state, a route
        recorder's forward hooks to feed, not the first chunk, a step that cannot be captured)."""
        if not self._graphs_replay(state):
            return None
        return self._prefill_graphs(self.decoder).run(chunk, start)

    def _prefill_graphs(self, d: DecodeGraphs) -> PrefillGraphs:
        """The decoder's prefill graphs, made on first use."""
        if d.prefill is None:
            d.prefill = PrefillGraphs(d, min(self.prefill_chunk, PREFILL_GRAPH_TOKENS))
        return d.prefill

    def _graphs_replay(self, state: DecodeState) -> bool:
        """Whether a chunk on ``state`` may replay a prefill graph: it is the decoder's static
        state, no route recorder needs the forward's hooks, and prefill graphs are on."""
        d = self.decoder
        return d is not None and state is d.state and self.routes is None and self.prefill_graphs

    @torch.inference_mode()
    def decode_step(self, state: DecodeState, token: int) -> torch.Tensor:
        if self.decoder is not None and state is self.decoder.state:
            logits = self.decoder.step(token)
            if self.routes is not None:  # the model's forward hooks do not see a decoder step
                self.routes.add_step(self.decoder.routes())
        else:
            tokens = torch.tensor([[token]], dtype=torch.long, device=self.device)
            self.steps.eager_steps += 1
            logits = self.model(tokens, state, last_only=True)[0, -1]
        self._count_step()  # after the step: a fallback it took (a failed capture) counts already
        return logits

    @torch.inference_mode()
    def decode_rows(self, states: list[DecodeState], tokens: list[int]) -> torch.Tensor:
        """One step of B sequences (token b continues ``states[b]``) -> logits [B, V], each row
        bit for bit the sequence's own :meth:`decode_step` (``CausalLM.decode_rows``)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if len(states) == 1:  # one row: the one-row step itself, without the per-row bookkeeping
            logits = self.model(ids[None], states[0], last_only=True)[:, -1]
        else:
            logits = self.model.decode_rows(ids, states)
        self.steps.eager_steps += 1
        self._count_step()
        return logits

    def request(self, prompt_ids: list[int], params: SamplingParams, **fields) -> Request:
        """The request checked against this model's limits (``fields``: how the caller names the
        prompt and max_tokens in its errors)."""
        return check_request(prompt_ids, params, self.limits, **fields)

    def generate(self, request: Request) -> Iterator[Event]:
        """Text deltas of a checked request (:meth:`request`), then a final event with stats."""
        prompt_ids, params = list(request.prompt_ids), request.params
        sampler = Sampler(params, position=len(prompt_ids))
        stats = GenerationStats(prompt_tokens=len(prompt_ids))
        t_request = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        row = self.batch.join(len(prompt_ids) + params.max_tokens) if self.batch is not None else None
        try:
            yield from self._generate(request, sampler, stats, t_request, row)
        finally:
            for where, n in sampler.drawn.items():
                self.sampled[where] += n
            if row is not None:
                self._settle(row)
                self.batch.leave(row)  # ended or closed (client gone): the slot is free at once

    def _generate(
        self, request: Request, sampler: Sampler, stats: GenerationStats, t_request: float, row: Row | None
    ) -> Iterator[Event]:
        prompt_ids, params = list(request.prompt_ids), request.params
        speculative = self._speculative_for(params)
        if speculative is None and self.speculative is not None:
            self.spec_plain_requests += 1
        state = self.new_state(self._state_len(request)) if row is None else row.state
        text = _TextStream(self.tokenizer, params.stop)
        drafter = None
        if speculative is not None:
            ref = self.model.model.embed_tokens.weight
            on_decoder = self.decoder is not None and state is self.decoder.state
            step = self.decoder.draft_step() if on_decoder else None  # CUDA: its graph
            drafter = MtpDrafter(self.model, state.max_len, self.device, ref.dtype, step)
            stats.speculative = SpeculativeStats()
            stats.row_step_s = self.row_step_s
            windows0 = self.cache.totals() if self.cache is not None else None

        t0 = time.perf_counter()
        for chunk in self.prefill_chunks(state, prompt_ids, drafter):
            logits = chunk
            yield Event(
                "", prefilled=state.pos
            )  # a chunk done: the caller may ping its watchdog, or stop here
        finish = "length"
        if row is not None:
            tokens = self._batch_tokens(row, logits, sampler, params.max_tokens)
        elif drafter is None:
            tokens = self._tokens(state, logits, sampler, params.max_tokens)
        else:
            tokens = self._speculative_tokens(
                state, logits, sampler, params.max_tokens, prompt_ids, drafter, stats
            )
        try:
            for i, token in enumerate(self._counted(tokens)):
                if i == 0:
                    now = time.perf_counter()
                    stats.prefill_s, stats.ttft_s, t0 = now - t0, now - t_request, now
                stats.generated_tokens += 1
                if token in self.eos_ids and not params.ignore_eos:
                    finish = "stop"
                    break
                delta, stopped = text.push(token)
                if row is not None and not stopped and stats.generated_tokens < params.max_tokens:
                    self.batch.feed(row, token)  # before the yield: the next step, whoever runs it, has it
                yield Event(delta, token)
                if stopped:
                    finish = "stop"
                    break
            if stats.generated_tokens > 1:
                stats.decode_s = time.perf_counter() - t0
            stats.peak_memory_bytes = peak_memory(self.device)
        finally:  # a cancelled or failed request's verify steps count too, as its decode steps do
            if stats.speculative is not None:
                if windows0 is not None:
                    now = self.cache.totals()
                    stats.speculative.windows = now.verify_windows - windows0.verify_windows
                    stats.speculative.window_experts = now.window_experts - windows0.window_experts
                self.spec_totals.add(stats.speculative)
                self.last_speedup = stats.speedup
        yield Event(text.flush(), None, finish, stats)

    def _speculative_for(self, params: SamplingParams) -> SpeculativeConfig | None:
        """How a request of these parameters decodes speculatively; None: plainly (no MTP, or
        a sampled request where ``SpeculativeConfig.sampled`` says so)."""
        s = self.speculative
        return None if s is not None and not params.greedy and s.sampled == "plain" else s

    def _state_len(self, request: Request) -> int:
        """The positions a request's decode state is sized for: its prompt and tokens, and room
        for the device-decided speculative steps that run ahead of its end where the context has it."""
        total = len(request.prompt_ids) + request.params.max_tokens
        speculative = self._speculative_for(request.params)
        room = SPEC_HEADROOM * speculative.draft_tokens if speculative is not None else 0
        return total + room if total + room <= self.max_context else total

    def warm_up(self, request: Request) -> str | None:
        """Before a one-shot request (``edgerun generate``): the one-time work its first prefill
        chunk and first decode step would do, done now, so its TTFT and decode rate are its own.
        On CUDA with graphs: the decoder its state lives in (sized as the request's), its first
        step run eagerly (Triton compiles, library handles) and captured (not for a speculative
        request, which decodes in verify windows), a sampled request's draw the same, and the
        prefill graph of the bucket its first chunk replays at captured.
        Nothing of it is counted as a step, the state is emptied after and held experts' hits
        put back; a streamed layer's lookups of the decode step stay in the cache's books
        (:attr:`warm_tokens`). Returns a line naming what it did and its time (or why it
        failed: the decoder is then dropped, and the request builds and warms its own), or
        None where there is nothing to warm (not CUDA, graphs off, a batch: its start-up probe
        warms it)."""
        if self.device.type != "cuda" or self.batch is not None:
            return None
        t, did = time.perf_counter(), []
        try:
            self._warm_parts(request, did)
            self.new_state(self._state_len(request))  # as the request will: reset outside inference mode
        except Exception as exc:  # noqa: BLE001 - any failure: the request warms up for itself, said
            self.decoder = None
            return (
                f"warm-up failed, the request compiles and captures for itself: {type(exc).__name__}: {exc}"
            )
        if not did:
            return None
        return f"warm-up: {', '.join(did)} in {time.perf_counter() - t:.2f} s (not in the request's times)"

    def _warm_parts(self, request: Request, did: list[str]) -> None:
        """:meth:`warm_up`'s work, each part in the inference mode the request runs it in (its
        state and the draw's buffers made outside it, so the request can reset and set them; its
        steps inside it); what it did appended to ``did``."""
        t = time.perf_counter()

        def done(what: str) -> None:  # each part with its own time: where a warm-up's seconds go
            nonlocal t
            did.append(f"{what} ({time.perf_counter() - t:.2f} s)")
            t = time.perf_counter()

        state = self.new_state(self._state_len(request))
        d, plain = self.decoder, self._speculative_for(request.params) is None
        with torch.inference_mode():  # a speculative request's steps are verify windows: not this one
            if plain and d.prepare():
                done(
                    "the decode step compiled and captured" if d.graphs is not None
                    else f"the decode step compiled ({d.fallbacks.get('graphs', 'not captured')})"
                )  # fmt: skip
                self.warm_tokens += int(d.lookups_kept)
        if plain and d.prepare_draw(Sampler(request.params)):
            done("its sampled draw compiled and captured")
        n = min(len(request.prompt_ids), self.prefill_chunk, self.max_context)
        with torch.inference_mode():
            b = self._prefill_graphs(d).prepare(n) if self._graphs_replay(state) else None
        if b is not None:
            done(f"the prefill graph of {b} tokens captured")

    def _counted(self, tokens: Iterator[int]) -> Iterator[int]:
        """``tokens``, counting a request stopped by non-finite logits."""
        try:
            yield from tokens
        except NonFiniteLogits:
            self.nonfinite_logits += 1
            raise

    def _tokens(self, state: DecodeState, logits: torch.Tensor, sampler: Sampler, n: int) -> Iterator[int]:
        """The next ``n`` tokens after the prompt (the caller may stop early). Chosen by the
        sampler from each step's logits (the argmax, or a draw: on the logits' device); or, on
        the CUDA decoder, by the step itself (the argmax, or the same draw from its graph,
        ``DecodeGraphs.sample_with``), each step queued before the previous step's token is
        read, so the GPU does not wait for the host between steps. Both give the same tokens:
        the device takes the same argmax, or makes the same draw, of the same logits. A route
        recorder needs each step's routes before the next step runs: it gets the host loop."""
        token = sampler(logits)  # syncs with the device
        yield token
        pipelined = (sampler.params.greedy or logits.is_cuda) and self.routes is None
        if self.decoder is None or state is not self.decoder.state or not pipelined:
            for _ in range(n - 1):
                token = sampler(self.decode_step(state, token))
                yield token
            return
        self.decoder.sample_with(sampler)
        try:
            pending = self._launch(token) if n > 1 else None
            for i in range(1, n):
                queued = self._launch(None) if i + 1 < n else None  # consumes the token still on the device
                token = self.decoder.result(pending)
                sampler.position += 1
                if not sampler.params.greedy:
                    sampler.drawn["device"] += 1
                yield token
                pending = queued
        finally:
            self.decoder.sample_with(None)

    def _batch_tokens(self, row: Row, logits: torch.Tensor, sampler: Sampler, n: int) -> Iterator[int]:
        """:meth:`_tokens` for a sequence of the batch: its logits come from the batch's step."""
        row.greedy = sampler.params.greedy  # it feeds the step's picks: its steps may run ahead
        self._settle(row)  # prefilled in a lane: its logits and its slot are the lane's work
        token = sampler(logits)
        yield token
        for _ in range(n - 1):
            logits, pick = self.batch.logits(row)
            if pick is not None and sampler.params.greedy:  # chosen by the step on the device
                token = greedy_pick(*pick)
            else:
                token = sampler(logits)
            yield token

    @torch.inference_mode()
    def _speculative_tokens(
        self,
        state: DecodeState,
        logits: torch.Tensor,
        sampler: Sampler,
        n: int,
        prompt_ids: list[int],
        drafter: MtpDrafter,
        stats: GenerationStats,
    ) -> Iterator[int]:
        """:meth:`_tokens` by drafting and verifying (engine/speculative.py): the same tokens as
        plain greedy decoding, bit for bit; sampled ones from the same distribution. A step
        drafts no more tokens than the request may still emit, so the state never holds more
        than plain decoding's."""
        seq = list(prompt_ids)
        token = sampler(logits)
        seq.append(token)
        yield token
        k_max, spec = self.speculative.draft_tokens, stats.speculative
        chain = self._spec_steps(state, drafter, sampler, len(prompt_ids) + n)
        if chain is not None:
            yield from self._device_tokens(state, seq, n - 1, drafter, chain, spec)
            return
        choose = draft_chooser(sampler)
        while len(seq) - len(prompt_ids) < n:
            k = min(k_max, n - (len(seq) - len(prompt_ids)) - 1)
            drafts, draft_logits = drafter.draft(seq, k, choose) if k else ([], [])
            start = state.pos
            verified, hidden = self._verify(state, [seq[-1], *drafts])
            emitted = accept(sampler, verified, drafts, draft_logits)
            state.rollback(start, len(emitted))
            drafter.extend(hidden[:, : len(emitted)])
            spec.steps += 1
            spec.drafted += k
            spec.accepted += len(emitted) - 1  # the drafts' quality, whether or not all are used
            for token in emitted:
                seq.append(token)
                spec.emitted += 1  # a token the request takes (it may stop at an EOS or stop string)
                yield token

    def _spec_steps(
        self, state: DecodeState, drafter: MtpDrafter, sampler: Sampler, total: int
    ) -> SpecSteps | None:
        """The device-decided speculative steps (engine/spec_steps.py) a request of ``total``
        positions runs, or None where its steps are host-driven: a sampled request (the
        rejection test draws on the host), a route recorder (it reads each step's routes),
        a state off the decoder, room for fewer than 3K positions past the request (a step
        may run past its end), or a step with host work (``chain_unsupported``, in
        ``fallbacks`` as ``spec_host_steps``)."""
        d, k = self.decoder, self.speculative.draft_tokens
        if d is None or state is not d.state or drafter.step is None or not sampler.params.greedy:
            return None
        if self.routes is not None or total + SPEC_HEADROOM * k > d.capacity:
            return None
        if k not in d.chains:
            why = chain_unsupported(d, drafter.step, k)
            d.chains[k] = SpecSteps(d, drafter.step, k) if why is None else None
            if why is not None:
                d.fallbacks["spec_host_steps"] = f"greedy speculative steps run host-driven: {why}"
        return d.chains[k]

    def _device_tokens(
        self, state: DecodeState, seq: list[int], n: int, drafter: MtpDrafter, chain: SpecSteps, spec
    ) -> Iterator[int]:
        """The ``n`` tokens after ``seq`` (the prompt and the first token) from device-decided
        steps, each queued before the previous one is read (the pipelined form of the loop in
        :meth:`_speculative_tokens`). The head drafts the first step's tokens from the prompt
        on the host-driven path; each step then drafts the next one's on the device."""
        if n <= 0:
            return
        drafts, _ = drafter.draft(seq, chain.k, None)
        chain.start(state.pos, seq[-1], drafts)
        pending, taken = self._spec_launch(chain), 0
        while True:
            # the step after the pending one, queued first unless the pending one surely ends the
            # request (each step emits at least one token)
            queued = self._spec_launch(chain) if n - taken > 1 else None
            kept, tokens = chain.result(pending)
            spec.steps += 1
            spec.device_steps += 1
            spec.drafted += chain.k
            spec.accepted += kept
            state.pos += kept + 1
            for token in tokens[: n - taken]:
                taken += 1
                spec.emitted += 1
                yield token
            if taken >= n:
                return
            pending = queued

    def _spec_launch(self, chain: SpecSteps) -> int:
        handle = chain.launch()
        self._count_step()
        return handle

    def _verify(self, state: DecodeState, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify window: ``tokens`` at the state's next positions -> (logits [N, V], the final
        normed hidden states [1, N, D]), row j bit for bit the one-row decode step at its
        position: on the decoder's state (CUDA) its step's kernels (``DecodeGraphs.verify``),
        counted as its steps are (graph / mixed / eager); else the model's rows mode, eager."""
        if self.decoder is not None and state is self.decoder.state:
            logits, hidden = self.decoder.verify(tokens, self.speculative.draft_tokens + 1)
            hidden = hidden[None]
        else:
            rows = torch.tensor([tokens], dtype=torch.long, device=self.device)
            hidden = self.model.hidden(rows, state, rows=True)
            with exact_rows():
                logits = self.model.lm_head(hidden)[0]
            self.steps.eager_steps += 1
        self._count_step()
        return logits, hidden

    @torch.inference_mode()
    def _launch(self, token: int | None) -> int:
        handle = self.decoder.launch(token)
        self._count_step()
        return handle

    def generate_ids(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """The generated token ids (EOS excluded)."""
        events = self.generate(self.request(prompt_ids, params))
        return [e.token_id for e in events if e.token_id is not None]


def l2_bytes(device: torch.device) -> int:
    """The L2 cache of a CUDA ``device`` in bytes; 0 elsewhere (or where torch does not say)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


def check_rows(probe: str, alone: list[torch.Tensor], rows: torch.Tensor, differs: str) -> None:
    """A start-up probe's verdict: row r of ``rows`` (logits of one multi-row step) bit for bit
    ``alone[r]`` (its one-row step's), else :class:`EdgerunError` saying ``differs`` (its
    ``{r}`` the row); a one-row step's logits that are not finite are refused first."""
    for r, want in enumerate(alone):
        if not bool(torch.isfinite(want).all()):
            raise EdgerunError(f"{probe}: a decode step's logits are not finite")
        if not torch.equal(rows[r], want):
            raise EdgerunError(f"{probe}: {differs.format(r=r)}")


class _TextStream:
    """Detokenizes incrementally and applies stop strings: a tail that could still grow into a
    stop string is held back; on a match the output ends just before it. Only the text not sent
    yet, and the ``hold`` characters before it, are kept, so a token's work is bounded by the
    stop strings' lengths, not by the output's."""

    def __init__(self, tokenizer: Tokenizer | None, stop: tuple[str, ...]) -> None:
        self.decoder = StreamDecoder(tokenizer) if tokenizer else None
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.sent = 0  # of ``text``
        self.done = False

    def push(self, token: int) -> tuple[str, bool]:
        if self.decoder is None:
            return "", False
        self.text += self.decoder.push(token)
        if self.stop:
            hits = [i for s in self.stop if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0]
            if hits:
                cut = min(hits)
                delta, self.sent, self.done = self.text[self.sent : cut], cut, True
                self.text = self.text[:cut]
                return delta, True
        upto = max(self.sent, len(self.text) - self._partial_stop())
        delta, self.sent = self.text[self.sent : upto], upto
        if self.sent > 2 * self.hold + 64:  # drop what no stop string can reach any more
            drop = self.sent - self.hold - 1
            self.text, self.sent = self.text[drop:], self.sent - drop
        return delta, False

    def _partial_stop(self) -> int:
        """Length of the longest tail of the text that is the start of some stop string: for each,
        the first place in its reach holding its first character whose tail it starts with."""
        best, n = 0, len(self.text)
        for s in self.stop:
            i = self.text.find(s[0], max(0, n - len(s) + 1))
            while i != -1 and n - i > best:
                if s.startswith(self.text[i:]):
                    best = n - i
                    break
                i = self.text.find(s[0], i + 1)
        return best

    def flush(self) -> str:
        if self.decoder is None or self.done:
            return ""
        self.text += self.decoder.flush()
        delta, self.sent = self.text[self.sent :], len(self.text)
        return delta
