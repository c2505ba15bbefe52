"""The public Python API: `LLM(path).generate(...)`, `logits`, `tokenize`, `detokenize`."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridmoe.engine.request import GenerationRequest
from hybridmoe.engine.sampling import SamplingParams
from hybridmoe.gguf.reader import GGUFError, open_model
from hybridmoe.models.gpt_oss import GptOss, SeqChunk
from hybridmoe.settings import (
    SAMPLING_DEFAULTS,
    ComputeSettings,
    ContextSettings,
    ParallelSettings,
    PlacementSettings,
    SpeculativeSettings,
)
from hybridmoe.tokenizer.tokenizer import Tokenizer

log = logging.getLogger("hybridmoe")

DEMO_MODEL = Path(__file__).resolve().parent.parent / "data" / "demo.gguf"


def resolve_model_path(path: str | os.PathLike | None) -> str:
    """The given path, or the bundled demo model, or (if absent) a cached synthetic tiny model."""
    if path:
        return os.fspath(path)
    if DEMO_MODEL.exists():
        return str(DEMO_MODEL)
    from hybridmoe.synth import write_synthetic

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hybridmoe"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / "synthetic-tiny.gguf"
    if not target.exists():
        log.warning("no bundled demo model: writing a synthetic tiny model (random weights) to %s", target)
        tmp = target.with_suffix(".tmp")
        write_synthetic(tmp, "tiny", seed=0)
        tmp.replace(target)
    return str(target)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    timings: dict[str, float] = field(default_factory=dict)


def _placement(model_file: Any, placement: PlacementSettings, context: ContextSettings, n_parallel: int,
               fast_math: bool) -> Any:
    """Build the placement plan from llama.cpp-style settings, before any weight is loaded.

    Returns None (everything on the CPU) when there is no CUDA device. With CUDA, the default
    is llama.cpp's: every layer on the GPU; `cpu_moe`/`n_cpu_moe`/`override_tensor` keep
    experts in RAM. A plan that cannot fit in VRAM or RAM is refused with the numbers.
    """
    if not torch.cuda.is_available():
        if placement.asks_for_gpu():
            log.warning("no CUDA device: every tensor runs on the CPU (placement options ignored)")
        _warn_if_weights_exceed_ram(model_file)
        return None
    from hybridmoe.gguf.residency import available_ram_bytes
    from hybridmoe.models.gpt_oss_config import GptOssConfig
    from hybridmoe.placement.plan import PlacementOptions, check_fits, make_plan, resolve_vram_budget
    from hybridmoe.placement.report import format_plan

    cfg = GptOssConfig.from_metadata(model_file.metadata, model_file.path)
    options = PlacementOptions(placement, ctx_size=context.ctx_size, n_parallel=n_parallel,
                               batch_size=context.step_tokens, kv_dtype_bytes=context.kv_bytes, fast_math=fast_math)
    plan = make_plan(cfg, model_file.tensors, options)
    log.info("placement plan:\n%s", format_plan(plan))
    check_fits(plan, resolve_vram_budget(placement), available_ram_bytes())
    return plan


def _cpu_context(model_file: Any, ctx_size: int, n_parallel: int) -> int:
    """The total context for a CPU KV cache: the request, or the model's capped to fit in RAM."""
    from hybridmoe.gguf.residency import available_ram_bytes
    from hybridmoe.models.gpt_oss_config import GptOssConfig
    from hybridmoe.placement.memory import fit_context

    cfg = GptOssConfig.from_metadata(model_file.metadata, model_file.path)
    fit = fit_context(cfg, ctx_size, n_parallel, 4, available_ram_bytes())
    if fit.note:
        log.warning("%s", fit.note)
    return fit.ctx_size


def _warn_if_weights_exceed_ram(model_file: Any) -> None:
    """CPU-only: every weight is used from the mmap, so it all wants page cache. Not fatal (the
    OS pages experts in from disk), but a step then reads the disk: say so up front."""
    from hybridmoe.gguf.residency import available_ram_bytes

    need = sum(t.nbytes for t in model_file.tensors.values())
    have = available_ram_bytes()
    if have is not None and need > have:
        log.warning(
            "weights need %.1f GiB of page cache but only %.1f GiB of RAM is available: experts "
            "will be re-read from disk during generation (slow)", need / 2**30, have / 2**30,
        )


class LLM:
    """A loaded model with its tokenizer. Not thread-safe: one engine thread owns it."""

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        compute: ComputeSettings = ComputeSettings(),
        placement: PlacementSettings = PlacementSettings(),
        context: ContextSettings = ContextSettings(),
        n_parallel: int = 1,
        progress: bool = False,
        prefault: bool = True,
        mlock: bool = False,
        speculative: SpeculativeSettings = SpeculativeSettings(),
    ):
        """`n_parallel`: sequences the KV cache is planned for (the server's -np; one here).
        `speculative`: self-speculative decoding for `generate` (off by default)."""
        ParallelSettings(n_parallel)  # the same check as -np
        from hybridmoe import kernels

        if compute.threads is not None:
            kernels.set_num_threads(compute.threads)
        n_threads = compute.threads or kernels.num_threads()  # default: one per physical core
        self.path = resolve_model_path(path)
        t0 = time.perf_counter()
        self.file = open_model(self.path)
        try:
            self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
        except (ValueError, TypeError) as e:  # a damaged tokenizer array: name the file
            raise GGUFError(f"{self.path}: {e}") from None
        ctx_size = context.ctx_size
        plan = _placement(self.file, placement, context, n_parallel, compute.fast_math)
        if plan is None and context.kv_bytes == 2:
            log.warning("-ctk/-ctv: no GPU, so the cache stays f32 (what the CPU decode kernel reads)")
        elif plan is not None:
            for note in context.cache_type_notes():
                log.warning("%s", note)
        if plan is None:  # CPU: the KV cache is float32 in RAM; the plan checks it on devices
            ctx_size = _cpu_context(self.file, ctx_size, n_parallel)
        # fast math: int8 activations in this model's kernel calls (~5e-3 relative error per
        # matmul, MoE 1.5-1.7x faster on AVX2); off, fp32 activations match the reference to ~1e-6.
        self.model = GptOss(self.file, plan, progress=progress, fast_math=compute.fast_math)
        self.model.torch_threads = n_threads
        self.config = self.model.config
        self.ctx_size = ctx_size or self.config.context_length
        self.batch_size = context.step_tokens
        from hybridmoe.gguf import residency

        if mlock:
            residency.mlock(self.file)
        # Huge folios, and what stays in RAM read and mapped on a background thread (residency).
        if prefault:
            keep = None if plan is None else (lambda name: plan.device_of(name) == "cpu")
            self.prefault_thread = residency.prefault(self.file, keep=keep)
        else:
            self.prefault_thread = None
            residency.prefer_huge_folios(self.file)
        self._engine: Any = None
        self.speculative = speculative
        self.load_seconds = time.perf_counter() - t0

    @property
    def chat_template(self) -> str | None:
        """The GGUF's `tokenizer.chat_template` (Jinja), if the file carries one."""
        return self.file.metadata.get("tokenizer.chat_template")

    # --- tokens --------------------------------------------------------------------------
    def tokenize(self, text: str, allow_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, allow_special=allow_special)

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids))

    # --- forward -------------------------------------------------------------------------
    def prefill(self, cache: Any, ids: list[int]) -> torch.Tensor:
        """Feed ids in batch-size chunks; returns the last position's logits."""
        logits = None
        for i in range(0, len(ids), self.batch_size):
            logits = self.model.forward([SeqChunk(cache, ids[i : i + self.batch_size])])
        assert logits is not None
        return logits[0]

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """float32 [len(token_ids), vocab]: every position, from an empty cache."""
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("logits() needs at least one token")
        cache = self.model.make_cache(len(ids))
        out = [
            self.model.forward([SeqChunk(cache, ids[i : i + self.batch_size])], all_logits=True)
            for i in range(0, len(ids), self.batch_size)
        ]
        return torch.cat(out).float().cpu().numpy()

    def generate(
        self,
        prompt_or_ids: str | list[int],
        max_tokens: int = SAMPLING_DEFAULTS.n_predict,
        temperature: float = SAMPLING_DEFAULTS.temperature,
        top_k: int = SAMPLING_DEFAULTS.top_k,
        top_p: float = SAMPLING_DEFAULTS.top_p,
        min_p: float = SAMPLING_DEFAULTS.min_p,
        seed: int | None = SAMPLING_DEFAULTS.request_seed,
        ignore_eos: bool = False,
        stop: list[str] | None = None,
        chain: SamplerSettings = SAMPLING_DEFAULTS.samplers,
        logit_bias: dict[int, float] | None = None,
    ) -> GenerationResult:
        """Generate through the same engine steps as the server (one decode loop, one stop rule).
        max_tokens -1: up to the end of the context (or an end token). chain: llama.cpp's other
        samplers (penalties, DRY, XTC, Mirostat, ...); logit_bias: token id -> added to its logit
        (-inf bans it)."""
        ids = self.tokenize(prompt_or_ids) if isinstance(prompt_or_ids, str) else [int(t) for t in prompt_or_ids]
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) + 1 > self.ctx_size:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the context size {self.ctx_size}")
        room = self.ctx_size - len(ids)
        budget = room if max_tokens < 0 else min(max_tokens, room)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                                max_tokens=budget, ignore_eos=ignore_eos, chain=chain,
                                logit_bias=tuple((logit_bias or {}).items()))
        events = self._engine_for(len(ids) + budget).run(GenerationRequest(ids, params, stop=stop or ()))
        last = events[-1]
        if last.finish_reason == "error":
            raise RuntimeError(f"generation failed: {last.error}")
        return GenerationResult("".join(e.text for e in events), [e.token_id for e in events if e.token_id is not None],
                                last.finish_reason, last.timings or {})

    def _engine_for(self, n_ctx: int) -> Any:
        """A one-slot engine driven on the caller's thread, grown when a request needs more context
        (its cache is sized to need, not to the model's full context)."""
        from hybridmoe.engine.engine import CacheConfig, Engine

        if self._engine is None or self._engine.ctx_size_per_slot < n_ctx:
            ctx = min(self.ctx_size, max(n_ctx, 2 * self._engine.ctx_size_per_slot if self._engine else n_ctx))
            self._engine = Engine(self, 1, ctx, max_queue=0, batch_size=self.batch_size,
                                  cache=CacheConfig(cache_ram_bytes=0), speculative=self.speculative)
        return self._engine
