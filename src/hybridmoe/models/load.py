"""Loading a model: file, tokenizer, placement plan, context that fits, weights, page-cache residency.

`load_model(path, settings)` is the one way in for `LLM`, `serve` and the benchmarks: the plan is
made (and checked against VRAM and RAM) before any weight is read, and a CPU-only KV cache gets a
context that fits in RAM.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from hybridmoe import kernels
from hybridmoe.gguf import residency
from hybridmoe.gguf.errors import GGUFError
from hybridmoe.gguf.reader import ModelFile, open_model
from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.models.gpt_oss import GptOss
from hybridmoe.models.model_info import ModelInfo, describe_model
from hybridmoe.placement.fit import check_fits, make_plan, resolve_vram_budget
from hybridmoe.placement.memory import fit_context
from hybridmoe.placement.plan import Plan, PlacementOptions
from hybridmoe.placement.report import format_plan
from hybridmoe.settings import ComputeSettings, ContextSettings, ParallelSettings, PlacementSettings
from hybridmoe.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("hybridmoe")


@dataclass(frozen=True)
class ModelSettings:
    """What loading needs: the flag groups, the sequences memory is planned for (-np), and what
    happens to the mapping (prefault: read it in on a background thread; mlock: pin it)."""

    compute: ComputeSettings = field(default_factory=ComputeSettings)
    placement: PlacementSettings = field(default_factory=PlacementSettings)
    context: ContextSettings = field(default_factory=ContextSettings)
    n_parallel: int = 1
    prefault: bool = True
    mlock: bool = False
    progress: bool = False  # a progress bar while weights load


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: the engine and `LLM` take this, not a path."""

    model: GptOss
    tokenizer: Tokenizer
    file: ModelFile
    config: GptOssConfig
    info: ModelInfo
    ctx_size: int  # total context (all sequences) the KV memory was planned for
    load_seconds: float
    prefault_thread: threading.Thread | None = None  # still paging the weights in, when prefaulting


def load_model(path: str | os.PathLike, settings: ModelSettings = ModelSettings()) -> LoadedModel:
    """Open, plan and load `path`. Raises GGUFError for a bad file, PlacementError for a plan that
    does not fit, SettingsError for settings that contradict each other."""
    ParallelSettings(settings.n_parallel)  # the same check as -np
    compute, context = settings.compute, settings.context
    if compute.threads is not None:
        kernels.set_num_threads(compute.threads)
    t0 = time.perf_counter()
    path = os.fspath(path)
    model_file = open_model(path)
    try:
        tokenizer = Tokenizer.from_metadata(model_file.metadata)
    except (ValueError, TypeError) as e:  # a damaged tokenizer array: name the file
        raise GGUFError(f"{path}: {e}") from None
    config = GptOssConfig.from_metadata(model_file.metadata, model_file.path)
    plan = _placement(model_file, config, settings)
    ctx_size = context.ctx_size
    if plan is None:
        if context.kv_bytes == 2:
            log.warning("-ctk/-ctv: no GPU, so the cache stays f32 (what the CPU decode kernel reads)")
        ctx_size = _cpu_context(config, ctx_size, settings.n_parallel)
    else:
        for note in context.cache_type_notes():
            log.warning("%s", note)
    # fast math: int8 activations in this model's kernel calls (~5e-3 relative error per
    # matmul, MoE 1.5-1.7x faster on AVX2); off, fp32 activations match the reference to ~1e-6.
    model = GptOss(model_file, plan, progress=settings.progress, fast_math=compute.fast_math)
    model.torch_threads = compute.threads or kernels.num_threads()  # default: one per physical core
    if settings.mlock:
        residency.mlock(model_file)
    # Huge folios, and what stays in RAM read and mapped on a background thread (residency).
    prefault_thread = None
    if settings.prefault:
        keep = None if plan is None else (lambda name: plan.device_of(name) == "cpu")
        prefault_thread = residency.prefault(model_file, keep=keep)
    else:
        residency.prefer_huge_folios(model_file)
    return LoadedModel(model, tokenizer, model_file, model.config, describe_model(path, model_file, model.config),
                       ctx_size or config.context_length, time.perf_counter() - t0, prefault_thread)


def _placement(model_file: ModelFile, config: GptOssConfig, settings: ModelSettings) -> Plan | None:
    """The placement plan from llama.cpp-style settings, before any weight is loaded.

    None (everything on the CPU) when there is no CUDA device. With CUDA, the default is
    llama.cpp's: every layer on the GPU; `cpu_moe`/`n_cpu_moe`/`override_tensor` keep experts in
    RAM. A plan that cannot fit in VRAM or RAM is refused with the numbers.
    """
    placement, context = settings.placement, settings.context
    if not torch.cuda.is_available():
        if placement.asks_for_gpu():
            log.warning("no CUDA device: every tensor runs on the CPU (placement options ignored)")
        _warn_if_weights_exceed_ram(model_file)
        return None
    options = PlacementOptions(placement, ctx_size=context.ctx_size, n_parallel=settings.n_parallel,
                               batch_size=context.step_tokens, kv_dtype_bytes=context.kv_bytes,
                               fast_math=settings.compute.fast_math)
    plan = make_plan(config, model_file.tensors, options)
    log.info("placement plan:\n%s", format_plan(plan))
    check_fits(plan, resolve_vram_budget(placement), residency.available_ram_bytes())
    return plan


def _cpu_context(config: GptOssConfig, ctx_size: int, n_parallel: int) -> int:
    """The total context for a CPU (float32) KV cache: the request, or the model's capped to fit in RAM."""
    fit = fit_context(config, ctx_size, n_parallel, 4, residency.available_ram_bytes())
    if fit.note:
        log.warning("%s", fit.note)
    return fit.ctx_size


def _warn_if_weights_exceed_ram(model_file: ModelFile) -> None:
    """CPU-only: every weight is used from the mmap, so it all wants page cache. Not fatal (the
    OS pages experts in from disk), but a step then reads the disk: say so up front."""
    need = sum(t.nbytes for t in model_file.tensors.values())
    have = residency.available_ram_bytes()
    if have is not None and need > have:
        log.warning(
            "weights need %.1f GiB of page cache but only %.1f GiB of RAM is available: experts "
            "will be re-read from disk during generation (slow)", need / 2**30, have / 2**30,
        )
