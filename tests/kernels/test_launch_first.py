"""kernels/launch.py's LAUNCH_FIRST and EARLY_PARAMS, built for sm_90 on the CPU (Triton's compiler
needs no GPU): a short launch that lets its successor launch first issues
``griddepcontrol.launch_dependents`` before its ``griddepcontrol.wait``, and otherwise after it;
both builds wait. With EARLY_PARAMS a launch's small weights are loaded before its wait. The
arithmetic is the same either way (the interpreted tests run it; PDL does not exist there)."""

import pytest
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from edgerun.kernels import decode_triton, dense_triton

GATED_NORM = (
    dense_triton._gated_norm_kernel,
    dict(out="*bf16", z="*bf16", z_row="i32", norm_w="*bf16", eps="fp32"),
    dict(HVDV=32 * 128, DV=128, BLOCK_DV=128, ACT=1, ROUND_NORM=True, EARLY_P=False, PDL=True),
)
COMBINE = (
    decode_triton._combine_kernel,
    dict(qkv="*bf16", pos_ptr="*i64", m_part="*fp32", l_part="*fp32", acc_part="*fp32", out="*bf16"),
    dict(NSPLIT=64, DH=256, GATED=True, PP=64, BLOCK_P=64, BLOCK_D=64, BLOCK_S=32, CODE=1, QKV_W=9216, H=16)
    | dict(EARLY=True, PDL=True),
)


def _ptx(fn, pointers: dict, const: dict) -> str:
    sig = {a: pointers.get(a, "constexpr") for a in fn.arg_names}
    constexprs = {(fn.arg_names.index(k),): v for k, v in const.items()}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    return compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 2, "launch_pdl": True}).asm[
        "ptx"
    ]


@pytest.mark.parametrize("kernel", [GATED_NORM, COMBINE], ids=["gated_norm", "combine"])
@pytest.mark.parametrize("first", [False, True])
def test_launch_first_lets_the_next_launch_before_the_wait(kernel, first):
    fn, pointers, const = kernel
    ptx = _ptx(fn, pointers, const | {"LAUNCH_FIRST": first})
    wait, launch = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    assert wait >= 0 and launch >= 0
    assert (launch < wait) == first


DELTA = (
    dense_triton._delta_decode_kernel,
    dict(
        act="*fp32",
        z="*bf16",
        a="*bf16",
        b="*bf16",
        z_row="i32",
        a_row="i32",
        b_row="i32",
        A_log="*fp32",
        dt_bias="*bf16",
        state="*fp32",
        slots="*i64",
        norm_w="*bf16",
        out="*bf16",
        eps="fp32",
        q_scale="fp32",
    ),
    dict(
        SLOTS=False, NK=16, R=2, DK=128, DV=128, BLOCK_DK=128, BLOCK_DV=128, SLICE=16, ACT=1, ROUND_NORM=True
    )
    | dict(PDL=True),
)


ATTEND = (
    decode_triton._attend_kernel,
    dict(
        qkv="*bf16",
        q_norm_w="*bf16",
        k_norm_w="*bf16",
        inv_freq="*fp32",
        pos_ptr="*i64",
        slots="*i64",
        k_cache="*bf16",
        v_cache="*bf16",
        m_part="*fp32",
        l_part="*fp32",
        acc_part="*fp32",
        eps="fp32",
        qk_scale="fp32",
    ),
    dict(
        S_MAX=4096,
        NSPLIT=64,
        HK=2,
        G=8,
        DH=256,
        R=64,
        GATED=True,
        GP=16,
        DP=256,
        BLOCK_S=32,
        UNIT_OFFSET=True,
    )
    | dict(CODE=1, EMULATE=False, SLOTS=False, WINDOW=False, EARLY=True, PDL=True),
)


def _loads_before_wait(ptx: str) -> int:
    return ptx[: ptx.find("griddepcontrol.wait")].count("ld.global")


@pytest.mark.parametrize("kernel", [GATED_NORM, DELTA, ATTEND], ids=["gated_norm", "delta_rule", "attend"])
def test_early_params_are_loaded_before_the_wait(kernel):
    """The gated norm's weights, a head's A_log and dt_bias, the q and k norms' weights and the
    rotary frequencies: loaded after the wait, or before it with EARLY_P (the delta rule's state
    and the attend launch's older keys and values are loaded before it either way)."""
    fn, pointers, const = kernel
    const = {k: v for k, v in const.items() if k != "EARLY_P"}
    late = _ptx(
        fn, pointers, const | {"EARLY_P": False} | ({"LAUNCH_FIRST": False} if fn is GATED_NORM[0] else {})
    )
    early = _ptx(
        fn, pointers, const | {"EARLY_P": True} | ({"LAUNCH_FIRST": False} if fn is GATED_NORM[0] else {})
    )
    assert _loads_before_wait(early) > _loads_before_wait(late)
    assert early.count("ld.global") == late.count("ld.global")  # the same loads, moved
