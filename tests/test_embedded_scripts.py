"""The embedded model's scripts read in one sitting (issue 52): train.py and evaluate.py are entry
points over stage modules (models/embedded/training/, evaluation/), every file <= 400 lines, every
function <= 80, no sys.path patching; and the split parser still reads every recorded command line."""

from __future__ import annotations

import ast
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EMBEDDED = REPO / "models" / "embedded"


def sources() -> list[Path]:
    return sorted(EMBEDDED.rglob("*.py"))


def test_every_script_file_is_at_most_400_lines() -> None:
    assert len(sources()) >= 10  # train.py, evaluate.py and their stage modules
    long = {
        p.relative_to(REPO).as_posix(): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_every_function_is_at_most_80_lines() -> None:
    long = {
        f"{p.relative_to(REPO).as_posix()}:{node.name}": node.end_lineno - node.lineno + 1
        for p in sources()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    }
    assert long == {}


def test_no_script_patches_sys_path() -> None:
    assert [p.name for p in sources() if "sys.path" in p.read_text()] == []


def test_the_train_parser_reads_every_recorded_command_line() -> None:
    from models.embedded.training.args import build_parser

    log = json.loads((EMBEDDED / "train_log.json").read_text())
    argvs = [*log["target"]["phases"], log["target"]["argv"], log["draft"]["argv"]]
    assert len(argvs) >= 3
    for argv in argvs:
        args = build_parser(None).parse_args(argv)
        assert args.stage in ("target", "draft"), argv
    first = build_parser(None).parse_args(log["target"]["phases"][0])
    assert (first.arch, first.target_steps, first.sticky_cap) == ("glm4_moe", 1000, 3.0)


def test_the_long_pairs_recorded_command_line_reads() -> None:
    from models.embedded.training.args import build_parser

    log = json.loads((EMBEDDED / "long" / "train_log.json").read_text())
    args = build_parser(None).parse_args(log["args"]["argv"])
    assert (args.stage, args.context, args.seq_len) == ("long", 4096, 4096)
    assert log["long_target"]["steps_done"] == args.long_target_steps
    assert log["long_draft"]["steps_done"] == args.long_draft_steps


def test_no_training_log_holds_a_path_of_this_machine() -> None:
    for log in (EMBEDDED / "train_log.json", EMBEDDED / "long" / "train_log.json"):
        assert str(REPO) not in log.read_text(), log
    from models.embedded.training.args import build_parser, recorded_args

    assert "log_json" not in recorded_args(build_parser(None).parse_args([]))
