"""The native softmax top-k router (engine/native/router.py) returns what transformers' TopKRouter
returns for one row: the same experts, weights and logits within rounding, in f32 and bf16; other
routers keep their forward."""

from __future__ import annotations

import pytest
import torch
from tiny_models import load_reference

from engine.native.loaded import native
from engine.native.router import NativeTopKRouter
from engine.native.row_kernels import native_rows


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "olmoe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_router_matches_the_routers_forward(
    tiny_ckpt, arch: str, dtype: torch.dtype
) -> None:
    if native() is None:
        pytest.skip("no C compiler on this machine: the engine runs torch's router")
    model = load_reference(tiny_ckpt(arch)).to(dtype)
    block = model.model.layers[0].mlp
    router = block.gate
    assert NativeTopKRouter.supports(router), type(router).__name__
    fast = NativeTopKRouter(router)
    with torch.no_grad():  # as the engine runs it
        g = torch.Generator().manual_seed(3)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        for i in range(50):
            x = torch.randn(1, router.weight.shape[1], generator=g).to(dtype)
            got = fast(x)
            ref = router.forward(x)
            if i == 0:  # the first call checks itself, then returns its own (native) result
                assert fast.verified is True and got is not None
            assert got is not None
            assert torch.equal(got[2], ref[2]), "different experts"
            for a, b in zip(got[:2], ref[:2]):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)
        # Several rows: each as it routes alone (a verification window), in a step whose rows take the
        # native kernels; prompt rows keep the router's forward.
        rows = torch.randn(3, router.weight.shape[1], generator=g).to(dtype)
        many = fast(rows)
        assert many is not None
        for r in range(3):
            one = fast(rows[r : r + 1])
            assert one is not None and all(torch.equal(a[r : r + 1], b) for a, b in zip(many, one))
        with native_rows(False):
            assert fast(rows) is None


def test_mixtral_router_keeps_its_forward(tiny_ckpt) -> None:
    model = load_reference(tiny_ckpt("mixtral"))
    assert not NativeTopKRouter.supports(model.model.layers[0].mlp.gate)


def test_the_first_call_check_accepts_rounding_and_ties_but_not_another_router() -> None:
    """engine/native/router.py `same_routing`: logits within rounding relative to the largest logit, and
    the same experts except where the reference's logits tie to rounding."""
    from engine.native.router import same_routing

    logits = torch.tensor([[30.0, 2.0, 2.0 + 1e-6, -25.0, 1e-4]])
    ref = (logits, torch.tensor([[0.99, 0.005, 0.005]]), torch.tensor([[0, 2, 1]]))
    nudged = logits + torch.tensor(
        [[0.0, 0.0, 0.0, 0.0, 2e-5]]
    )  # a small logit's rounding among large ones
    assert same_routing((nudged, ref[1], ref[2]), ref, 1e-5)
    assert same_routing(
        (logits, ref[1], torch.tensor([[0, 1, 2]])), ref, 1e-5
    )  # experts 1 and 2 tie
    assert not same_routing(
        (logits, ref[1], torch.tensor([[0, 1, 4]])), ref, 1e-5
    )  # expert 4 is no tie
    assert not same_routing(
        (logits, torch.tensor([[0.98, 0.01, 0.01]]), ref[2]), ref, 1e-5
    )  # other weights
    assert not same_routing(
        (logits.sigmoid(), ref[1], ref[2]), ref, 1e-5
    )  # another router's logits
    assert not same_routing((logits.double(), ref[1], ref[2]), ref, 1e-5)  # another dtype


@pytest.mark.parametrize(("groups", "keep"), [(1, 1), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_sigmoid_router_matches_deepseek_v3s(
    groups: int, keep: int, dtype: torch.dtype
) -> None:
    """decode_layer.c `router_sigmoid` (the fused decode step's GLM-4-MoE / DeepSeek-V3 router): the same experts
    (as a set: the reference's topk is unsorted), weights and logits within rounding, group-limited or not."""
    if native() is None:
        pytest.skip("no C compiler on this machine")
    from types import SimpleNamespace

    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from engine.native.router import by_id as _by_id
    from engine.native.router import same_routing

    cfg = SimpleNamespace(
        num_experts_per_tok=6,
        num_local_experts=32,
        hidden_size=96,
        routed_scaling_factor=2.5,
        n_group=groups,
        topk_group=keep,
        norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 96, generator=g) * 0.1)
        router.e_score_correction_bias.copy_(torch.randn(32, generator=g) * 0.05)
    w = router.weight.data.to(dtype)
    router.weight.data = (
        w  # the router computes in f32 from the stored weight, as a bf16 model's does
    )
    for _ in range(30):
        x = torch.randn(1, 96, generator=g).to(dtype)
        got = native().router_sigmoid(
            x, w, router.e_score_correction_bias.float(), 6, groups, keep, True, 2.5
        )
        with torch.no_grad():
            ref = router(x)
        assert got is not None and same_routing(_by_id(got), _by_id(ref), 1e-5), (got, ref)
    # Several rows in one call: each routed with the bits it gets alone (a prompt chunk's rows).
    rows = torch.randn(9, 96, generator=g).to(dtype)
    args = (w, router.e_score_correction_bias.float(), 6, groups, keep, True, 2.5)
    together = native().router_sigmoid(rows, *args)
    alone = [native().router_sigmoid(rows[r : r + 1].clone(), *args) for r in range(9)]
    assert together is not None and all(a is not None for a in alone)
    for part, parts in zip(together, zip(*alone)):
        assert torch.equal(part, torch.cat(parts))
