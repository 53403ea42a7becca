"""The model a load builds (transformers' on the meta device, then filled: engine/worker/loader.py), and
the check that it is the model its plan was sized for.

A load plan is decided from the checkpoint's headers alone (engine/weights/header_survey.py); the
loader builds the real model from config.json and reads the same facts off it: its sparse MoE blocks
found by structure (engine/weights/moe_hook.py), their experts' geometry, its parameters outside the
routed experts, its dense linears, input embedding and layer structure. Where any differs from the
headers' survey the load fails in one line naming it: the memory plan would be sized for another model."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine.errors import CheckpointError
from engine.experts.formats.checkpoint_experts import CheckpointExperts
from engine.experts.formats.expert_source import experts_of_sites
from engine.native.dense_names import DenseLinear
from engine.native.quant_linear import dense_linears, shared_weights
from engine.plan.survey import Survey
from engine.weights.arch import disk_names, unsupported
from engine.weights.checkpoint import torch_dtype
from engine.weights.disk_embedding import input_embedding_name
from engine.weights.forward_support import lean_structure
from engine.weights.header_survey import HeaderSurvey, memory_name
from engine.weights.moe_hook import MoeSite, find_moe_sites


@dataclass(frozen=True)
class Built:
    """The model on the meta device (its sparse blocks still transformers'), those blocks (`sites`), and
    their experts with the kernel of the built modules."""

    model: PreTrainedModel
    sites: list[MoeSite]
    experts: CheckpointExperts


def build_meta(sv: Survey) -> Built:
    """The surveyed checkpoint's model built on the meta device (nothing allocated), checked against the
    survey (`check_built`)."""
    ck = sv.ck
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(ck.config, dtype=torch_dtype(ck.dtype))
    sites = find_moe_sites(model)
    if not sites:
        if ck.spec.by_structure:
            raise unsupported(ck.spec.model_type, str(ck.model_dir / "config.json"))
        raise CheckpointError(
            f"{ck.model_dir / 'config.json'}: no sparse MoE layers in this configuration"
        )
    experts = experts_of_sites(ck.spec, ck.config, ck.tensors, sites, ck.dtype, ck.device)
    built = Built(model, sites, experts)
    check_built(sv, built)
    return built


def model_layout(built: Built) -> HeaderSurvey:
    """What the headers' survey says of the checkpoint, read off the built model instead."""
    model, ex = built.model, built.experts
    routed = {id(p) for s in built.sites for p in s.block.get_submodule("experts").parameters()}
    params = {id(p): p for p in model.parameters()}.values()
    shared = shared_weights(model)
    names = {id(m): n for n, m in model.named_modules()}
    linears = {id(c): c for _, _, c in dense_linears(model)}.values()
    return HeaderSurvey(
        moe_layers=tuple(s.layer for s in built.sites),
        num_experts=ex.num_experts,
        top_k=ex.top_k,
        hidden=ex.shape.hidden,
        intermediate=ex.shape.intermediate,
        dense_params=sum(p.numel() for p in params if id(p) not in routed),
        dense_linears=tuple(
            DenseLinear(
                _as_on_disk(built, f"{names[id(c)]}.weight"),
                c.weight.numel(),
                c.weight.shape[0],
                id(c.weight) in shared,
            )
            for c in linears
        ),
        embedding=input_embedding_name(model),
        lean=lean_structure(model),
    )


def _as_on_disk(built: Built, name: str) -> str:
    """A parameter's name as the headers' survey names it (header_survey.memory_name of the checkpoint
    tensor it is filled from; its own name where none is, as a tied lm_head's)."""
    ex = built.experts
    disk = next((n for n in disk_names(ex.spec, name) if n in ex.tensors), None)
    return name if disk is None else memory_name(ex.spec, disk)


def check_built(sv: Survey, built: Built) -> None:
    """Fail, in one line, where the built model is not the one the survey described."""
    # Dense linears compare in name order: the model lists them in module order, the headers in file order.
    got, want = (
        replace(s, dense_linears=tuple(sorted(s.dense_linears, key=lambda d: d.name)))
        for s in (model_layout(built), sv.layout)
    )
    differ = [
        _difference(f.name, getattr(got, f.name), getattr(want, f.name))
        for f in fields(HeaderSurvey)
        if getattr(got, f.name) != getattr(want, f.name)
    ]
    if differ:
        raise CheckpointError(
            f"{sv.ck.model_dir}: the model transformers builds is not the one its safetensors headers "
            f"describe, so the load plan was sized for another: {'; '.join(differ)}"
        )


def _difference(what: str, got: object, want: object) -> str:
    if isinstance(got, tuple) and isinstance(want, tuple) and what == "dense_linears":
        only = sorted({d.name for d in got} ^ {d.name for d in want})
        return f"dense linears differ ({', '.join(only[:3]) or 'in size'})"
    return f"{what} {got!r} (headers: {want!r})"
