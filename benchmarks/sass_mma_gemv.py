"""Static count: SASS instructions per int4 weight value, ``qgemv_mma`` tiles against ``qgemv`` at
N = 1..8, the nibble-plane GEMV, and the routed-expert decode kernels, compiled for sm_90 on the
CPU (no GPU needed: Triton compiles to a cubin anywhere).

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


def sass_ops(fn, const: dict, num_warps: int, loop_body: bool = False) -> collections.Counter:
    """Instructions of one program by opcode; ``loop_body``: those of its longest loop only (a
    kernel whose steps are a runtime loop: the body runs once a step)."""
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
    ins = [
        (int(m.group(1), 16), m.group(2), m.group(3))
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)([^;]*)", sass)
    ]
    if loop_body:  # the longest backward branch's span
        spans = [
            (int(t.group(1), 16), a)
            for a, op, rest in ins
            if op == "BRA" and (t := re.search(r"0x([0-9a-f]+)", rest)) and int(t.group(1), 16) < a
        ]
        lo, hi = max(spans, key=lambda s: s[1] - s[0])
        ins = [i for i in ins if lo <= i[0] <= hi]
    return collections.Counter(op for _, op, _ in ins)


def report(name: str, ops: collections.Counter, rows: int, num_warps: int, cols: int = C) -> None:
    """One line: the instructions counted, and per weight value of ``rows`` x ``cols`` a program."""
    per_value = sum(ops.values()) / (rows * cols / (32 * num_warps))
    top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
    print(f"{name:<28}{sum(ops.values()):>7}{per_value:>8.2f}   {top}")


def report_planes() -> None:
    """The nibble-plane GEMV (kernels/qlinear_planes.py): its loop body, one step of 4 G columns,
    per weight value of the step, without and with the RMSNorm prologue; the same for any N <= 16."""
    from edgerun.kernels import qlinear_planes as P

    POINTERS.update(part="*fp32", count="*i32")
    for block_r, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
        for norm in (0, 1):
            const = COMMON | dict(
                C=C, G=32, BLOCK_R=block_r, SPLIT=2, NORM=norm, BLOCK_C=C, INTERPRET=False, PREFETCH=0
            )
            const = {k: v for k, v in const.items() if k in P._planes_kernel.arg_names}
            ops = sass_ops(P._planes_kernel, const, warps, loop_body=True)
            name = f"planes r{block_r} w{warps}{' norm' if norm else ''} (a step)"
            report(name, ops, block_r, warps, cols=4 * 32)


def report_experts() -> None:
    """The routed-expert decode kernels (kernels/moe_triton.py) at Qwen3.6's geometry (D 2048,
    I 512, A 8), int4 g32, the default tile: per weight value of one program (gate_up: its gate
    and up rows over D; down: its rows of one expert over I). The down count includes the branch
    that only a tile's last program to arrive runs (summing the token's experts)."""
    from edgerun.kernels import moe_triton as MT

    POINTERS.update(wpool="*u8", spool="*u8", slots="*i64", table="*i64", ids="*i64", gscales="*fp32")
    POINTERS.update(
        h="*fp32", far_reads="*i64", uses="*i64", rw="*bf16", shared="*bf16", part="*fp32", logits="*bf16"
    )
    POINTERS.update(count="*i32", ready="*i32")
    cfg = MT.DEFAULT_GEMV
    common = dict(I=512, A=8, QUANT=2, G=32, GROUPED=True, SUM=32, TABLE=True, RANGE=False, PDL=True)
    # the shared expert's down projection not in the launch, x not given in int8
    gate_up = MT.NO_SD | dict(
        XQ=False, INTERPRET=False, ROUTE=False, E=1, BLOCK_E=1, A_P2=1, NORMALIZE=False, RCODE=0, PICK32=False,
        READY=False,
    )  # fmt: skip
    rows = 2 * cfg.block_r
    const = common | gate_up | dict(D=2048, BLOCK_R=rows, BLOCK_K=2 * cfg.row_bytes, FAR=False)
    ops = sass_ops(MT._gate_up_kernel, const, cfg.num_warps)
    report(f"experts gate_up r{rows} w{cfg.num_warps}", ops, rows, cfg.num_warps, cols=2048)
    # routed over Qwen3.6's 256 bf16 logits (a program picks its expert: a + 1 maxima; the
    # routing program's branch counted too), the picks on int64 or int32 keys
    for pick32 in (False, True):
        routed = const | dict(ROUTE=True, E=256, BLOCK_E=256, A_P2=8, NORMALIZE=True, RCODE=1, PICK32=pick32,
                              READY=True)  # fmt: skip
        ops = sass_ops(MT._gate_up_kernel, routed, cfg.num_warps)
        keys = "int32" if pick32 else "int64"
        report(f"experts gate_up routed, {keys} keys", ops, rows, cfg.num_warps, cols=2048)
        print(
            f"    shuffles {ops['SHFL']}, barriers {ops['BAR']}, compares {ops['ISETP']}, selects {ops['SEL']}"
        )
    const = common | dict(
        D=2048,
        A_P2=8,
        BLOCK_R=cfg.down_rows,
        BLOCK_K=512,
        SHARED=True,
        INTO=True,
        CODE=1,
        ACC=False,
        LATE=False,
        READY=False,
        INTERPRET=False,
    )
    ops = sass_ops(MT._down_kernel, const, cfg.num_warps)
    report(f"experts down r{cfg.down_rows} w{cfg.num_warps}", ops, cfg.down_rows, cfg.num_warps, cols=512)
    ops = sass_ops(MT._down_kernel, const | dict(LATE=True, READY=True), cfg.num_warps)
    report(
        f"experts down r{cfg.down_rows} w{cfg.num_warps}, ready flag",
        ops,
        cfg.down_rows,
        cfg.num_warps,
        cols=512,
    )


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
            N=n,
            BLOCK_R=cfg.block_r,
            BLOCK_K=block_k,
            SUM=32,
            BLOCK_C=C,
            ROLLED=False,
            NORM_Q=False,
            **K.NO_ALSO,
            **K.NO_CONV,
        )  # unrolled: static count = dynamic
        name = f"qgemv N={n} r{cfg.block_r} w{cfg.num_warps}"
        report(name, sass_ops(K._qgemv_kernel, const, cfg.num_warps), cfg.block_r, cfg.num_warps)
    report_planes()
    report_experts()


if __name__ == "__main__":
    main()
