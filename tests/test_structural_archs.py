"""Architectures outside the table (engine/weights/arch.py) run by structure: hunyuan_v1_moe and dots1
match transformers' reference exactly, and a block that computes something else is refused in one line."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.errors import CheckpointError
from engine.weights.arch import ARCHS
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams
from models.tiny import STRUCTURAL_ARCHS, load_reference


def _prompt(vocab: int, n: int = 24) -> list[int]:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", STRUCTURAL_ARCHS)
def test_parity_at_a_quarter_cache_from_disk(tiny_ckpt, arch: str) -> None:
    assert arch not in ARCHS  # run by structure, not by name
    path = tiny_ckpt(arch)
    ref = load_reference(path)
    ids = _prompt(ref.config.vocab_size)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0]
        ref_tokens = ref.generate(
            torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False
        )[0, len(ids) :].tolist()
    for offload, fraction in (("disk", 0.25), ("ram", 1.0)):
        om = load_model(
            path, EngineConfig(cache_fraction=fraction, offload=offload, dtype="float32")
        )
        try:
            assert not any(".experts." in n for n, _ in om.model.named_parameters())
            diff = (prompt_logits(om, ids) - ref_logits).abs().max().item()
            assert diff <= 1e-4, f"{offload} cache={fraction}: max |Δlogit| = {diff}"
            assert (
                generate(om, ids, SamplingParams(max_tokens=16, min_tokens=16)).token_ids
                == ref_tokens
            )
            if fraction < 1.0:
                assert om.stats.snapshot()["misses"] > 0
        finally:
            om.close()


def test_a_block_that_computes_something_else_is_refused_in_one_line(
    tiny_ckpt, monkeypatch
) -> None:
    """dots1's block with its shared experts left out of its own forward: the structure matches, the
    check at load does not, and load names what differs."""
    from transformers.models.dots1 import modeling_dots1

    cls = modeling_dots1.Dots1MoE
    original = cls.forward

    class Zero(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.zeros_like(x)

    def routed_only(self, hidden_states):  # the block's own forward, minus its shared part
        shared = self.shared_experts
        self.shared_experts = Zero()
        try:
            return original(self, hidden_states)
        finally:
            self.shared_experts = shared

    monkeypatch.setattr(cls, "forward", routed_only)
    with pytest.raises(CheckpointError) as err:
        load_model(tiny_ckpt("dots1"), EngineConfig(dtype="float32"))
    msg = str(err.value)
    assert (
        "\n" not in msg
        and "model_type='dots1'" in msg
        and "Dots1MoE" in msg
        and "shared part" in msg
    )
