"""What the server says about itself, in llama-server's shapes: `/v1/models`, `/props`, `/slots`
(and slot save / restore / erase), `/metrics`, `/lora-adapters`, and SGLang's `/v1/loads`."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridmoe import __version__
from hybridmoe.engine.engine import SlotError
from hybridmoe.engine.slot_files import SlotFileError
from hybridmoe.server.loads import loads as engine_loads
from hybridmoe.server.metrics import prometheus_text
from hybridmoe.server.protocol import APIError, bad_request
from hybridmoe.server.service import Service
from hybridmoe.server.wiring import Wiring
from hybridmoe.settings import SAMPLER_ORDER

UNSET_SEED = 4294967295  # llama-server's seed for "random"


def _listed(values: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}


def models(s: Service) -> dict[str, Any]:
    """OpenAI's list (`data`) with llama-server's additions: `meta`, `architecture`, and the
    Ollama-style `models` list beside it."""
    info = s.engine.model_info
    meta = {"n_vocab": info.vocab_size, "n_ctx": s.engine.ctx_size_per_slot, "n_ctx_train": info.n_ctx_train,
            "n_embd": info.n_embd, "n_params": info.n_params, "size": info.size_bytes}
    if info.vocab_type is not None:
        meta = {"vocab_type": info.vocab_type, **meta}  # llama-server's key order
    if info.ftype is not None:
        meta["ftype"] = info.ftype
    tags = list(s.config.tags)
    text_only = {"input_modalities": ["text"], "output_modalities": ["text"]}
    ollama = {"name": s.model_id, "model": s.model_id, "modified_at": "", "size": "", "digest": "",
              "type": "model", "description": "", "tags": tags, "capabilities": ["completion"],
              "parameters": "", "details": {"parent_model": "", "format": "gguf", "family": "", "families": [],
                                            "parameter_size": "", "quantization_level": ""}}
    return {"models": [ollama], "object": "list",
            "data": [{"id": s.model_id, "aliases": s.config.aliases(), "tags": tags, "object": "model",
                      "architecture": text_only, "created": s.created, "owned_by": "hybridmoe", "meta": meta}]}


def props(s: Service) -> dict[str, Any]:
    d, c = s.config.defaults, s.config
    return {
        "default_generation_settings": {
            "n_ctx": s.engine.ctx_size_per_slot,
            "params": {"seed": UNSET_SEED if c.seed is None else c.seed,
                       "temperature": d.temperature, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
                       "n_predict": c.n_predict, "max_tokens": c.n_predict,
                       "samplers": list(d.order), "reasoning_format": c.reasoning_format,
                       **_listed(dataclasses.asdict(d.samplers)),
                       # llama-server's other defaults, as it reports them
                       "ignore_eos": c.ignore_eos, "n_probs": 0, "post_sampling_probs": False,
                       "stream": False, "timings_per_token": False, "n_keep": 0, "n_discard": 0, "lora": [],
                       "backend_sampling": False, "chat_format": "Content-only", "generation_prompt": "",
                       "reasoning_in_content": False,
                       "speculative.types": s.engine.speculative.type_name},
        },
        "total_slots": s.engine.n_parallel,
        "model_alias": s.model_id,
        "model_path": c.model_path,
        "chat_template": s.template,
        "chat_template_caps": {  # what this server accepts and renders for the harmony template
            "supports_object_arguments": True, "supports_parallel_tool_calls": True,
            "supports_preserve_reasoning": False, "supports_reasoning_effort": True,
            "supports_string_content": True, "supports_system_role": True, "supports_tool_calls": True,
            "supports_tools": True, "supports_typed_content": True},
        "model_ftype": s.engine.model_info.ftype,
        "modalities": {"vision": False, "audio": False},
        "build_info": f"hybridmoe {__version__}",
        "bos_token": s.renderer.special["bos_token"],
        "eos_token": s.renderer.special["eos_token"],
        "is_sleeping": False,
    }


def slots(s: Service) -> list[dict[str, Any]]:
    """llama-server's /slots fields (for its dashboards and scripts), then our cache counters."""
    out = []
    for slot in s.engine.status()["slots"]:
        sp = slot.pop("sampling")
        pending, n_max = slot.pop("n_prompt_pending"), slot.pop("max_tokens")
        params: dict[str, Any] = {"chat_format": s.format.name, "reasoning_format": s.config.reasoning_format,
                                  "n_probs": slot.pop("n_probs")}
        if sp is not None:
            params.update(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p,
                          seed=UNSET_SEED if sp.seed is None or sp.seed < 0 else sp.seed,
                          n_predict=n_max, max_tokens=n_max, ignore_eos=sp.ignore_eos,
                          samplers=list(sp.samplers or SAMPLER_ORDER), **_listed(dataclasses.asdict(sp.chain)))
        n_prompt = slot["n_prompt_tokens"]
        out.append({
            **slot, "params": params,
            "n_prompt_tokens_cache": slot["n_prompt_cached"],
            "n_prompt_tokens_processed": max(0, n_prompt - pending - slot["n_prompt_cached"]),
            "next_token": [{"has_next_token": slot["is_processing"], "has_new_line": False,
                            "n_remain": n_max - slot["n_decoded"] if slot["is_processing"] else -1,
                            "n_decoded": slot["n_decoded"]}],
        })
    return out


def slot_action(s: Service, id_slot: int, action: str, filename: str | None) -> dict[str, Any]:
    """llama-server's POST /slots/{id}?action=save|restore|erase (blocking: run in a thread)."""
    if not s.config.slot_save_path:
        raise APIError(501, "This server does not support slots action. Start it with `--slot-save-path`",
                       type="not_supported_error")
    if action not in ("save", "restore", "erase"):
        raise bad_request(f"action must be save, restore or erase, got {action!r}", param="action")
    try:
        if action == "erase":
            return {"id_slot": id_slot, **s.engine.erase_slot(id_slot)}
        path = slot_file(s.config.slot_save_path, filename)
        if action == "save":
            r = s.engine.save_slot(id_slot, str(path))
            return {"id_slot": id_slot, "filename": filename, "n_saved": r["n_saved"],
                    "n_written": r["n_written"], "timings": {"save_ms": r["save_ms"]}}
        if not path.is_file():
            raise bad_request(f"no slot file named {filename!r} in the slot save path", param="filename")
        r = s.engine.restore_slot(id_slot, str(path))
        return {"id_slot": id_slot, "filename": filename, "n_restored": r["n_restored"],
                "n_read": r["n_read"], "timings": {"restore_ms": r["restore_ms"]}}
    except (SlotError, SlotFileError) as e:
        raise bad_request(str(e), param="filename" if isinstance(e, SlotFileError) else "id_slot") from None
    except OSError as e:
        raise APIError(500, f"slot file {filename!r}: {e.strerror or e}", type="server_error") from None


def slot_file(directory: str, filename: str | None) -> Path:
    """A plain file name inside --slot-save-path: no directories, no hidden or special names."""
    if not isinstance(filename, str) or not filename:
        raise bad_request("filename is required", param="filename")
    if (len(filename.encode("utf-8", "surrogatepass")) > 255 or filename.startswith(".")
            or any(c in filename for c in '/\\:') or any(ord(c) < 32 or 0xD800 <= ord(c) < 0xE000 for c in filename)):
        raise bad_request("Invalid filename", param="filename")
    return Path(directory) / filename


def register(app: FastAPI, w: Wiring) -> None:
    state = w.state

    @app.get("/v1/models")
    @app.get("/models")
    async def list_models() -> Any:
        return models(w.service())

    @app.get("/props")
    async def get_props() -> Any:
        # llama-server's switches: which endpoints answer, its web UI and the page's defaults
        return {**props(w.service()), "endpoint_slots": state.slots_enabled,
                "endpoint_metrics": state.metrics_enabled, "endpoint_props": False, "cors_proxy_enabled": False,
                "ui": state.ui, "ui_settings": state.ui_settings}

    @app.post("/props", include_in_schema=False)
    async def set_props() -> Any:  # llama-server answers the same unless started with --props
        raise APIError(501, "This server does not support changing global properties (llama-server's --props): "
                            "restart it with the flags you want", type="not_supported_error")

    @app.get("/lora-adapters")
    async def lora_adapters() -> Any:  # llama-server's list; none can be loaded here
        return []

    @app.post("/lora-adapters")
    async def set_lora_adapters(adapters: list[Any]) -> Any:
        if adapters:  # llama-server answers success and ignores ids it does not have; an error is kinder
            raise APIError(400, f"no LoRA adapter is loaded (this server loads none), got {adapters[0]!r}",
                           param="adapters")
        return {"success": True}

    @app.get("/slots")
    async def get_slots(fail_on_no_slot: int = 0) -> Any:
        if not state.slots_enabled:
            raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           type="not_supported_error")
        info = slots(w.service())
        if fail_on_no_slot and all(x["is_processing"] for x in info):
            raise APIError(503, "no slot available", type="unavailable_error")
        return info

    @app.get("/slots/{id_slot}", include_in_schema=False)
    async def slot_get(id_slot: str) -> Any:  # llama-server has no such route: 404, not our 405
        raise StarletteHTTPException(404, "Not Found")

    @app.post("/slots/{id_slot}")
    async def post_slot(id_slot: int, action: str = "", body: dict[str, Any] | None = None) -> Any:
        s = w.service()
        return await asyncio.to_thread(slot_action, s, id_slot, action, (body or {}).get("filename"))

    @app.get("/metrics")
    async def metrics() -> Any:
        if not state.metrics_enabled:
            raise APIError(501, "This server does not support metrics endpoint. Start it with `--metrics`",
                           type="not_supported_error")
        s = w.service()
        # llama-server's headers, exactly: no charset on the content type, and the start time.
        return Response(prometheus_text(s.engine, s.counters),
                        headers={"Content-Type": "text/plain; version=0.0.4",
                                 "Process-Start-Time-Unix": str(s.counters.started)})

    @app.get("/v1/loads")
    async def loads() -> Any:  # SGLang's load report, polled by gateways (smg): server/loads.py
        return engine_loads(w.service().engine)
