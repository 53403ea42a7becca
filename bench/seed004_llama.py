"""Seed 004's headline baseline, llama.cpp with speculative decoding, on the embedded pair: the target
and its draft converted to bf16 GGUF with llama.cpp's own convert_hf_to_gguf.py, served by
llama-server without and with the draft (`-md --spec-type draft-simple`: this llama.cpp drafts
nothing with `-md` alone), one slot, one thread (the engine's one torch
thread), greedy with ignore_eos. The decode rate is llama-server's own: tokens predicted over
`timings.predicted_ms` (prefill excluded, as the engine's clock starts after the first token).

The draft is a qwen3 model whose small BPE vocabulary the converter's Qwen2 writer would read with
sentencepiece; it goes through the generic BPE writer instead (as the target does in
bench/streams_vs_llama.py), which changes no weight and no token id."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.peers import CONVERT_RUN, CONVERT_SETUP
from bench.streams_vs_llama import convert, llama_server

# Both models through the generic BPE vocabulary writer (see the module docstring).
CONVERT_PAIR = (
    CONVERT_SETUP
    + """
from conversion import glm, qwen
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
qwen.Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()
"""
    + CONVERT_RUN
)
DRAFT_TOKENS = 4  # proposals per verification, as the engine's k = 4 cells


def gguf_pair(llama_cpp: Path, target: Path, draft: Path, work: Path) -> tuple[Path, Path]:
    """The pair as bf16 GGUF files under `work` (converted once)."""
    return (
        convert(llama_cpp, target, work / "target-bf16.gguf", CONVERT_PAIR),
        convert(llama_cpp, draft, work / "draft-bf16.gguf", CONVERT_PAIR),
    )


def server_flags(draft: Path | None, threads: int) -> tuple[str, ...]:
    """llama-server's extra flags: the draft model, the speculation type that makes it draft (with
    `-md` alone this build loads the draft and speculates with nothing) and its window (at most
    DRAFT_TOKENS a verification, no minimum), or none."""
    if draft is None:
        return ()
    return (
        "-md",
        str(draft),
        "--spec-type",
        "draft-simple",
        "--spec-draft-n-max",
        str(DRAFT_TOKENS),
        "--spec-draft-n-min",
        "0",
        "-td",
        str(threads),
    )


def figures(response: dict[str, Any], drafting: bool) -> dict[str, Any]:
    """One /completion response's figures: decode tok/s and, with a draft, drafted and accepted
    tokens, the acceptance (accepted / drafted) and tokens a verification, derived as produced over
    produced - accepted (every target step yields one token of its own, and each accepted draft
    token one more). A drafting server whose response reports no drafted tokens fails the run: its
    rows would describe llama.cpp without speculation."""
    t = response["timings"]
    out: dict[str, Any] = {
        "tok_s": t["predicted_n"] / (t["predicted_ms"] / 1e3),
        "produced": t["predicted_n"],
        "tokens": response.get("tokens", []),
    }
    if not drafting:
        return out
    drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
    if not drafted:
        raise RuntimeError(
            f"llama-server with a draft drafted no tokens (timings: {t}); its flags do not make it speculate"
        )
    out |= {
        "drafted": drafted,
        "accepted": accepted,
        "draft_acceptance": accepted / drafted,
        "tokens_per_verification": t["predicted_n"] / max(t["predicted_n"] - accepted, 1),
    }
    return out


def completion(url: str, prompt: list[int], tokens: int, drafting: bool) -> dict[str, Any]:
    """One greedy /completion of `tokens` tokens (see `figures`)."""
    body = dict(
        prompt=prompt,
        n_predict=tokens,
        temperature=0.0,
        ignore_eos=True,
        cache_prompt=False,
        return_tokens=True,
    )
    return figures(httpx.post(url + "/completion", json=body, timeout=900).json(), drafting)


class LlamaServers:
    """llama-server without and with the draft, both ready for the whole interleaved run."""

    CELLS = ("llama-server", "llama-server -md")

    def __init__(
        self, llama_cpp: Path, ggufs: tuple[Path, Path], ctx: int, threads: int, work: Path
    ) -> None:
        self.stack = ExitStack()
        exe = llama_cpp / "build/bin/llama-server"
        target, draft = ggufs
        self.urls = {
            cell: self.stack.enter_context(
                llama_server(
                    exe,
                    target,
                    1,
                    ctx,
                    threads,
                    work / f"llama-server-{i}.log",
                    server_flags(draft if i else None, threads),
                )
            )[0]
            for i, cell in enumerate(self.CELLS)
        }

    def run(self, cell: str, prompt: list[int], tokens: int) -> dict[str, Any]:
        return completion(self.urls[cell], prompt, tokens, cell != self.CELLS[0])

    def close(self) -> None:
        self.stack.close()
