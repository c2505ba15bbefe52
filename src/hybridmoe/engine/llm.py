"""The public Python API: `LLM(path).generate(...)`, `logits`, `tokenize`, `detokenize`.

A façade over the two halves: `models.load.load_model` gives the `LoadedModel`, and `generate`
runs requests through a one-slot `Engine` on the caller's thread (the server's decode loop).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridmoe.engine.engine import CacheConfig, Engine
from hybridmoe.engine.request import GenerationRequest
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.gguf.reader import ModelFile
from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.models.gpt_oss import GptOss, SeqChunk
from hybridmoe.models.load import LoadedModel, ModelSettings, load_model
from hybridmoe.settings import (
    SAMPLING_DEFAULTS,
    ComputeSettings,
    ContextSettings,
    PlacementSettings,
    SamplerSettings,
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
        settings = ModelSettings(compute=compute, placement=placement, context=context, n_parallel=n_parallel,
                                 prefault=prefault, mlock=mlock, progress=progress)
        self.loaded: LoadedModel = load_model(resolve_model_path(path), settings)
        self.batch_size = context.step_tokens
        self.speculative = speculative
        self._engine: Engine | None = None

    # --- the loaded model, as LoadedModel holds it ------------------------------------------
    @property
    def model(self) -> GptOss:
        return self.loaded.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.loaded.tokenizer

    @property
    def config(self) -> GptOssConfig:
        return self.loaded.config

    @property
    def file(self) -> ModelFile:
        return self.loaded.file

    @property
    def path(self) -> str:
        return self.loaded.info.path

    @property
    def ctx_size(self) -> int:
        return self.loaded.ctx_size

    @property
    def load_seconds(self) -> float:
        return self.loaded.load_seconds

    @property
    def chat_template(self) -> str | None:
        """The GGUF's `tokenizer.chat_template` (Jinja), if the file carries one."""
        return self.loaded.info.chat_template

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

    def _engine_for(self, n_ctx: int) -> Engine:
        """A one-slot engine driven on the caller's thread, grown when a request needs more context
        (its cache is sized to need, not to the model's full context)."""
        if self._engine is None or self._engine.ctx_size_per_slot < n_ctx:
            ctx = min(self.ctx_size, max(n_ctx, 2 * self._engine.ctx_size_per_slot if self._engine else n_ctx))
            self._engine = Engine(self.loaded, 1, ctx, max_queue=0, batch_size=self.batch_size,
                                  cache=CacheConfig(cache_ram_bytes=0), speculative=self.speculative)
        return self._engine
