"""Continuous batching: up to B sequences decode together, one multi-row step at a time.

:class:`DecodeBatch` only keeps books and runs the step; the requests' generators
(``Runner.generate``) drive it. Each sequence owns a slot of one state pool (KV and DeltaNet
conv + recurrent state, ``[B, ...]`` per layer, so a step over the pool has fixed shapes) and
prefills into it alone. After each sampled token that does not end its request, a sequence
*feeds* the token to the batch; the first sequence to ask for its next logits runs one step
over every fed row (:meth:`CausalLM.decode_rows`), and the others find theirs waiting. A caller
that advances each generator once per round (the daemon's engine worker) thus gets one step per
round over every sequence that is decoding, while a sequence still in prefill runs its chunk in
between. A sequence leaves (its slot free at once) when its generator ends or is closed.

Each row is computed as the sequence's one-row step computes it (``exact_rows``), so a
request's tokens do not depend on its neighbours (tests/engine/test_batch.py).

The step here is the CPU's: eager, the token mixer a Python loop over rows with host positions.
What a CUDA step per batch bucket would capture is already fixed-shape: the pool's ``[B, ...]``
buffers and a slot per row; it needs positions as a device tensor per row (as
``StaticStep.pos`` for one), the rows' experts through the device slot table, and no host read
inside the step (not built: runner.enable_batch refuses CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from edgerun.errors import EdgerunError
from edgerun.models.layers import DecodeState, DeltaState, KVCache


@dataclass(eq=False)
class Row:
    slot: int
    state: DecodeState  # views of the pool's slot
    token: int | None = None  # fed: the next step's input
    logits: torch.Tensor | None = None  # the step's output for it, not yet taken


@dataclass
class BatchStats:
    steps: int = 0
    rows: int = 0  # summed over steps: rows / steps is the mean batch
    sizes: dict[int, int] = field(default_factory=dict)  # steps by their row count, every key from 1 to B


class DecodeBatch:
    """``size`` slots of ``max_len`` tokens each; the step runs ``step(states, tokens)``
    (``Runner.decode_rows``)."""

    def __init__(self, model, size: int, max_len: int, device, step) -> None:
        if size < 1:
            raise EdgerunError(f"batch must be >= 1, got {size}")
        self.size, self.max_len = size, max_len
        # KV uninitialised: slots sized for the longest request commit pages only as they fill
        self.pool = model.new_state(size, max_len, device=device, zero_kv=False)
        self._step = step
        self.free = list(range(size))
        self.rows: list[Row] = []  # joined, in the order they joined
        # every row count a key from the start: /metrics reads the dict from another thread
        self.stats = BatchStats(sizes=dict.fromkeys(range(1, size + 1), 0))

    @property
    def running(self) -> int:
        """Sequences holding a slot (prefilling or decoding)."""
        return len(self.rows)

    def join(self, total_len: int) -> Row:
        """A free slot, its DeltaNet state zeroed (its KV past the position is never read)."""
        if total_len > self.max_len:
            raise EdgerunError(
                f"a sequence of {total_len} tokens exceeds the batch's slots of {self.max_len}"
            )
        if not self.free:
            raise EdgerunError(f"all {self.size} batch slots are taken")
        slot = self.free.pop(0)
        layers = []
        for entry in self.pool.layers:
            if isinstance(entry, KVCache):
                layers.append(KVCache(entry.k[slot : slot + 1], entry.v[slot : slot + 1]))
            elif isinstance(entry, DeltaState):
                view = DeltaState(entry.conv[slot : slot + 1], entry.recurrent[slot : slot + 1])
                view.conv.zero_()
                view.recurrent.zero_()
                layers.append(view)
            else:
                layers.append(None)
        row = Row(slot, DecodeState(layers, total_len))
        self.rows.append(row)
        return row

    def leave(self, row: Row) -> None:
        if row in self.rows:
            self.rows.remove(row)
            self.free.append(row.slot)
            self.free.sort()

    def feed(self, row: Row, token: int) -> None:
        row.token = token

    def logits(self, row: Row) -> torch.Tensor:
        """The row's logits [V] for its fed token: from the step that already ran, or one run
        now over every fed row."""
        if row.logits is None:
            if row.token is None:
                raise EdgerunError("a batch row asked for logits without feeding a token")
            self.step()
        out, row.logits = row.logits, None
        return out

    @torch.inference_mode()
    def step(self) -> None:
        fed = [r for r in self.rows if r.token is not None and r.logits is None]
        logits = self._step([r.state for r in fed], [r.token for r in fed])
        for i, r in enumerate(fed):
            r.logits, r.token = logits[i], None
        s = self.stats
        s.steps += 1
        s.rows += len(fed)
        s.sizes[len(fed)] += 1
