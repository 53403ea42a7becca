"""Aggregate decode throughput of 1 and 8 concurrent streams, this engine beside llama-server, side by side.

The engine: one in-process engine core at cache 1.0 (every expert in RAM), N greedy requests with
distinct prompts submitted at once, as the server would; the decode clock starts once every request has
its first token (prefill excluded). llama-server: the same model converted to GGUF at bf16 (the
engine's default dtype) with llama.cpp's own convert_hf_to_gguf.py, one server per slot count
(`-np 1` and `-np N`, `-t 1 -tb 1`: one thread, as the engine's one torch thread), the same prompt
token ids sent as N concurrent /completion requests, the same max tokens, greedy (temperature 0,
ignore_eos); its decode rate is the tokens it predicted over the longest request's own decode time
(`timings.predicted_ms`, prefill excluded).

Two rates per cell: by wall time, and by the process's CPU time in the decode (the engine's after the first
tokens; llama-server's for the full requests less that of the same requests with one token each, its
prefill). On a shared machine the CPU-time figure is the steadier one. Rounds are interleaved (every cell once per round, after a warm-up round), ratios are
taken within a round and their medians reported. The last column: the share of greedy tokens where
llama.cpp's token equals the engine's (both bf16; rounding may part them, after which the texts differ).

The converter does not know the embedded model's small BPE tokenizer nor GLM's special tokens it expects;
it runs with the pre-tokenizer mapped to gpt-2 and the generic BPE vocabulary writer, which changes nothing
about the weights, the token ids or the decode speed.

    python -m bench.streams_vs_llama --llama-cpp DIR --out docs/benchmarks/peers_streams.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import torch

from bench.peers import CONVERT_RUN, CONVERT_SETUP
from bench.report import (
    add_common_flags,
    cut_prompts,
    interleaved,
    machine_line,
    positive_int,
    write_report,
)
from bench.serve_process import free_port
from cli.common import resolve_model_dir
from engine import CoreLimits, EngineConfig, EngineCore, SamplingParams, load_model, portable_path

# llama.cpp's converter, with an unknown BPE pre-tokenizer mapped to gpt-2 and GLM's vocabulary writer
# (which needs GLM's special tokens) replaced by the generic BPE one.
# The embedded model's vocabulary through the generic BPE writer: GLM's own needs a [gMASK] token it lacks.
CONVERT = (
    CONVERT_SETUP
    + """
from conversion import glm
glm.Glm4MoeModel.set_vocab = lambda self: self._set_vocab_gpt2()
"""
    + CONVERT_RUN
)


def convert(llama_cpp: Path, model_dir: Path, out: Path, script: str = CONVERT) -> Path:
    """The model as a bf16 GGUF at `out`, converted once (`script`: the converter's wrapper)."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"converting {portable_path(model_dir)} to {out.name} ...", flush=True)
        cmd = [
            sys.executable,
            "-c",
            script,
            str(llama_cpp / "convert_hf_to_gguf.py"),
            str(model_dir),
        ]
        res = subprocess.run(
            [*cmd, "--outtype", "bf16", "--outfile", str(out)],
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if res.returncode != 0:
            sys.exit(f"the GGUF conversion failed: {res.stderr.strip().splitlines()[-1]}")
    return out


@contextmanager
def llama_server(
    exe: Path,
    gguf: Path,
    slots: int,
    ctx: int,
    threads: int,
    log: Path,
    extra: tuple[str, ...] = (),
    preexec: Callable[[], None] | None = None,
) -> Iterator[tuple[str, int]]:
    """A ready llama-server with `slots` parallel slots of `ctx` tokens each (and `extra` flags);
    yields its base URL and pid. `preexec` runs in the child before the server starts (a memory
    cgroup's `enter`, bench/cgroup.py)."""
    port = free_port()
    cmd = [str(exe), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-np", str(slots)]
    cmd += ["-c", str(slots * ctx), "--host", "127.0.0.1", "--port", str(port), *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=preexec)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                sys.exit(f"llama-server exited with {proc.returncode}; its log: {log}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"llama-server not ready after 120 s; its log: {log}")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def llama_cell(url: str, pid: int, prompts: list[list[int]], tokens: int) -> dict:
    """The prompts as concurrent /completion requests: first with one token each (the prefill's CPU time), then
    in full; the difference is the decode's CPU time, as the engine's clock starts after the first tokens."""

    def batch(n_predict: int) -> tuple[list[dict], float]:
        body = dict(
            n_predict=n_predict,
            temperature=0.0,
            ignore_eos=True,
            cache_prompt=False,
            return_tokens=True,
        )

        def one(p: list[int]) -> dict:
            return httpx.post(url + "/completion", json={"prompt": p, **body}, timeout=600).json()

        c0 = _cpu_seconds(pid)
        with ThreadPoolExecutor(len(prompts)) as pool:
            res = list(pool.map(one, prompts))
        return res, _cpu_seconds(pid) - c0

    _, prefill_cpu = batch(1)
    res, cpu = batch(tokens)
    produced = sum(r["timings"]["predicted_n"] for r in res)
    decode_s = max(r["timings"]["predicted_ms"] for r in res) / 1e3
    return {
        "tok_s": produced / decode_s,
        "tok_s_cpu": (produced - len(prompts)) / max(cpu - prefill_cpu, 1e-3),
        "tokens": [r["tokens"] for r in res],
    }


def engine_cell(om, prompts: list[list[int]], tokens: int) -> dict:
    core = EngineCore.for_model(
        om, CoreLimits(max_running=len(prompts), prefill_token_budget=4096, max_model_len=4096)
    )
    reqs = [
        core.local_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True)) for p in prompts
    ]
    for r in reqs:
        core.add(r)
    out: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    while sum(1 for v in out.values() if v) < len(reqs):  # prefill before the clock
        for o in core.step():
            out[o.request_id] += o.token_ids
    first = sum(len(v) for v in out.values())
    w0, c0 = time.perf_counter(), time.process_time()
    while core.has_work():
        for o in core.step():
            out[o.request_id] += o.token_ids
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    produced = sum(len(v) for v in out.values()) - first
    return {
        "tok_s": produced / wall,
        "tok_s_cpu": produced / cpu,
        "tokens": [out[r.request_id] for r in reqs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="model directory (default: the embedded model)")
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        required=True,
        help="a llama.cpp source tree with build/bin/llama-server and convert_hf_to_gguf.py",
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=Path(".cache/streams"),
        help="where the GGUF goes (default .cache/streams)",
    )
    ap.add_argument(
        "--data",
        default="models/embedded/data/test.txt",
        help="text the prompts are cut from (default: the test split)",
    )
    ap.add_argument(
        "--prompt-tokens", type=positive_int, default=32, help="tokens per prompt (default 32)"
    )
    ap.add_argument(
        "--tokens", type=positive_int, default=64, help="tokens generated per request (default 64)"
    )
    ap.add_argument(
        "--streams", type=positive_int, default=8, help="concurrent streams beside one (default 8)"
    )
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="measured rounds after one warm-up round (default 3)",
    )
    add_common_flags(ap)
    args = ap.parse_args()
    exe = args.llama_cpp / "build/bin/llama-server"
    if not exe.exists() or not (args.llama_cpp / "convert_hf_to_gguf.py").exists():
        sys.exit(
            f"--llama-cpp {args.llama_cpp}: needs build/bin/llama-server and convert_hf_to_gguf.py there"
        )
    torch.set_num_threads(args.threads)
    model_dir = Path(resolve_model_dir(args.model))
    gguf = convert(args.llama_cpp, model_dir, args.work / f"{model_dir.name}-bf16.gguf")
    om = load_model(model_dir, EngineConfig(cache_fraction=1.0, offload="ram"))
    prompts = cut_prompts(om.tokenizer, args.data, args.streams, args.prompt_tokens)
    counts = (1, args.streams)
    ctx = args.prompt_tokens + args.tokens + 16
    with ExitStack() as stack:
        servers = {
            n: stack.enter_context(
                llama_server(exe, gguf, n, ctx, args.threads, args.work / f"llama-server-np{n}.log")
            )
            for n in counts
        }
        cells = [(system, n) for n in counts for system in ("engine", "llama-server")]

        def run(cell: tuple[str, int]) -> dict:
            system, n = cell
            if system == "engine":
                return engine_cell(om, prompts[:n], args.tokens)
            return llama_cell(*servers[n], prompts[:n], args.tokens)

        results = interleaved(cells, args.rounds, run)
    om.close()
    rows, lines = table(results, counts)
    header = (
        f"{machine_line(args.threads)} Load: {_load()}. Model: {portable_path(model_dir)} (bf16; llama-server: "
        f"its bf16 GGUF). Prompts: {args.prompt_tokens} tokens cut from {portable_path(args.data)}; {args.tokens} "
        f"greedy tokens per request; medians of {args.rounds} interleaved rounds after a warm-up round."
    )
    payload = {
        "rows": rows,
        "rounds": {
            f"{s}|{n}": [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
            for (s, n), rs in results.items()
        },
    }
    write_report(args.out, header, lines, payload)


def _load() -> str:
    return (
        "load average "
        + ", ".join(f"{x:.1f}" for x in os.getloadavg())
        + f" on {os.cpu_count()} logical CPUs"
    )


def table(results: dict, counts: tuple[int, int]) -> tuple[list[dict], list[str]]:
    def per_round(a: tuple[str, int], b: tuple[str, int], key: str) -> float:
        return statistics.median(x[key] / y[key] for x, y in zip(results[a], results[b]))

    def agree(n: int) -> float:
        same = total = 0
        for e, ll in zip(results[("engine", n)], results[("llama-server", n)]):
            for a, b in zip(e["tokens"], ll["tokens"]):
                same += sum(x == y for x, y in zip(a, b))
                total += min(len(a), len(b))
        return same / max(total, 1)

    lines = [
        "| streams | system | aggregate decode tok/s (wall) | × its 1 stream | × llama-server | "
        "tok/s per CPU second | × its 1 stream | × llama-server | greedy tokens equal to the engine's |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = []
    for n in counts:
        for system in ("engine", "llama-server"):
            c, one, peer = (system, n), (system, counts[0]), ("llama-server", n)
            row = {
                "streams": n,
                "system": system,
                **{k: statistics.median(r[k] for r in results[c]) for k in ("tok_s", "tok_s_cpu")},
                **{f"{k}_vs_1": per_round(c, one, k) for k in ("tok_s", "tok_s_cpu")},
                **{f"{k}_vs_llama": per_round(c, peer, k) for k in ("tok_s", "tok_s_cpu")},
            }
            if system == "llama-server":
                row["token_agreement"] = agree(n)
            rows.append(row)
            lines.append(
                f"| {n} | {system} | {row['tok_s']:.0f} | {row['tok_s_vs_1']:.2f}× | {row['tok_s_vs_llama']:.2f}× | "
                f"{row['tok_s_cpu']:.0f} | {row['tok_s_cpu_vs_1']:.2f}× | {row['tok_s_cpu_vs_llama']:.2f}× | "
                + (f"{row['token_agreement']:.0%} |" if "token_agreement" in row else "– |")
            )
    return rows, lines


if __name__ == "__main__":
    main()
