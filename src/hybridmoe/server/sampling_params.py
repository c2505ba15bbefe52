"""A request's sampling fields over the server's defaults (its flags) -> the engine's SamplingParams,
with 400s naming the field; DRY's breakers as tokens, found off the event loop's thread."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from hybridmoe.engine.dry import Breakers, tokenizer_breakers
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.server.logit_bias import resolve_logit_bias
from hybridmoe.server.protocol import SamplingFields, bad_request
from hybridmoe.settings import SamplerSettings, SamplingDefaults, parse_samplers

# Request fields that set settings.SamplerSettings (the protocol has one for each)
CHAIN_FIELDS = tuple(f.name for f in dataclasses.fields(SamplerSettings))


def sampler_order(samplers: list[str] | str) -> tuple[str, ...]:
    """`samplers` as a list of names or a string of letters ("kpmt") -> names; 400 on unknown ones."""
    try:
        return parse_samplers(samplers)
    except ValueError as e:
        raise bad_request(str(e), param="samplers") from None


def sampler_chain(req: SamplingFields, defaults: SamplingDefaults) -> SamplerSettings:
    """The request's llama.cpp samplers over the server's defaults."""
    given = {f: getattr(req, f) for f in CHAIN_FIELDS if getattr(req, f) is not None}
    if "dry_sequence_breakers" in given:
        given["dry_sequence_breakers"] = tuple(given["dry_sequence_breakers"])
    return dataclasses.replace(defaults.samplers, **given)


@dataclasses.dataclass(frozen=True)
class ServerSampling:
    """The serve flags that sampling falls back on."""

    defaults: SamplingDefaults
    seed: int | None  # --seed (None: random)
    n_predict: int  # -n (-1: the context)
    ignore_eos: bool  # --ignore-eos (unconstrained requests that give none)


def sampling_params(req: SamplingFields, server: ServerSampling, tokenizer: Any, room: int,
                    limit: int | None) -> SamplingParams:
    """`room`: tokens left in the slot's context after the prompt; `limit`: the request's token
    limit (None: the server's -n)."""
    d = server.defaults
    if limit is None and server.n_predict >= 0:
        limit = server.n_predict
    if limit == 0:
        raise bad_request("n_predict 0 (evaluate the prompt only) is not supported", param="n_predict")
    params = SamplingParams(
        temperature=d.temperature if req.temperature is None else req.temperature,
        top_k=d.top_k if req.top_k is None else req.top_k,
        top_p=d.top_p if req.top_p is None else req.top_p,
        min_p=d.min_p if req.min_p is None else req.min_p,
        seed=req.seed if req.seed is not None else server.seed,
        max_tokens=min(limit, room) if limit is not None else room,
        ignore_eos=(req.ignore_eos if req.ignore_eos is not None
                    else server.ignore_eos and not req.constrained()),  # a constrained reply must end
        samplers=sampler_order(req.samplers) if req.samplers is not None else d.order,
        chain=sampler_chain(req, d),
        logit_bias=d.logit_bias if req.logit_bias is None else resolve_logit_bias(
            req.logit_bias, lambda text: tokenizer.encode(text, allow_special=False), tokenizer.vocab_size),
    )
    try:
        params.validate()
    except ValueError as e:
        field_name = str(e).split(" ", 1)[0]
        raise bad_request(str(e), param=field_name if field_name in CHAIN_FIELDS else None) from None
    return params


async def dry_breakers(req: SamplingFields, defaults: SamplingDefaults, tokenizer: Any) -> Breakers | None:
    """DRY's sequence breakers as tokens when the request turns DRY on: the first scan of the
    vocabulary for a breaker list takes ~0.1 s, so it runs in a worker thread."""
    chain = sampler_chain(req, defaults)
    if chain.dry_multiplier == 0.0:
        return None
    return await asyncio.to_thread(tokenizer_breakers, tokenizer, chain.dry_sequence_breakers)
