"""benchmarks/ab_decode.py's variants: what a --variant argument sets, and what it refuses."""

import bench_scripts
import pytest


@pytest.fixture(scope="module")
def ab():
    return bench_scripts.load("ab_decode")


def test_a_variant_sets_module_attributes_and_dataclass_fields(ab):
    from edgerun.engine import policy
    from edgerun.kernels import moe_triton

    name, sets = ab.parse_variant(
        "b8:edgerun.kernels.moe_triton.DEFAULT_GEMV.block_r=8;edgerun.engine.policy.GROUPED_DEFAULT=False"
    )
    assert name == "b8"
    (m1, a1, v1), (m2, a2, v2) = sets
    assert (m1, a1) == (moe_triton, "DEFAULT_GEMV") and (m2, a2, v2) == (policy, "GROUPED_DEFAULT", False)
    # a copy with the one field replaced; the module's own tile is untouched until the run sets it
    assert v1.block_r == 8 and v1.down_rows == moe_triton.DEFAULT_GEMV.down_rows
    assert moe_triton.DEFAULT_GEMV.block_r != 8
    # two fields of one attribute: the second replaces a field of the first's copy, not of the original
    _, sets = ab.parse_variant(
        "two:edgerun.kernels.moe_triton.DEFAULT_GEMV.block_r=8;edgerun.kernels.moe_triton.DEFAULT_GEMV.num_warps=4"
    )
    last = sets[-1][2]
    assert (last.block_r, last.num_warps) == (8, 4) and last.down_rows == moe_triton.DEFAULT_GEMV.down_rows
    # three names: a field of a dict attribute's entry, the dict copied with that entry replaced
    from edgerun.kernels import qlinear_triton

    _, sets = ab.parse_variant(
        "f8:edgerun.kernels.qlinear_triton.FEW.int4.block_r=8;edgerun.kernels.qlinear_triton.FEW.int4.num_warps=2"
    )
    few = sets[-1][2]
    assert (few["int4"].block_r, few["int4"].num_warps) == (8, 2) and few["int8"] is qlinear_triton.FEW[
        "int8"
    ]
    assert qlinear_triton.FEW["int4"].block_r != 8
    assert ab.parse_variant("base:") == ("base", [])
    assert ab.parse_variant("s:edgerun.engine.policy.GROUPED_DEFAULT=on")[1][0][2] == "on"  # not a literal


@pytest.mark.parametrize(
    "text",
    [
        "x:edgerun.kernels.moe_triton.NO_SUCH=1",
        "x:edgerun.kernels.moe_triton.DEFAULT_GEMV",
        "x:no_such_module.attr=1",
        "x:edgerun.kernels.moe_triton.DEFAULT_GEMV.block_r.more=1",
        "x:edgerun.kernels.moe_triton.DEFAULT_GEMV.no_field=1",
        "x:edgerun.engine.policy.GROUPED_DEFAULT.field=1",
        "x:edgerun.kernels.qlinear_triton.FEW.int2.block_r=8",
        "x:edgerun.kernels.qlinear_triton.FEW.int4.no_field=8",
    ],
)
def test_a_variant_that_names_nothing_is_refused(ab, text):
    with pytest.raises(SystemExit, match="module.attr"):
        ab.parse_variant(text)


def test_the_layer_table_sets_variants_side_by_side(ab):
    """``layer_table`` on a recorded call: each place of each layer kind, one column a variant."""
    import json
    from pathlib import Path

    recorded = json.loads(
        (Path(__file__).parents[2] / "docs/bench/pick32_2026-12-07/call2/ab.json").read_text()
    )
    text = ab.layer_table(recorded["rows"])
    assert "| layer kind | place | kernel | base | pf | a8w8 | a8r32w8 | a8k1 | d512 |" in text
    assert "| 1 (x29) | 0 | _qgemv_kernel | 7.07 | 7.17 | 9.44 | 6.82 | 7.07 | 6.94 |" in text
    assert "| 2 (x10) | 1 | _attend_kernel | 7.55 |" in text
    assert ab.layer_table({"x": {"tps": []}}) == ""  # nothing profiled
