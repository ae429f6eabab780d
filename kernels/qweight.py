"""A dense linear weight as a bundle stores it (plain, int8 or int4) and its exact dequantization.

The quantized schemes are the experts' (``bundle/quant.py``), applied to one [R, C] weight:

- ``plain``: ``weight`` [R, C] in a float dtype, used as is.
- ``int8``: ``weight`` int8 [R, C] in [-127, 127], ``scales`` fp32 [R, C // group]; value =
  q * scale.
- ``int4``: ``weight`` uint8 [R, C // 2] (column 2j in the low nibble of byte j, two's
  complement), ``scales`` uint8 [R, C // group] (float8_e4m3fn bit patterns), ``row_scale`` fp32
  [R]: the power-of-two global scale of the tensor each row came from (one value per source
  tensor; rows of tensors concatenated for one GEMV keep their own). value = q * (e4m3(code) *
  row_scale), exact in fp32.

``group`` is the columns per scale (int8 with one scale per row: C). The kernels in
``qlinear_triton.py`` compute from these tensors as they are; ``dequantize`` is their reference.
Shape legend: R = rows (output features), C = columns (input features), G = C // group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCHEMES = ("plain", "int8", "int4")
ACTS = ("bf16", "int8")  # x as it is, or quantized to int8 per 32 columns (W4A8)


@dataclass(frozen=True)
class QWeight:
    scheme: str
    weight: torch.Tensor
    scales: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    group: int = 0
    act: str = (
        "bf16"  # "int8": W4A8, x quantized to int8 per 32 columns (int4 g32 only; kernels/qlinear_w4a8.py)
    )

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    @property
    def cols(self) -> int:
        return self.weight.shape[1] * (2 if self.scheme == "int4" else 1)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.weight, self.scales, self.row_scale) if t is not None]

    def check(self, name: str = "weight") -> None:
        """Shapes and dtypes agree with the scheme; errors name the weight."""
        if self.scheme not in SCHEMES:
            raise ValueError(f"{name}: scheme {self.scheme!r} is not one of {', '.join(SCHEMES)}")
        if self.act not in ACTS:
            raise ValueError(f"{name}: act {self.act!r} is not one of {', '.join(ACTS)}")
        if self.act == "int8" and (self.scheme != "int4" or self.group != 32):
            raise ValueError(
                f"{name}: int8 activations need an int4 weight in groups of 32, got {self.scheme} group {self.group}"
            )
        if self.weight.dim() != 2:
            raise ValueError(f"{name}: weight must be 2-D, got {list(self.weight.shape)}")
        if self.scheme == "plain":
            if not self.weight.is_floating_point():
                raise ValueError(f"{name}: a plain weight must be a float tensor, got {self.weight.dtype}")
            return
        R, C = self.rows, self.cols
        want_w = torch.int8 if self.scheme == "int8" else torch.uint8
        if self.weight.dtype != want_w:
            raise ValueError(f"{name}: {self.scheme} weight must be {want_w}, got {self.weight.dtype}")
        if self.group <= 0 or C % self.group:
            raise ValueError(f"{name}: group {self.group} does not divide the {C} columns")
        want_s = torch.float32 if self.scheme == "int8" else torch.uint8
        if (
            self.scales is None
            or tuple(self.scales.shape) != (R, C // self.group)
            or self.scales.dtype != want_s
        ):
            got = None if self.scales is None else (list(self.scales.shape), self.scales.dtype)
            raise ValueError(f"{name}: scales must be {want_s} [{R}, {C // self.group}], got {got}")
        if self.scheme == "int4":
            rs = self.row_scale
            if rs is None or tuple(rs.shape) != (R,) or rs.dtype != torch.float32:
                got = None if rs is None else (list(rs.shape), rs.dtype)
                raise ValueError(f"{name}: row_scale must be fp32 [{R}], got {got}")


def int4_values(w: QWeight) -> torch.Tensor:
    """An int4 weight's stored values q, int16 [R, C] in [-8, 7] (column 2j: byte j's low nibble)."""
    n = torch.stack([w.weight & 0xF, w.weight >> 4], dim=-1).reshape(w.rows, w.cols)
    return (n.to(torch.int16) ^ 8) - 8


def dequantize(w: QWeight) -> torch.Tensor:
    """The weight's exact values, fp32 [R, C] (plain: the stored values, upcast)."""
    if w.scheme == "plain":
        return w.weight.float()
    R, C, g = w.rows, w.cols, w.group
    if w.scheme == "int8":
        q = w.weight.float()
        step = w.scales
    else:
        q = int4_values(w).float()
        step = w.scales.view(torch.float8_e4m3fn).float() * w.row_scale[:, None]
    return (q.reshape(R, C // g, g) * step[..., None]).reshape(R, C)


def concat_rows(parts: list[QWeight]) -> QWeight:
    """One weight whose rows are ``parts``' rows in order (for one GEMV over projections that
    read the same input). Every part must share the scheme, the column count and the group."""
    first = parts[0]
    for p in parts[1:]:
        if (p.scheme, p.cols, p.group) != (first.scheme, first.cols, first.group):
            raise ValueError(
                f"cannot concatenate {p.scheme} [{p.rows}, {p.cols}] group {p.group} with "
                f"{first.scheme} [{first.rows}, {first.cols}] group {first.group}"
            )
        if p.act != first.act:
            raise ValueError(f"cannot concatenate rows of {p.act} activations with rows of {first.act}")
        if p.weight.dtype != first.weight.dtype:
            raise ValueError(f"cannot concatenate {p.weight.dtype} rows with {first.weight.dtype} rows")

    def cat(ts):
        return None if ts[0] is None else torch.cat(ts, 0)

    return QWeight(
        first.scheme,
        torch.cat([p.weight for p in parts], 0),
        cat([p.scales for p in parts]),
        cat([p.row_scale for p in parts]),
        first.group,
        first.act,
    )
