"""Chat templates chosen by name with `--chat-template NAME`, as llama-server's built-in list.

gpt-oss and chatml are bundled files; llama.cpp's built-in formats come from llama_templates. The
other names llama-server knows are refused with a clear message (pass --chat-template-file instead).
"""

from __future__ import annotations

from importlib import resources

from .llama_templates import LLAMA_CPP_TEMPLATES

BUNDLED_FILES = {"gpt-oss": "harmony_template.jinja", "chatml": "chatml_template.jinja"}
BUILTIN_TEMPLATES = sorted({*BUNDLED_FILES, *LLAMA_CPP_TEMPLATES})

# llama-server's built-in names (those not in BUILTIN_TEMPLATES are refused).
LLAMA_SERVER_NAMES = frozenset(
    "bailing bailing-think bailing2 chatglm3 chatglm4 chatml command-r deepseek deepseek-ocr deepseek2 deepseek3 "
    "exaone-moe exaone3 exaone4 falcon3 gemma gigachat glmedge gpt-oss granite granite-4.0 granite-4.1 grok-2 "
    "hunyuan-dense hunyuan-moe hunyuan-vl kimi-k2 llama2 llama2-sys llama2-sys-bos llama2-sys-strip llama3 llama4 "
    "megrez minicpm mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7 mistral-v7-tekken monarch openchat orion "
    "pangu-embedded phi3 phi4 rwkv-world seed_oss smolvlm solar-open vicuna vicuna-orca yandex zephyr".split())


def resolve_chat_template(value: str) -> str:
    """`--chat-template VALUE`: a built-in template by name, or VALUE itself when it is Jinja.
    ValueError for a name that is not built in or not a template at all."""
    name = value.strip()
    if name in BUNDLED_FILES:
        return resources.files("hybridmoe.data").joinpath(BUNDLED_FILES[name]).read_text()
    if name in LLAMA_CPP_TEMPLATES:
        return LLAMA_CPP_TEMPLATES[name]
    if "{{" in value or "{%" in value:
        return value
    if name in LLAMA_SERVER_NAMES:
        raise ValueError(f"built-in chat template {name!r} is not built into hybridmoe (built in: "
                         f"{', '.join(BUILTIN_TEMPLATES)}); pass it with --chat-template-file")
    raise ValueError(f"unknown chat template {name!r}: give a built-in name ({', '.join(BUILTIN_TEMPLATES)}) "
                     "or a Jinja template")
