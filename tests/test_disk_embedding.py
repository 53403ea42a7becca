"""The input embedding stays in the checkpoint on the CPU (EngineConfig.embedding_on_disk): its bytes leave
the plan's dense pool for the fast tier, each step reads its tokens' rows, and the tokens do not change.
Why it can fail: a copy sneaks back in (the table then holds RAM the plan gave the experts), the plan and
the load disagree on it, a row comes from the wrong offset or a stale cache entry, a table is read where
its bytes are not the compute dtype's (a bf16 table of an f32 model, one tied to the LM head), or a
checkpoint that goes away kills the process instead of failing the request."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.completion import generate
from engine.errors import CheckpointError
from engine.plan.probe import probe_checkpoint
from engine.weights.checkpoint import read_tensor
from engine.weights.disk_embedding import DiskEmbedding
from engine.weights.embedding_source import resident_bytes
from engine.weights.safetensors_index import index_checkpoint
from engine.worker.loader import load_model
from engine.worker.parity import prompt_logits
from engine.worker.sampling import SamplingParams

IDS = [5, 6, 7, 9, 11, 13]


def _table(path: Path):
    return index_checkpoint(path)["model.embed_tokens.weight"]


def test_rows_equal_the_table_and_the_plan_gives_its_bytes_to_the_experts(tiny_ckpt) -> None:
    path = tiny_ckpt("qwen3_moe")
    on_disk = load_model(path, EngineConfig(dtype="float32", kv_tokens=0))
    in_ram = load_model(path, EngineConfig(dtype="float32", kv_tokens=0, embedding_on_disk=False))
    try:
        emb = on_disk.model.get_input_embeddings()
        assert isinstance(emb, DiskEmbedding)
        assert type(in_ram.model.get_input_embeddings()) is torch.nn.Embedding
        loc = _table(path)
        kept = loc.nbytes - resident_bytes(loc)
        dense = [m.memory_plan.planned()["dense"] for m in (in_ram, on_disk)]
        assert dense[0] - dense[1] == kept
        assert (
            probe_checkpoint(path, EngineConfig(dtype="float32")).footprint.dense_on_disk_bytes
            == kept
        )
        assert on_disk.parameter_count() == in_ram.parameter_count()
        assert torch.equal(prompt_logits(on_disk, IDS), prompt_logits(in_ram, IDS))
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        assert generate(on_disk, IDS, params).tokens == generate(in_ram, IDS, params).tokens
    finally:
        on_disk.close()
        in_ram.close()


def test_rows_through_a_small_cache_are_the_table(tiny_ckpt, monkeypatch) -> None:
    """Lookups in any shape, repeats and evictions included, give the table's rows."""
    import engine.weights.disk_embedding as de

    loc = _table(tiny_ckpt("qwen3_moe"))
    monkeypatch.setattr(de, "CACHE_BYTES", 3 * loc.nbytes // loc.shape[0])  # three rows
    emb, table = DiskEmbedding(loc, None), read_tensor(loc)
    ids = torch.tensor([[3, 7, 3, 250], [0, 7, 9, 1]])
    for _ in range(2):
        assert torch.equal(emb(ids), table[ids])
        assert len(emb._rows) == 3
    for one in (
        torch.tensor([7]),
        torch.tensor([[250]]),
        torch.tensor(3),
    ):  # a decode step's one row
        got = emb(one)
        assert torch.equal(got, table[one])
        got.zero_()  # the caller's copy: the cached row stays the table's
        assert torch.equal(emb(one), table[one])
    for wrong in (loc.shape[0], -1):
        with pytest.raises(IndexError):
            emb(torch.tensor([wrong]))
    emb.close()


def test_a_truncated_checkpoint_fails_the_lookup_with_a_checkpoint_error(
    tiny_ckpt, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_ckpt("qwen3_moe"), model)
    loc = _table(model)
    emb = DiskEmbedding(loc, None)
    with open(loc.path, "r+b") as f:
        f.truncate(0)
    with pytest.raises(CheckpointError, match="truncated"):
        emb(torch.tensor([1, 2]))
    emb.close()


def test_no_disk_table_where_the_bytes_differ_from_the_compute_dtype(tiny_ckpt) -> None:
    """A bf16 table of an f32 model must be converted (a copy), and so stays in RAM."""
    om = load_model(
        tiny_ckpt("qwen3_moe", "per-expert", dtype=torch.bfloat16), EngineConfig(dtype="float32")
    )
    try:
        assert type(om.model.get_input_embeddings()) is torch.nn.Embedding
        assert "stay in the checkpoint" not in om.memory_plan.table()
    finally:
        om.close()


def test_no_disk_table_for_one_tied_to_the_head(tiny_ckpt) -> None:
    om = load_model(
        tiny_ckpt("qwen3_moe", "per-expert", tie_word_embeddings=True),
        EngineConfig(dtype="float32"),
    )
    try:
        assert om.model.config.tie_word_embeddings
        assert type(om.model.get_input_embeddings()) is torch.nn.Embedding
    finally:
        om.close()
