"""`moe-offload plan` projects a named shape cut to fewer layers with that shape's measured costs."""

from __future__ import annotations

from dataclasses import replace

from cli.plan import depth_scaled
from engine.offline.hardware import SHAPES, costs_for


def test_a_depth_cut_shape_keeps_its_costs_with_the_lm_head_spread_over_fewer_layers() -> None:
    full = SHAPES["qwen3-30b-a3b"]
    cut = replace(full, layers=8)
    base = costs_for("this-machine-disk", cut)
    got = depth_scaled(base, cut)
    d, h = full.dense_params_per_layer, full.head_params
    f = (d + h / 8) / (d + h / 48)
    assert (
        abs(got.dense[0] - base.dense[0] * f) < 1e-12 and f > 2
    )  # the head weighs 6x more a layer
    assert got.fast == base.fast and got.expert_bytes == base.expert_bytes
    assert depth_scaled(costs_for("this-machine-disk", full), full).dense == base.dense
