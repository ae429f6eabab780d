"""Static count: SASS instructions per int4 weight value, ``qgemv_mma`` tiles against ``qgemv`` at
N = 1..8, compiled for sm_90 on the CPU (no GPU needed: Triton compiles to a cubin anywhere).

    PYTHONPATH=... python3 benchmarks/sass_mma_gemv.py

int4 decode is bound by instruction issue, so instructions per weight value predict the GEMV's
time where bandwidth does not. Both kernels unroll their whole loop over C (static_range), so
the static count of one program is its dynamic count: instructions per thread over the weight
values per thread (rows x C / threads). C = 2048, group 32, no epilogue, no norm, with PDL.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from edgerun.kernels import qlinear_mma as MMA
from edgerun.kernels import qlinear_triton as K

C = 2048
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
POINTERS = dict(x="*bf16", w="*u8", s="*u8", row_scale="*fp32", bias="*bf16", gate="*bf16", out="*bf16")
POINTERS |= dict(norm_w="*bf16", norm_out="*bf16", eps="fp32")
COMMON = dict(C=C, QUANT=2, G=32, GROUPED=True, ROW_SCALED=True, HAS_BIAS=False, EPILOGUE=0, CODE=1)
COMMON |= dict(NORM=0, NORM_OUT=False, NO_BLOCK=16, PDL=True)


def sass_ops(fn, const: dict, num_warps: int) -> collections.Counter:
    sig = {a: POINTERS.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
    # pointers 16-byte aligned, as a launch with torch's allocations specializes them
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if sig[a].startswith("*")}
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    kernel = compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "launch_pdl": True}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run(
            [str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    return collections.Counter(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass))


def report(name: str, ops: collections.Counter, rows: int, num_warps: int) -> None:
    per_value = sum(ops.values()) / (rows * C / (32 * num_warps))
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
    print(f"{name:<28}{sum(ops.values()):>7}{per_value:>8.2f}   {top}")


def main() -> None:
    print(f"int4 g32, C = {C}, sm_90: SASS instructions per thread, and per weight value")
    print(f"{'kernel':<28}{'instr':>7}{'/value':>8}   most frequent")
    for cfg in MMA.SWEEP_TILES:
        const = COMMON | dict(BLOCK_R=cfg.block_r, BLOCK_K=cfg.block_k, CHUNK=256, INTERPRET=False)
        name = f"qgemv_mma r{cfg.block_r} k{cfg.block_k} w{cfg.num_warps}"
        report(name, sass_ops(MMA._qgemv_mma_kernel, const, cfg.num_warps), cfg.block_r, cfg.num_warps)
    cfg = K.MANY["int4"]
    block_k = cfg.row_bytes * 2  # qgemv's step for int4: row_bytes of each row, two values a byte
    for n in (1, 2, 4, 8):
        const = COMMON | dict(
            N=n, BLOCK_R=cfg.block_r, BLOCK_K=block_k, SUM=32, BLOCK_C=C, ROLLED=False
        )  # unrolled: static count = dynamic
        name = f"qgemv N={n} r{cfg.block_r} w{cfg.num_warps}"
        report(name, sass_ops(K._qgemv_kernel, const, cfg.num_warps), cfg.block_r, cfg.num_warps)


if __name__ == "__main__":
    main()
