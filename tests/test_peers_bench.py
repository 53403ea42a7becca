"""bench/peers.py: how it finds llama.cpp, and what its report says (no model is run here)."""

from __future__ import annotations

from pathlib import Path

from bench.peers import find_llama_cpp, table


def test_an_explicit_tree_without_llama_bench_is_refused_with_a_reason(tmp_path: Path) -> None:
    src, why = find_llama_cpp(tmp_path, tmp_path / "nowhere")
    assert src is None and "--llama-cpp" in why and "llama-bench" in why


def test_an_explicit_built_tree_is_used(tmp_path: Path) -> None:
    tree = tmp_path / "llama.cpp"
    (tree / "build/bin").mkdir(parents=True)
    (tree / "build/bin/llama-bench").write_text("")
    assert find_llama_cpp(tmp_path, tree) == (tree, "")


def test_ratios_are_per_round_and_erratic_thread_scaling_is_flagged() -> None:
    cells = [
        "transformers f32",
        "engine cache 1.0 f32",
        "engine cache 1.0 bf16",
        "engine cache 1.0 int8",
        "engine cache 0.25 disk f32",
        "llama.cpp f32",
        "llama.cpp bf16",
        "llama.cpp q8_0",
    ]
    res = {(c, t): [10.0 * t, 20.0 * t] for c in cells for t in (1, 2)}
    res[("llama.cpp f32", 1)] = [
        20.0,
        20.0,
    ]  # engine f32 / llama f32 per round: 0.5 and 1.0 -> median 0.75
    res[("engine cache 1.0 int8", 2)] = [5.0, 5.0]  # slower at 2 threads than at 1
    lines = "\n".join(table(res, cells, [1, 2]))
    assert "| engine cache 1.0 f32 / llama.cpp f32 | 0.75× | 1.00× |" in lines
    assert "**Warning:**" in lines and "engine cache 1.0 int8" in lines.split("**Warning:**")[1]
    assert "transformers f32" not in lines.split("**Warning:**")[1]


def test_a_child_over_its_memory_limit_is_killed_and_reported_as_such() -> None:
    """bench/cgroup.py caps a child's memory; peers_memory reports the kill, not a crash."""
    import subprocess
    import sys

    import pytest

    from bench.cgroup import MemoryCgroup
    from bench.peers_memory import _tps

    why = MemoryCgroup.unavailable()
    if why:
        pytest.skip(
            why
        )  # environment: no writable memory cgroup (the benchmark refuses with the same line)
    cg = MemoryCgroup(128 * 2**20, name="moe-offload-test-limit")
    try:
        touch = "x = bytearray({} * 2**20); x[::4096] = b'1' * len(x[::4096]); print('{{\"tok_s\": 1.5}}')"
        big = cg.run([sys.executable, "-c", touch.format(400)])
        small = cg.run([sys.executable, "-c", touch.format(16)])
    finally:
        cg.close()
    assert _tps(big, llama=False) == (None, "killed: out of memory in the limit")
    assert _tps(small, llama=False) == (1.5, "")
    failed = subprocess.CompletedProcess([], 2, stdout="", stderr="error: model not found\n")
    assert _tps(failed, llama=True) == (None, "failed (exit 2): error: model not found")


def test_revision_ab_refuses_an_unknown_revision_in_one_line() -> None:
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-m", "bench.revision_ab", "--base", "no-such-revision"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=300,
    )
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines() == [
        "revision_ab: 'no-such-revision' is not a commit of this repository; "
        "pass --base with a commit, tag or branch"
    ]
