"""Hardware profiles and model shapes for the router-trace simulator.

A *profile* (configs/hardware/*.yaml) describes a box: the link that loads experts, the fast
device that runs the dense part and resident experts, and the CPU that can run missed experts
straight from host memory. Every number is written as `{value: X, source: "..."}`, and the
loader refuses a number without a source, so no figure enters a table unexplained.

A profile gives costs either *derived* from datasheet figures (memory bandwidth, FLOP/s, a
per-kernel overhead), which apply to any model shape, or *measured* for one shape (`measured:`
with the shape's name), as for this machine and the embedded model. `resolve_costs` turns a
profile and a shape into the seconds the simulator charges (`Costs`).

Derivation (decode is memory-bound for one row and becomes compute-bound with many):
  expert on a device:  t(rows) = overhead + expert_bytes / (mem_bw · mem_eff) + rows · 2·params / (flops · flop_eff)
  dense part per layer: t(rows) = dense_overhead + dense_bytes / (mem_bw · mem_eff) + rows · 2·dense_params / (flops · flop_eff)
with the LM head and embeddings spread over the layers (read once per step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).resolve().parents[2] / "configs" / "hardware"


class ProfileError(ValueError):
    """A profile that is missing a number, or a number without a source."""


@dataclass(frozen=True)
class ModelShape:
    """What the simulator needs of a model: routing shape and parameter counts (sources in SHAPES)."""

    name: str
    layers: int  # MoE layers
    experts: int  # routed experts per layer
    top_k: int
    hidden: int
    moe_intermediate: int
    shared_experts: int = 0
    dense_params_per_layer: float = 0.0  # attention + router + norms + shared experts, per layer
    head_params: float = 0.0  # LM head (read once per decode step; tied embeddings count once)
    source: str = ""

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # SwiGLU: gate, up, down


def _qwen3_30b_dense() -> float:
    # Qwen3-30B-A3B config.json: 32 query heads, 4 KV heads, head_dim 128, hidden 2048, 128 experts.
    q, kv, o = 2048 * 32 * 128, 2 * 2048 * 4 * 128, 32 * 128 * 2048
    return q + kv + o + 2048 * 128  # + router


SHAPES: dict[str, ModelShape] = {
    "embedded": ModelShape(
        "embedded",
        layers=4,
        experts=128,
        top_k=8,
        hidden=256,
        moe_intermediate=32,
        shared_experts=1,
        # attention q, k, v, o + router + the shared expert (n_shared_experts 8 x moe_intermediate 32 = 256 wide)
        dense_params_per_layer=256 * 256 + 2 * 256 * 128 + 256 * 256 + 256 * 128 + 3 * 256 * 256,
        head_params=8192 * 256,
        source="models/embedded/target/config.json (glm4_moe, 4 heads x 64, 2 KV heads, shared expert 256 wide, "
        "tied embeddings)",
    ),
    "qwen3-30b-a3b": ModelShape(
        "qwen3-30b-a3b",
        layers=48,
        experts=128,
        top_k=8,
        hidden=2048,
        moe_intermediate=768,
        dense_params_per_layer=_qwen3_30b_dense(),
        head_params=151_936 * 2048,
        source="Qwen/Qwen3-30B-A3B config.json on Hugging Face (48 layers, 128 experts, top-8, hidden 2048, "
        "moe_intermediate_size 768, 32/4 heads x 128, vocab 151936); 3.3B activated per the model card",
    ),
    "qwen3-next-80b-a3b": ModelShape(
        "qwen3-next-80b-a3b",
        layers=48,
        experts=512,
        top_k=10,
        hidden=2048,
        moe_intermediate=512,
        shared_experts=1,
        # Attention per layer derived from the model card's 3B activated parameters: 3.0B - routed
        # (48 x 10 x 3.15M = 1.51B) - shared (48 x 3.15M = 0.15B) - embeddings + head (2 x 0.31B)
        # = 0.72B over 48 layers (3 of 4 are Gated DeltaNet, 1 of 4 gated attention), plus the shared expert.
        dense_params_per_layer=0.72e9 / 48 + 3 * 2048 * 512 + 2048 * 512,
        head_params=151_936 * 2048,
        source="Qwen/Qwen3-Next-80B-A3B-Instruct config.json on Hugging Face (48 layers, 512 experts, top-10, "
        "hidden 2048, moe_intermediate_size 512, shared_expert_intermediate_size 512); 3B activated per the model card",
    ),
}


@dataclass(frozen=True)
class Costs:
    """Seconds the simulator charges, for one profile and one model shape."""

    profile: str
    shape: str
    expert_bytes: int
    link_mb_per_s: float
    link_latency_s: float
    transfer_workers: int
    fast: tuple[float, float]  # g(rows) = g0 + g1·rows, one expert on the fast device
    cpu: tuple[
        float, float
    ]  # h(rows) = h0 + h1·rows, one expert on a CPU worker (compute; + read, see below)
    cpu_workers: int
    dense: tuple[
        float, float
    ]  # d = d0 + d1·requests + extra·(rows - requests): the dense part of one layer and step
    cpu_reads_over_link: bool = (
        False  # CPU workers read the expert through the link (a disk box), else h includes the read
    )
    per_load_s: float = (
        0.0  # compute-thread time per demand load beyond the expert's compute (measured here only)
    )
    draft_token_s: float = 0.0  # one proposed token of the draft model (speculative decoding)
    # Dense time per extra row of a request's verification window (its rows share the request's
    # attention call, sampling, scheduling); None: the same as a request's (d1), as for GEMMs on a GPU.
    dense_extra_row: float | None = None
    # Measured dense time per layer at given row counts ((rows, seconds), rows ascending): when set,
    # d() interpolates between the points (and extrapolates from the last two) instead of d0 + d1·rows.
    dense_points: tuple[tuple[float, float], ...] | None = None
    # The CPU workers compute on the fast device's own cores (a CPU-only box, a phone): a CPU-run
    # expert's compute then holds the compute thread up; only its read overlaps.
    cpu_is_fast_device: bool = False
    utility_step_s: float = (
        0.0  # the utility estimator's update + top-ups per step, on the compute thread (Python)
    )
    notes: tuple[str, ...] = field(default_factory=tuple)

    def copy_seconds(self) -> float:
        return self.expert_bytes / (self.link_mb_per_s * 1e6) + self.link_latency_s

    def g(self, rows: int) -> float:
        return self.fast[0] + self.fast[1] * rows

    def h(self, rows: int) -> float:
        return self.cpu[0] + self.cpu[1] * rows

    def d(self, rows: int, requests: int | None = None) -> float:
        """Dense time of one layer for a step of `rows` rows from `requests` requests (default: one row each)."""
        if self.dense_points:
            return _interp(self.dense_points, rows)
        if requests is None or self.dense_extra_row is None:
            return self.dense[0] + self.dense[1] * rows
        return self.dense[0] + self.dense[1] * requests + self.dense_extra_row * (rows - requests)


def _interp(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through `points`, extended linearly beyond both ends."""
    if len(points) == 1:
        return points[0][1]
    i = 1
    while i < len(points) - 1 and x > points[i][0]:
        i += 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _points(node: Any, where: str) -> tuple[tuple[float, float], ...]:
    """A measured table {value: [[rows, us], ...], source: "..."} as (rows, seconds) pairs."""
    if (
        not isinstance(node, dict)
        or not str(node.get("source", "")).strip()
        or not isinstance(node.get("value"), list)
    ):
        raise ProfileError(f'{where}: write a table as {{value: [[rows, us], ...], source: "..."}}')
    pts = tuple(sorted((float(r), float(us) * 1e-6) for r, us in node["value"]))
    if not pts:
        raise ProfileError(f"{where}: empty table")
    return pts


def _num(node: Any, where: str) -> float:
    """A profile number: {value, source}; the source must say where the number comes from."""
    if not isinstance(node, dict) or "value" not in node:
        raise ProfileError(f'{where}: write numbers as {{value: X, source: "..."}}')
    if not str(node.get("source", "")).strip():
        raise ProfileError(f"{where}: the number {node['value']} has no source")
    return float(node["value"])


def profile_path(name_or_path: str | Path) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.is_file():
        return p
    cand = PROFILE_DIR / f"{name_or_path}.yaml"
    if not cand.is_file():
        raise ProfileError(
            f"no hardware profile {name_or_path!r}; choose one of: {', '.join(list_profiles())} or give a .yaml path"
        )
    return cand


def list_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def load_profile(name_or_path: str | Path) -> dict[str, Any]:
    path = profile_path(name_or_path)
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict) or "link" not in data:
        raise ProfileError(f"{path}: not a hardware profile (no link section)")
    data.setdefault("name", path.stem)
    check_sources(data, path.stem)
    return data


def check_sources(node: Any, where: str) -> int:
    """Walk a profile: every number must sit in {value, source}. Returns how many numbers it has."""
    if isinstance(node, dict):
        if "value" in node:
            if isinstance(node["value"], list):
                return len(_points(node, where))
            _num(node, where)
            return 1
        return sum(check_sources(v, f"{where}.{k}") for k, v in node.items())
    if isinstance(node, list):
        return sum(check_sources(v, f"{where}[{i}]") for i, v in enumerate(node))
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        raise ProfileError(f'{where}: bare number {node}; write {{value: {node}, source: "..."}}')
    return 0


def _mem_bw(dev: dict, where: str) -> float:
    """The device's effective memory bandwidth in bytes/s: GB/s x the profile's efficiency."""
    return (
        _num(dev["mem_gb_s"], f"{where}.mem_gb_s")
        * 1e9
        * _num(dev["mem_efficiency"], f"{where}.mem_efficiency")
    )


def _flops(dev: dict, where: str) -> float:
    """The device's effective FLOP/s: TFLOP/s x the profile's efficiency."""
    return (
        _num(dev["tflops"], f"{where}.tflops")
        * 1e12
        * _num(dev["flop_efficiency"], f"{where}.flop_efficiency")
    )


def _device_expert(dev: dict, where: str, params: int, nbytes: float) -> tuple[float, float]:
    """(a, b) of one expert on `dev`: t(rows) = a + b·rows (reading `nbytes`, then `params` per row)."""
    bw = _mem_bw(dev, where)
    flops = _flops(dev, where)
    over = _num(dev["expert_overhead_us"], f"{where}.expert_overhead_us") * 1e-6
    return over + nbytes / bw, 2.0 * params / flops


def resolve_costs(
    profile: dict[str, Any], shape: ModelShape, expert_bytes: int | None = None
) -> Costs:
    """The profile's costs for `shape`: measured ones when the profile has them for this shape,
    else derived from its datasheet figures. `expert_bytes` overrides the per-expert size on
    the link (e.g. a trace's recorded quantized size)."""
    name = profile["name"]
    link = profile["link"]
    bpp = _num(
        profile.get("expert_bytes_per_param", {"value": 2, "source": "bf16"}),
        f"{name}.expert_bytes_per_param",
    )
    nbytes = int(expert_bytes or math.ceil(shape.expert_params * bpp))
    measured = (profile.get("measured") or {}).get(shape.name)
    if measured is not None:
        return _measured_costs(name, link, shape, nbytes, measured)
    if "fast" not in profile or "cpu" not in profile:
        raise ProfileError(
            f"{name}: no measured costs for shape {shape.name!r} and no fast/cpu datasheet figures to derive them"
        )
    return _derived_costs(profile, shape, nbytes, bpp)


def _costs_header(name: str, shape: ModelShape, nbytes: int, link: dict) -> dict[str, Any]:
    """The fields of Costs that measured and derived costs share: what they are for, the expert's
    bytes and the link (MB/s, per-transfer latency in seconds, transfer workers)."""
    return {
        "profile": name,
        "shape": shape.name,
        "expert_bytes": nbytes,
        "link_mb_per_s": _num(link["mb_per_s"], f"{name}.link.mb_per_s"),
        "link_latency_s": _num(link["latency_us"], f"{name}.link.latency_us") * 1e-6,
        "transfer_workers": int(_num(link["workers"], f"{name}.link.workers")),
    }


def _measured_costs(
    name: str, link: dict, shape: ModelShape, nbytes: int, measured: dict[str, Any]
) -> Costs:
    """The costs profile `name` measured for `shape` (its `measured:` entry for the shape)."""
    m = lambda key: _num(measured[key], f"{name}.measured.{shape.name}.{key}")  # noqa: E731
    header = _costs_header(name, shape, nbytes, link)
    return Costs(
        **header,
        fast=(m("expert_a_us") * 1e-6, m("expert_b_us") * 1e-6),
        cpu=(m("cpu_expert_a_us") * 1e-6, m("cpu_expert_b_us") * 1e-6),
        cpu_workers=int(m("cpu_workers")),
        dense=(m("dense_a_us") * 1e-6, m("dense_b_us") * 1e-6),
        cpu_reads_over_link=bool(measured.get("cpu_reads_over_link", False)),
        per_load_s=m("per_load_us") * 1e-6 if "per_load_us" in measured else 0.0,
        draft_token_s=m("draft_token_us") * 1e-6 if "draft_token_us" in measured else 0.0,
        dense_extra_row=m("dense_extra_row_us") * 1e-6
        if "dense_extra_row_us" in measured
        else None,
        dense_points=_points(
            measured["dense_us_by_rows"], f"{name}.measured.{shape.name}.dense_us_by_rows"
        )
        if "dense_us_by_rows" in measured
        else None,
        cpu_is_fast_device=bool(measured.get("cpu_is_fast_device", False)),
        utility_step_s=m("utility_step_us") * 1e-6 if "utility_step_us" in measured else 0.0,
        notes=("measured",),
    )


def _derived_costs(profile: dict[str, Any], shape: ModelShape, nbytes: int, bpp: float) -> Costs:
    """The costs derived for `shape` from the profile's fast/cpu datasheet figures (the module
    docstring gives the formulas); `bpp`: bytes per expert parameter on the link."""
    name = profile["name"]
    fast, cpu = profile["fast"], profile["cpu"]
    g = _device_expert(fast, f"{name}.fast", shape.expert_params, nbytes)
    # The CPU computes from host memory in the checkpoint's precision (bf16) unless it says otherwise.
    cpu_bpp = (
        _num(cpu["bytes_per_param"], f"{name}.cpu.bytes_per_param")
        if "bytes_per_param" in cpu
        else bpp
    )
    h = _device_expert(cpu, f"{name}.cpu", shape.expert_params, shape.expert_params * cpu_bpp)
    dense = _dense_costs(profile, shape)
    draft = profile.get("draft_token_us")
    header = _costs_header(name, shape, nbytes, profile["link"])
    return Costs(
        **header,
        fast=g,
        cpu=h,
        cpu_workers=int(_num(cpu["workers"], f"{name}.cpu.workers")),
        dense=dense,
        cpu_reads_over_link=bool(cpu.get("reads_over_link", False)),
        cpu_is_fast_device=bool(cpu.get("is_fast_device", False)),
        draft_token_s=_num(draft, f"{name}.draft_token_us") * 1e-6 if draft else 0.0,
        notes=("derived",),
    )


def _dense_costs(profile: dict[str, Any], shape: ModelShape) -> tuple[float, float]:
    """(d0, d1) of the dense part of one layer on the fast device, the LM head spread over the layers:
    d0 reads the weights once per step, d1 computes one row."""
    name, fast = profile["name"], profile["fast"]
    bw = _mem_bw(fast, f"{name}.fast")
    flops = _flops(fast, f"{name}.fast")
    dense_bpp = _num(
        profile.get("dense_bytes_per_param", {"value": 2, "source": "bf16"}),
        f"{name}.dense_bytes_per_param",
    )
    params = shape.dense_params_per_layer + shape.head_params / shape.layers
    d0 = (
        _num(fast["dense_overhead_us"], f"{name}.fast.dense_overhead_us") * 1e-6
        + params * dense_bpp / bw
    )
    d1 = 2.0 * params / flops
    return d0, d1


def costs_for(
    profile: str | Path, shape: str | ModelShape, expert_bytes: int | None = None
) -> Costs:
    s = SHAPES[shape] if isinstance(shape, str) else shape
    return resolve_costs(load_profile(profile), s, expert_bytes)


def with_link(costs: Costs, mb_per_s: float, latency_us: float) -> Costs:
    return replace(costs, link_mb_per_s=mb_per_s, link_latency_s=latency_us * 1e-6)
