"""Speculative decoding with the model's own MTP head: draft k tokens, verify k + 1 positions in
one forward of the main model, keep the accepted prefix, roll the rest back.

One step, the main model having consumed positions 0..n-1 and token t_n chosen:

    drafts   d_1..d_k   the MTP head, from the main model's hidden state at n-1 and t_n, then
                        from its own hidden state and its last draft (``MtpDrafter.draft``)
    verify   rows t_n, d_1..d_k at positions n..n+k (``CausalLM.hidden(rows=True)``: each row
             the bits of a one-row decode step, so a kept token is what plain decoding emits)
    accept   greedy: the drafts that equal the argmax of the row before them, then the argmax
             of the first row not matched (a bonus token); sampling: the standard rejection
             test, which leaves the target distribution unchanged (``accept``)
    rollback the KV positions and DeltaNet states past the kept rows (``DecodeState.rollback``:
             DeltaNet layers keep each row's state during a verify, so nothing runs twice)

The MTP head keeps its own KV cache: position p holds (the main model's hidden state at p, token
p+1). Drafted positions past n-1 are rewritten from the main model's hidden states once the
verify has produced them, so the head's cache always holds what the kept sequence implies.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from edgerun.config import SpeculativeConfig  # noqa: F401  (re-exported: the engine's setting)
from edgerun.engine.events import SpeculativeStats  # noqa: F401  (re-exported)
from edgerun.models.layers import DecodeState


class MtpDrafter:
    """The MTP head's side of one request: its KV state, and the main model's hidden rows it has
    not consumed yet (positions ``state.pos``.. of ``seq``, the request's tokens so far).

    With ``step`` (CUDA: the decoder's draft step, ``DecodeGraphs.draft_step``, replayed from
    its CUDA graph where graphs run) the few rows a verify step kept run as one step of that many
    rows and every draft as a one-row step, over that step's static state, a greedy draft chosen
    on the device and the drafts read back once; without, the head's forward runs eagerly. A prompt's many rows are fed by the forward
    either way. Drafts only decide what is verified, never what is emitted."""

    def __init__(self, model: torch.nn.Module, max_len: int, device, dtype, step=None) -> None:
        self.model = model
        self.head = model.mtp
        self.step = step
        self.state: DecodeState = (
            step.reset() if step is not None else self.head.new_state(max_len, device, dtype)
        )
        self.pending: torch.Tensor | None = None  # [1, P, D]

    def extend(self, hidden: torch.Tensor) -> None:
        """The main model's final hidden rows [1, T, D] for the positions after those pending."""
        self.pending = hidden if self.pending is None else torch.cat([self.pending, hidden], dim=1)

    def catch_up(self, seq: list[int]) -> torch.Tensor | None:
        """Feed the head every pending row whose next token ``seq`` knows; returns the head's
        hidden state [1, 1, D] of the last row fed (None if none was). With a draft step, the rows
        after a prompt's run as one step of that many rows (a window over the head's state: its
        attention takes the rows in one call), the last row's logits and greedy token then the
        draft step's."""
        if self.pending is None:
            return None
        start = self.state.pos
        n = min(self.pending.shape[1], len(seq) - 1 - start)
        if n <= 0:
            return None
        if self.step is not None and n == 1:
            self.step.hidden_in.copy_(self.pending[0, :1])
            self.step.step(seq[start + 1])
            out = self.step.hidden[None]
        elif self.step is not None and n <= STEP_ROWS:  # one window of n rows, its last row's
            step, w = self.step, self.step.window(n, STEP_ROWS)  # outputs where the next draft reads
            w.hidden_in.copy_(self.pending[0, :n])
            w.run_window(seq[start + 1 : start + 1 + n])
            step.hidden.copy_(w.hidden[n - 1 :])
            step.logits.copy_(w.logits[n - 1 :])
            step.token.copy_(w.token[n - 1 :])
            step.fallbacks.update(w.fallbacks)
            out = step.hidden[None]
        else:
            nxt = torch.tensor([seq[start + 1 : start + 1 + n]], device=self.pending.device)
            out = self.head(
                self.model.model.embed_tokens(nxt), self.pending[:, :n], self.model.rotary, self.state
            )[:, -1:]
        self.pending = self.pending[:, n:] if n < self.pending.shape[1] else None
        return out

    def draft(
        self, seq: list[int], k: int, choose: Callable[[torch.Tensor], int] | None
    ) -> tuple[list[int], list[torch.Tensor]]:
        """k draft tokens after ``seq`` (whose last token the main model has not consumed), each
        chosen by ``choose`` from the head's logits [V] (None: greedy, their argmax), and
        those logits (none for greedy drafts from a draft step: accepting them needs none)."""
        h = self.catch_up(seq)
        if h is None:
            raise RuntimeError("MTP drafter: no hidden state to draft from (the prompt was not fed to it)")
        mark = self.state.pos
        try:
            if self.step is not None:
                return self._draft_steps(h, k, choose)
            tokens, logits = [], []
            for j in range(k):
                lg = self.model.lm_head(h)[0, -1]
                tokens.append(int(torch.argmax(lg)) if choose is None else choose(lg))
                logits.append(lg)
                if j + 1 < k:
                    emb = self.model.model.embed_tokens(torch.tensor([[tokens[-1]]], device=h.device))
                    h = self.head(emb, h, self.model.rotary, self.state)
            return tokens, logits
        finally:
            self.state.pos = mark  # the drafted positions are rewritten from the main model's rows

    def _draft_steps(self, h: torch.Tensor, k: int, choose) -> tuple[list[int], list[torch.Tensor]]:
        """``draft`` through the draft step, its last row's outputs (``h`` its hidden) in place:
        greedy, each draft the step's own argmax, consumed on the device by the next step and
        copied aside, all k read in one transfer; else each drawn on the host from its logits."""
        step = self.step
        if h.data_ptr() != step.hidden.data_ptr():  # the last row was fed by the forward
            step.hidden.copy_(h[0])
            step.logits.copy_(self.model.lm_head(h[0]))
            torch.argmax(step.logits, dim=-1, keepdim=True, out=step.token)
        if choose is None:
            picked = torch.empty(k, dtype=torch.long, device=step.token.device)
            for j in range(k):
                picked[j : j + 1].copy_(step.token[0])
                if j + 1 < k:
                    step.hidden_in.copy_(step.hidden)
                    step.step(None)
            return picked.tolist(), []
        tokens, logits = [], []
        for j in range(k):
            logits.append(step.logits[0].clone())
            tokens.append(choose(logits[-1]))
            if j + 1 < k:
                step.hidden_in.copy_(step.hidden)
                step.step(tokens[-1])
        return tokens, logits


# rows the head's catch-up feeds through the draft step's windows, as one step (a verify window
# keeps at most K + 1 = 5); more (a prompt) go through its forward in one pass
STEP_ROWS = 5


def accept(sampler, logits: torch.Tensor, drafts: list[int], draft_logits: list[torch.Tensor]) -> list[int]:
    """The tokens one verify step emits: logits [k+1, V] of the rows t_n, d_1..d_k.

    Greedy: each draft kept while it is the argmax of the row before it, then that row's argmax.
    Sampling: draft d_j (drawn from q_j, the sampler's distribution of its draft logits) is kept
    with probability min(1, p_j(d_j) / q_j(d_j)), p_j being the sampler's distribution of row j;
    the first one refused is replaced by a draw from max(0, p_j - q_j), normalised; all kept, a
    bonus token is drawn from p_k. Each emitted token is then distributed as p (the standard
    speculative-sampling argument), so sampling is unchanged by drafting."""
    out = []
    if sampler.params.greedy:
        best = sampler.greedy_rows(logits)  # one read; a row is refused only once it is reached
        for d in drafts:
            b = next(best)
            if b != d:
                return out + [b]
            out.append(d)
        return out + [next(best)]
    for j, d in enumerate(drafts):
        p, q = sampler.probs(logits[j]), sampler.probs(draft_logits[j])
        if sampler.uniform() * float(q[d]) < float(p[d]):  # u < p/q, without dividing by q
            out.append(d)
            continue
        residual = (p - q).clamp_(min=0)
        return out + [sampler.draw(residual if float(residual.sum()) > 0 else p)]
    return out + [sampler.draw(sampler.probs(logits[len(drafts)]))]


def draft_chooser(sampler) -> Callable[[torch.Tensor], int] | None:
    """How a draft token is picked from the head's logits: None for a greedy request (their
    argmax, ``MtpDrafter.draft``), else a draw from the sampler's distribution of them (the q of
    ``accept``)."""
    if sampler.params.greedy:
        return None
    return lambda lg: sampler.draw(sampler.probs(lg))
