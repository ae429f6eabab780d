"""What a request's generation reports (its events and stats), with no torch import: the
engine's process sends them to the daemon's process, which unpickles them without loading torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeStats:
    steps: int = 0  # verify steps
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens of verify steps the request took (accepted drafts + one a step, up to its end)
    windows: int = 0  # streamed experts: (verify window, MoE layer) pairs
    window_experts: int = 0  # streamed experts: the distinct experts those needed, summed
    device_steps: int = 0  # of ``steps``, those decided on the device (engine/spec_steps.py)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, other: SpeculativeStats) -> None:
        self.steps += other.steps
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.emitted += other.emitted
        self.windows += other.windows
        self.window_experts += other.window_experts
        self.device_steps += other.device_steps

    def line(self) -> str:
        text = f"MTP acceptance {self.acceptance:.0%} ({self.accepted}/{self.drafted}), {self.tokens_per_step:.2f} tok/step"
        if self.windows:
            text += f", {self.window_experts / self.windows:.1f} experts/layer a verify window"
        if self.device_steps:
            text += f", {self.device_steps}/{self.steps} steps decided on the device"
        return text


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0  # from the request to its first token: state set-up, prefill, first sample
    prefill_s: float = 0.0  # from the first prefill chunk to the first token
    decode_s: float = 0.0
    peak_memory_bytes: int = 0
    speculative: SpeculativeStats | None = None  # with speculative decoding: its verify steps
    row_step_s: float = 0.0  # with speculative decoding: a plain one-row step's time (the start-up probe)

    @property
    def speedup(self) -> float:
        """Speculative decoding's rate over plain decoding's, as the probe timed a one-row step."""
        return self.decode_tps * self.row_step_s

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tps(self) -> float:
        # the first generated token comes out of prefill; the rest each cost one decode step
        steps = max(self.generated_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0

    def line(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok, "
            f"TTFT {self.ttft_s * 1e3:.0f} ms, prefill {self.prefill_tps:.1f} tok/s, "
            f"decode {self.decode_tps:.1f} tok/s, "
            + (
                f"{self.speculative.line()}, speed-up {self.speedup:.2f}x (one-row step "
                f"{self.row_step_s * 1e3:.2f} ms, probed), "
                if self.speculative
                else ""
            )
            + f"peak memory {self.peak_memory_bytes / 2**20:.0f} MiB"
        )


@dataclass
class Event:
    text: str  # text delta; "" while held back (a partial character, or a possible stop string)
    token_id: int | None = None
    finish_reason: str | None = None  # "stop" (EOS or stop string) | "length"
    stats: GenerationStats | None = None
    prefilled: int = 0  # on a prefill chunk's event: the prompt tokens through the model so far
