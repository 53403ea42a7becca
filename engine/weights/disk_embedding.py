"""The input embedding table left in the checkpoint file: each step reads the rows of its tokens.

Why: a decode step looks up one row per token (4 KiB of Qwen3-30B-A3B's 151936 x 2048 bf16 table,
0.62 GB in all), so a copy in RAM holds hundreds of megabytes that are almost never read, and under
a memory limit those bytes are fast-tier slots the plan could not give the experts. `DiskEmbedding`
reads rows with pread through the page cache (clean pages the kernel may drop) and keeps the most
recent ones in a small cache of its own. A memory map would do the same with less code, but a map
turns a checkpoint that goes away (truncated, a failed disk) into SIGBUS, which kills the engine; a
read failure is a CheckpointError, one failed request.

It applies where the table is used as stored: on the CPU, an embedding not tied to the LM head (a
tied one is streamed every step as the head's weight), stored in the compute dtype without scales.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch
from torch import nn

from engine.errors import CheckpointError
from engine.weights.checkpoint import torch_dtype
from engine.weights.embedding_source import CACHE_BYTES
from engine.weights.safetensors_index import TensorLocation


def input_embedding_name(model: nn.Module) -> str | None:
    """The state-dict name of `model`'s input embedding weight, or None where it has none."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if get is not None else None
    weight = getattr(emb, "weight", None)
    if type(emb) is not nn.Embedding or not isinstance(weight, torch.Tensor):
        return None
    return next((n for n, p in model.named_parameters() if p is weight), None)


class DiskEmbedding(nn.Module):
    """Stands in for an `nn.Embedding` whose table stays at `loc` in the checkpoint: the same rows, read
    on demand. It holds no parameters (`stored_numel`: the table's, for parameter counts); `weight` is an
    empty tensor of the table's dtype on the CPU, for forward code that asks the embedding where it lives
    (Llama 4's moves the ids to `embed_tokens.weight.device`)."""

    def __init__(self, loc: TensorLocation, padding_idx: int | None) -> None:
        super().__init__()
        self.loc, self.padding_idx = loc, padding_idx
        self.num_embeddings, self.embedding_dim = loc.shape
        self.stored_numel = self.num_embeddings * self.embedding_dim
        self.row_bytes = loc.nbytes // self.num_embeddings
        self._capacity = max(1, CACHE_BYTES // self.row_bytes)
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self._fd = os.open(loc.path, os.O_RDONLY)
        self.weight = torch.empty(0, dtype=torch_dtype(loc.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() == 1:
            # A one-row decode step: no unique, stack or gather (a twentieth of a token); a copy of the
            # row, which callers update in place.
            i = int(flat.item())
            self._check_ids(i, i)
            with self._lock:
                row = self._row(i)
            return row.clone().view(*ids.shape, self.embedding_dim)
        if flat.numel():
            self._check_ids(int(flat.min()), int(flat.max()))
        unique, inverse = torch.unique(flat, return_inverse=True)
        with self._lock:
            rows = (
                torch.stack([self._row(int(i)) for i in unique.tolist()])
                if unique.numel()
                else None
            )
        if rows is None:
            return torch.empty((*ids.shape, self.embedding_dim), dtype=torch_dtype(self.loc.dtype))
        return rows[inverse].view(*ids.shape, self.embedding_dim)

    def _check_ids(self, lowest: int, highest: int) -> None:
        if lowest < 0 or highest >= self.num_embeddings:
            raise IndexError(
                f"token id out of range for an embedding of {self.num_embeddings} rows"
            )

    def _row(self, i: int) -> torch.Tensor:
        row = self._rows.get(i)
        if row is not None:
            self._rows.move_to_end(i)
            return row
        at = self.loc.offset + i * self.row_bytes
        data = os.pread(self._fd, self.row_bytes, at)
        if len(data) != self.row_bytes:
            raise CheckpointError(
                f"{self.loc.path}: truncated: wanted {self.row_bytes} bytes at offset {at}, got {len(data)}"
            )
        row = torch.frombuffer(bytearray(data), dtype=torch_dtype(self.loc.dtype))
        self._rows[i] = row
        if len(self._rows) > self._capacity:
            self._rows.popitem(last=False)
        return row

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            # Past nn.Module.__setattr__, whose Parameter check fails when __del__ runs at interpreter exit.
            self.__dict__["_fd"] = -1

    def __del__(self) -> None:
        self.close()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows read from {self.loc.path.name}"
