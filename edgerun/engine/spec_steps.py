"""Greedy speculative steps decided on the device: verify, accept, roll back and draft again
without the host in between, so the host can queue step s + 1 before it reads step s.

The host-driven step (``Runner._speculative_tokens``) runs four phases with the host waiting
between them: the MTP head's catch-up, its drafts, the verify window, the greedy accept read
back. On a model whose whole step is a few hundred microseconds that waiting is most of a
speculative step's time. Here one step is one sequence of device operations over static
buffers (one CUDA graph where graphs run), K + 1 = N rows:

    verify   the decoder's window of N rows (``DecodeGraphs.window``): tokens t, d_1..d_K at
             positions p..p+K; each row the one-row step's bits (``verify_window``)
    accept   best_j = argmax of row j (the window's own greedy token); a = the number of
             leading drafts with d_j == best_{j-1}; the step emits best_0..best_a, which is
             ``speculative.accept``'s greedy rule
    rollback each DeltaNet layer's conv and recurrent state become those after row a (the
             window's trail, gathered by a on the device); KV past p + a is rewritten later
             and never read before (attention masks past a row's position)
    catch-up the MTP head's window of N rows: row j = (the verify's final normed hidden row j,
             best_j) at position p + j; rows past a are junk the next step's window rewrites
    draft    d'_1 = the head's greedy token of row a, then d'_2.. from one-row head steps at
             positions p + a + 1.. (K > 1)
    next     the window's positions become p + a + 1 + j and its tokens best_a, d'_1..d'_K

Drafts only decide how many rows a step keeps; a kept token is the argmax of a verify row, so
the output is plain greedy's, bit for bit (``tests/engine/test_speculative*.py``). The host
reads a and best_0..best_K (with each row's greedy logit: NaN or +inf is refused as a plain
step refuses it) two steps deep, as plain greedy decoding reads its tokens (``Runner._tokens``).
A step may compute tokens past a request's end; the request takes only what it asked for.
"""

from __future__ import annotations

import torch

from edgerun.engine.graphs import DecodeGraphs, capture_graph, greedy_pick, run_on_side_stream
from edgerun.engine.speculative import STEP_ROWS
from edgerun.models.layers import verify_window

# positions past a request's end a device-decided step may touch: a step queued before the last
# one is read starts at most K past the request's last position, its window reaches K further
# and its head's drafts K - 1 further still (``Runner._device_tokens``)
SPEC_HEADROOM = 3


def chain_unsupported(decoder: DecodeGraphs, head: DecodeGraphs, k: int) -> str | None:
    """Why greedy speculative steps of ``k`` drafts cannot run on the device over this decoder
    and MTP head step; None when they can: every part must be device operations (no host op:
    a streamed layer's lookup reads its routing back to the host between segments)."""
    if k < 1:
        return "no drafts to verify"
    if k + 1 > STEP_ROWS:
        return f"the MTP head's catch-up windows take at most {STEP_ROWS} rows"
    parts = {
        "the verify window": decoder.window(k + 1, k + 1),
        "the MTP head's catch-up window": head.window(k + 1, STEP_ROWS),
        "the MTP head's draft step": head,
    }
    for name, g in parts.items():
        if g.host_ops:
            return f"{name} reads back to the host between segments ({g.host_ops} host op(s) a step)"
    return None


class SpecSteps:
    """Greedy speculative steps of ``k`` drafts over ``decoder``'s one-sequence state and the
    MTP ``head`` step's (see the module docstring); made by ``Runner._spec_steps`` once
    ``chain_unsupported`` is None, kept in the decoder's ``chains``. With graphs on, the first step runs eagerly (Triton
    compiles) and the rest replay one captured graph; a capture that fails leaves the steps
    eager, in the decoder's ``fallbacks`` (``spec_graphs``)."""

    def __init__(self, decoder: DecodeGraphs, head: DecodeGraphs, k: int) -> None:
        n = k + 1
        self.k, self.n = k, n
        self.decoder, self.head = decoder, head
        self.verify = decoder.window(n, n)
        self.catch_up = head.window(n, STEP_ROWS)
        dev = decoder.device
        self.drafts = torch.zeros(k, dtype=torch.long, device=dev)
        self.kept = torch.zeros(1, dtype=torch.long, device=dev)  # a: the drafts the last step kept
        self.out = torch.zeros(n + 1, dtype=torch.long, device=dev)  # a, best_0..best_K
        cuda = dev.type == "cuda"
        self.out_host = torch.zeros(2, n + 1, dtype=torch.long, pin_memory=cuda)
        self.chosen_host = torch.zeros(2, n, dtype=self.verify.dtype, pin_memory=cuda)
        self.events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._slot = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._warm = False
        self._rollback = None  # spec_triton.Rollback, made by the first step that has DeltaNet layers

    def start(self, pos: int, token: int, drafts: list[int]) -> None:
        """The first step's inputs: ``token`` (the last one chosen) at ``pos``, then ``drafts``
        (the head's, drafted by the host-driven path from the prompt)."""
        if len(drafts) != self.k:
            raise ValueError(f"a step of {self.k} drafts starts from {self.k} drafts, got {len(drafts)}")
        v = self.verify
        v.indices[1:].copy_(
            torch.tensor([list(range(pos, pos + self.n)), [token, *drafts]], dtype=torch.long)
        )
        self.drafts.copy_(v.indices[2, 1:])

    def launch(self) -> int:
        """Queue one step; a handle for :meth:`result` (two may be in flight)."""
        if not self.decoder.policy.graphs:
            self._ops()
            self.decoder.counters.eager_steps += 1
        elif not self._warm:
            self._warm_up()
            self.decoder.counters.eager_steps += 1
        elif self.graph is None:
            self._ops()  # capture failed: recorded in fallbacks
            self.decoder.counters.eager_steps += 1
        else:
            self.graph.replay()
            self.decoder.counters.graph_steps += 1
        self.verify.count_table_hits(self.n)
        h, self._slot = self._slot, self._slot ^ 1
        self.out_host[h].copy_(self.out, non_blocking=True)
        self.chosen_host[h].copy_(self.verify.chosen[:, 0], non_blocking=True)
        if self.events is not None:
            self.events[h].record()
        return h

    def result(self, handle: int) -> tuple[int, list[int]]:
        """(the drafts the step behind ``handle`` kept, the tokens it emits: a + 1 of them);
        waits for that step only. Refused, as a plain step is, when the logits of a row whose
        token it emits hold NaN or +inf."""
        if self.events is not None:
            self.events[handle].synchronize()
        out = self.out_host[handle].tolist()
        chosen = self.chosen_host[handle].float().tolist()
        a = out[0]
        return a, [greedy_pick(out[1 + j], chosen[j]) for j in range(a + 1)]

    # ---- the step's operations --------------------------------------------------------------

    def _ops(self) -> None:
        from edgerun.kernels import spec_triton  # Triton only where a step runs (the demo runs without)

        v, c, head, k = self.verify, self.catch_up, self.head, self.k
        with verify_window():
            _run(v)
        spec_triton.accept(v.indices, self.drafts, self.kept, self.out, c.indices, v.hidden, c.hidden_in)
        layers = [
            (trail, (v.state.layers[i].conv, v.state.layers[i].recurrent)) for i, trail in v.trail.items()
        ]
        if layers:
            self._rollback = self._rollback or spec_triton.Rollback()
            self._rollback(layers, self.kept)
        _run(c)
        spec_triton.next_inputs(
            self.kept,
            self.out,
            c.indices,
            c.hidden,
            v.indices,
            self.drafts,
            head.indices,
            head.hidden_in,
            k > 1,
        )
        for j in range(1, k):
            _run(head)
            spec_triton.draft_on(
                head.indices, head.hidden, head.hidden_in, self.drafts, v.indices, j, j + 1 < k
            )

    def _warm_up(self) -> None:
        """The first step eagerly on a side stream (Triton compiles), then the capture (which
        records the operations without running them)."""
        dev = self.decoder.device
        run_on_side_stream(self._ops, dev)
        self._warm = True
        try:
            g = capture_graph(self._ops, dev)
            torch.cuda.synchronize(dev)
            self.graph = g
            self.decoder.counters.captures += 1
        except Exception as exc:  # noqa: BLE001 - any capture failure: run eagerly, say why
            self.graph = None
            self.decoder.fallbacks["spec_graphs"] = (
                f"speculative step capture failed, its steps run eagerly: {type(exc).__name__}: {exc}"
            )


def _run(g: DecodeGraphs) -> None:
    """``g``'s step operations in order (device operations only: ``chain_unsupported``)."""
    for seg in g.segments():
        for fn in seg:
            fn()
