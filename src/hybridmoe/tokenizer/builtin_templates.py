"""Chat templates chosen by name with `--chat-template NAME`, as llama-server's built-in list.

Only the templates bundled in `hybridmoe.data` can be served; the other names llama-server knows
are refused with a clear message (pass the template with --chat-template-file instead).
"""

from __future__ import annotations

from importlib import resources

BUILTIN_TEMPLATES = {"gpt-oss": "harmony_template.jinja", "chatml": "chatml_template.jinja"}

# llama-server's built-in names that are not bundled here (they name non-gpt-oss chat formats).
LLAMA_SERVER_NAMES = frozenset(
    "bailing bailing-think bailing2 chatglm3 chatglm4 chatml command-r deepseek deepseek-ocr deepseek2 deepseek3 "
    "exaone-moe exaone3 exaone4 falcon3 gemma gigachat glmedge gpt-oss granite granite-4.0 granite-4.1 grok-2 "
    "hunyuan-dense hunyuan-moe hunyuan-vl kimi-k2 llama2 llama2-sys llama2-sys-bos llama2-sys-strip llama3 llama4 "
    "megrez minicpm mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7 mistral-v7-tekken monarch openchat orion "
    "pangu-embedded phi3 phi4 rwkv-world seed_oss smolvlm solar-open vicuna vicuna-orca yandex zephyr".split())


def resolve_chat_template(value: str) -> str:
    """`--chat-template VALUE`: a bundled template by name, or VALUE itself when it is Jinja.
    ValueError for a name that is not bundled or not a template at all."""
    name = value.strip()
    if name in BUILTIN_TEMPLATES:
        return resources.files("hybridmoe.data").joinpath(BUILTIN_TEMPLATES[name]).read_text()
    if "{{" in value or "{%" in value:
        return value
    if name in LLAMA_SERVER_NAMES:
        raise ValueError(f"built-in chat template {name!r} is not bundled with hybridmoe (bundled: "
                         f"{', '.join(sorted(BUILTIN_TEMPLATES))}); pass it with --chat-template-file")
    raise ValueError(f"unknown chat template {name!r}: give a built-in name ({', '.join(sorted(BUILTIN_TEMPLATES))}) "
                     "or a Jinja template")
