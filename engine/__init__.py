"""The engine's public surface: what server/, cli/ and bench/ import (`from engine import load_model`).

`__all__` is every public name: the keys of `_SOURCES`, which names the module that defines each.
A name is imported from its module on first use (PEP 562 `__getattr__`), so `import engine` imports
no submodule: the HTTP front end and `moe-offload --help` pay only for the names they use, as when
they imported the submodules. Under TYPE_CHECKING the names are imported for real, so mypy types
them and import-linter sees `engine` depend on each submodule; `.importlinter` keeps server/, cli/
and bench/ to this package and off the submodules. Inside the engine, modules import each other's
submodules, never `engine` itself (that would route them through every layer). One name a line.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.budget import fmt_bytes as fmt_bytes
    from engine.config import EngineConfig as EngineConfig
    from engine.core.completion import complete as complete
    from engine.core.completion import generate as generate
    from engine.core.engine_core import EngineCore as EngineCore
    from engine.core.faults import fault_class as fault_class
    from engine.core.faults import new_error_id as new_error_id
    from engine.core.faults import redact as redact
    from engine.core.kv_blocks import BLOCK_TOKENS as BLOCK_TOKENS
    from engine.core.kv_blocks import pool_blocks as pool_blocks
    from engine.core.limits import CoreLimits as CoreLimits
    from engine.core.messages import AbortRequest as AbortRequest
    from engine.core.messages import EngineDead as EngineDead
    from engine.core.messages import EngineOutput as EngineOutput
    from engine.core.messages import EngineReady as EngineReady
    from engine.core.messages import GenerateRequest as GenerateRequest
    from engine.core.messages import RequestOutput as RequestOutput
    from engine.core.messages import Shutdown as Shutdown
    from engine.core.messages import StatsUpdate as StatsUpdate
    from engine.core.messages import TokenLogprob as TokenLogprob
    from engine.core.sampling_params import SamplingParams as SamplingParams
    from engine.errors import CheckpointError as CheckpointError
    from engine.errors import ConfigError as ConfigError
    from engine.errors import MoeOffloadError as MoeOffloadError
    from engine.experts.compute.device_lane import DeviceLane as DeviceLane
    from engine.experts.compute.moe_block import OffloadedMoeBlock as OffloadedMoeBlock
    from engine.experts.compute.native_mxfp4 import NativeMxfp4Moe as NativeMxfp4Moe
    from engine.experts.formats.expert_kernels import GptOssKernel as GptOssKernel
    from engine.experts.formats.native_quant import Mxfp4GptOssFormat as Mxfp4GptOssFormat
    from engine.experts.formats.quant import quantize_int4 as quantize_int4
    from engine.experts.route_log import read_route_log as read_route_log
    from engine.experts.routing_bus import RoutingEvent as RoutingEvent
    from engine.experts.tiers.uncached_io import UncachedReader as UncachedReader
    from engine.huge_pages import huge_empty as huge_empty
    from engine.launch import EngineArgs as EngineArgs
    from engine.launch import engine_main as engine_main
    from engine.launch import max_model_len_of as max_model_len_of
    from engine.link_spec import NAMED_LINKS as NAMED_LINKS
    from engine.link_spec import parse_link as parse_link
    from engine.memory.footprint import Footprint as Footprint
    from engine.memory.machine import HostMemory as HostMemory
    from engine.memory.planner import KvRequest as KvRequest
    from engine.memory.planner import MemoryPlan as MemoryPlan
    from engine.memory.planner import kv_token_budget as kv_token_budget
    from engine.memory.planner import plan_memory as plan_memory
    from engine.memory.split import fixed_why as fixed_why
    from engine.memory.split import split_line as split_line
    from engine.native.kernels import NativeKernels as NativeKernels
    from engine.native.loaded import active as active
    from engine.native.loaded import load_build as load_build
    from engine.native.loaded import load_builds as load_builds
    from engine.native.loaded import native as native_kernels  # noqa: F401  (in __all__)
    from engine.native.variants import cpu_flags as cpu_flags
    from engine.native.variants import cpu_model as cpu_model
    from engine.native.variants import runnable as runnable
    from engine.offline.belady import flatten as flatten
    from engine.offline.belady import lru_loads as lru_loads
    from engine.offline.belady import min_load_positions as min_load_positions
    from engine.offline.belady import min_loads as min_loads
    from engine.offline.evaluation import score_window as score_window
    from engine.offline.evaluation import teacher_forced_eval as teacher_forced_eval
    from engine.offline.evaluation import windows as windows
    from engine.offline.hardware import SHAPES as SHAPES
    from engine.offline.hardware import Costs as Costs
    from engine.offline.hardware import ModelShape as ModelShape
    from engine.offline.hardware import ProfileError as ProfileError
    from engine.offline.hardware import costs_for as costs_for
    from engine.offline.hardware import list_profiles as list_profiles
    from engine.offline.hardware import with_link as with_link
    from engine.offline.machine_costs import core_share as core_share
    from engine.offline.machine_costs import kernel_speeds as kernel_speeds
    from engine.offline.machine_costs import machine_costs as machine_costs
    from engine.offline.machine_costs import read_gb_s as read_gb_s
    from engine.offline.projection import project_trace as project_trace
    from engine.offline.sim_settings import Acceptance as Acceptance
    from engine.offline.sim_settings import OraclePredictor as OraclePredictor
    from engine.offline.sim_settings import SimSettings as SimSettings
    from engine.offline.sim_settings import TablePredictor as TablePredictor
    from engine.offline.sim_settings import load_trace as load_trace
    from engine.offline.sim_settings import manual_costs as manual_costs
    from engine.offline.sim_settings import trace_from_arrays as trace_from_arrays
    from engine.offline.simulator import Simulator as Simulator
    from engine.offline.simulator import simulate as simulate
    from engine.offline.trace import record_trace as record_trace
    from engine.offline.trace import save_trace as save_trace
    from engine.paths import portable_path as portable_path
    from engine.plan.load_plan import LoadPlan as LoadPlan
    from engine.plan.probe import Probe as Probe
    from engine.plan.probe import probe_checkpoint as probe_checkpoint
    from engine.plan.probe import probe_of as probe_of
    from engine.plan.resolve import decide as decide
    from engine.plan.resolve import machine_ahead as machine_ahead
    from engine.plan.resolve import resolve as resolve
    from engine.plan.survey import survey as survey
    from engine.prefetch.adapter import FILE_NAME as FILE_NAME
    from engine.prefetch.adapter import load_adapter as load_adapter
    from engine.prefetch.adapter import save_adapter as save_adapter
    from engine.prefetch.predictors import PerLayerPredictor as PerLayerPredictor
    from engine.prefetch.predictors import draft_hidden_states as draft_hidden_states
    from engine.prefetch.predictors import fate_predictor as fate_predictor
    from engine.prefetch.training import AdapterData as AdapterData
    from engine.prefetch.training import data_from_trace as data_from_trace
    from engine.prefetch.training import evaluate as evaluate
    from engine.prefetch.training import evaluate_base as evaluate_base
    from engine.prefetch.training import fit_predictor as fit_predictor
    from engine.prefetch.training import model_fingerprint as model_fingerprint
    from engine.prefetch.training import predict as predict
    from engine.prefetch.training import recall_at_k as recall_at_k
    from engine.prefetch.training import train_adapter as train_adapter
    from engine.settings_file import YamlSection as YamlSection
    from engine.settings_file import add_flags as add_flags
    from engine.settings_file import overrides_from_args as overrides_from_args
    from engine.settings_file import setting as setting
    from engine.speculative.config import SpecConfig as SpecConfig
    from engine.speculative.draft import DraftProposer as DraftProposer
    from engine.speculative.draft_prefetch import draft_predictor as draft_predictor
    from engine.speculative.factory import check_draft as check_draft
    from engine.speculative.factory import make_speculation as make_speculation
    from engine.structured.constraint import check_spec as check_spec
    from engine.structured.spec import ConstraintSpec as ConstraintSpec
    from engine.weights.model_config import read_config as read_config
    from engine.worker.fused_decode import FusedDecode as FusedDecode
    from engine.worker.host_reads import HostReads as HostReads
    from engine.worker.loaded_model import OffloadedModel as OffloadedModel
    from engine.worker.loader import check_model_dir as check_model_dir
    from engine.worker.loader import load_model as load_model
    from engine.worker.parity import prompt_logits as prompt_logits
    from engine.worker.runner import ModelRunner as ModelRunner

# Public name -> the module that defines it ("module:attribute" where the public name differs:
# `native` would shadow the engine.native package).
_SOURCES = MappingProxyType(
    {
        "fmt_bytes": "engine.budget",
        "EngineConfig": "engine.config",
        "complete": "engine.core.completion",
        "generate": "engine.core.completion",
        "EngineCore": "engine.core.engine_core",
        "fault_class": "engine.core.faults",
        "new_error_id": "engine.core.faults",
        "redact": "engine.core.faults",
        "BLOCK_TOKENS": "engine.core.kv_blocks",
        "pool_blocks": "engine.core.kv_blocks",
        "CoreLimits": "engine.core.limits",
        "AbortRequest": "engine.core.messages",
        "EngineDead": "engine.core.messages",
        "EngineOutput": "engine.core.messages",
        "EngineReady": "engine.core.messages",
        "GenerateRequest": "engine.core.messages",
        "RequestOutput": "engine.core.messages",
        "Shutdown": "engine.core.messages",
        "StatsUpdate": "engine.core.messages",
        "TokenLogprob": "engine.core.messages",
        "SamplingParams": "engine.core.sampling_params",
        "CheckpointError": "engine.errors",
        "ConfigError": "engine.errors",
        "MoeOffloadError": "engine.errors",
        "DeviceLane": "engine.experts.compute.device_lane",
        "GptOssKernel": "engine.experts.formats.expert_kernels",
        "OffloadedMoeBlock": "engine.experts.compute.moe_block",
        "NativeMxfp4Moe": "engine.experts.compute.native_mxfp4",
        "Mxfp4GptOssFormat": "engine.experts.formats.native_quant",
        "quantize_int4": "engine.experts.formats.quant",
        "read_route_log": "engine.experts.route_log",
        "RoutingEvent": "engine.experts.routing_bus",
        "UncachedReader": "engine.experts.tiers.uncached_io",
        "huge_empty": "engine.huge_pages",
        "EngineArgs": "engine.launch",
        "engine_main": "engine.launch",
        "max_model_len_of": "engine.launch",
        "NAMED_LINKS": "engine.link_spec",
        "parse_link": "engine.link_spec",
        "Footprint": "engine.memory.footprint",
        "HostMemory": "engine.memory.machine",
        "KvRequest": "engine.memory.planner",
        "MemoryPlan": "engine.memory.planner",
        "kv_token_budget": "engine.memory.planner",
        "plan_memory": "engine.memory.planner",
        "fixed_why": "engine.memory.split",
        "split_line": "engine.memory.split",
        "LoadPlan": "engine.plan.load_plan",
        "Probe": "engine.plan.probe",
        "probe_checkpoint": "engine.plan.probe",
        "probe_of": "engine.plan.probe",
        "decide": "engine.plan.resolve",
        "machine_ahead": "engine.plan.resolve",
        "resolve": "engine.plan.resolve",
        "survey": "engine.plan.survey",
        "NativeKernels": "engine.native.kernels",
        "active": "engine.native.loaded",
        "load_build": "engine.native.loaded",
        "load_builds": "engine.native.loaded",
        "native_kernels": "engine.native.loaded:native",
        "cpu_flags": "engine.native.variants",
        "cpu_model": "engine.native.variants",
        "runnable": "engine.native.variants",
        "flatten": "engine.offline.belady",
        "lru_loads": "engine.offline.belady",
        "min_load_positions": "engine.offline.belady",
        "min_loads": "engine.offline.belady",
        "score_window": "engine.offline.evaluation",
        "teacher_forced_eval": "engine.offline.evaluation",
        "windows": "engine.offline.evaluation",
        "SHAPES": "engine.offline.hardware",
        "Costs": "engine.offline.hardware",
        "ModelShape": "engine.offline.hardware",
        "ProfileError": "engine.offline.hardware",
        "costs_for": "engine.offline.hardware",
        "list_profiles": "engine.offline.hardware",
        "with_link": "engine.offline.hardware",
        "core_share": "engine.offline.machine_costs",
        "kernel_speeds": "engine.offline.machine_costs",
        "machine_costs": "engine.offline.machine_costs",
        "read_gb_s": "engine.offline.machine_costs",
        "project_trace": "engine.offline.projection",
        "Acceptance": "engine.offline.sim_settings",
        "OraclePredictor": "engine.offline.sim_settings",
        "SimSettings": "engine.offline.sim_settings",
        "TablePredictor": "engine.offline.sim_settings",
        "load_trace": "engine.offline.sim_settings",
        "manual_costs": "engine.offline.sim_settings",
        "trace_from_arrays": "engine.offline.sim_settings",
        "Simulator": "engine.offline.simulator",
        "simulate": "engine.offline.simulator",
        "record_trace": "engine.offline.trace",
        "save_trace": "engine.offline.trace",
        "portable_path": "engine.paths",
        "FILE_NAME": "engine.prefetch.adapter",
        "load_adapter": "engine.prefetch.adapter",
        "save_adapter": "engine.prefetch.adapter",
        "PerLayerPredictor": "engine.prefetch.predictors",
        "draft_hidden_states": "engine.prefetch.predictors",
        "fate_predictor": "engine.prefetch.predictors",
        "AdapterData": "engine.prefetch.training",
        "data_from_trace": "engine.prefetch.training",
        "evaluate": "engine.prefetch.training",
        "evaluate_base": "engine.prefetch.training",
        "fit_predictor": "engine.prefetch.training",
        "model_fingerprint": "engine.prefetch.training",
        "predict": "engine.prefetch.training",
        "recall_at_k": "engine.prefetch.training",
        "train_adapter": "engine.prefetch.training",
        "YamlSection": "engine.settings_file",
        "add_flags": "engine.settings_file",
        "overrides_from_args": "engine.settings_file",
        "setting": "engine.settings_file",
        "SpecConfig": "engine.speculative.config",
        "DraftProposer": "engine.speculative.draft",
        "draft_predictor": "engine.speculative.draft_prefetch",
        "check_draft": "engine.speculative.factory",
        "make_speculation": "engine.speculative.factory",
        "check_spec": "engine.structured.constraint",
        "ConstraintSpec": "engine.structured.spec",
        "read_config": "engine.weights.model_config",
        "FusedDecode": "engine.worker.fused_decode",
        "HostReads": "engine.worker.host_reads",
        "OffloadedModel": "engine.worker.loaded_model",
        "check_model_dir": "engine.worker.loader",
        "load_model": "engine.worker.loader",
        "ModelRunner": "engine.worker.runner",
        "prompt_logits": "engine.worker.parity",
    }
)

__all__ = tuple(_SOURCES)

if not TYPE_CHECKING:  # mypy reads the imports above; a misspelt name stays an error there

    def __getattr__(name: str) -> object:
        source = _SOURCES.get(name)
        if source is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        module, _, attribute = source.partition(":")
        return getattr(importlib.import_module(module), attribute or name)

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))
