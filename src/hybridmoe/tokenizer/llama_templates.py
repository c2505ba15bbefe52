"""llama.cpp's built-in chat formats (`llm_chat_apply_template` in src/llama-chat.cpp) as Jinja.

llama-server writes these when `--chat-template NAME` is given with `--no-jinja`; with Jinja on
(its default) it renders NAME itself as a template, so every prompt is the literal name. We serve
the format the name stands for either way, string for string as llama.cpp writes it.
"""

from __future__ import annotations

import json

# A message's text: a string, or its content parts' texts one a line (as llama-server joins them).
_TEXT = ("{%- macro text(m) -%}{%- if m['content'] is string -%}{{- m['content'] -}}"
         "{%- elif m['content'] is not none -%}{%- for p in m['content'] -%}"
         "{{- ('' if loop.first else '\\n') ~ (p['text'] if p is mapping else p) -}}{%- endfor -%}{%- endif -%}"
         "{%- endmacro -%}")


def _s(text: str) -> str:
    """A Jinja string literal (JSON's escapes are Jinja's)."""
    return json.dumps(text)


def _gen(prompt: str) -> str:
    return f"{{%- if add_generation_prompt -%}}{{{{- {_s(prompt)} -}}}}{{%- endif -%}}" if prompt else ""


def _headed(open_: str, mid: str, close: str, gen: str, *, trim: bool = False, start: str = "") -> str:
    """Every message as open_ ROLE mid TEXT close (TEXT trimmed when trim), then gen."""
    body = "text(m) | trim" if trim else "text(m)"
    return (f"{_TEXT}{{{{- {_s(start)} -}}}}{{%- for m in messages -%}}"
            f"{{{{- {_s(open_)} ~ m['role'] ~ {_s(mid)} ~ {body} ~ {_s(close)} -}}}}{{%- endfor -%}}{_gen(gen)}")


def _by_role(roles: dict[str, tuple[str, str]], gen: str, *, other: tuple[str, str] | None = None,
             trim: bool = False) -> str:
    """Each message wrapped by its role's (prefix, suffix); roles not listed take `other`, or are
    left out when it is None; then gen."""
    body = "text(m) | trim" if trim else "text(m)"
    branches = "".join(f"{{%- {'if' if i == 0 else 'elif'} m['role'] == {_s(role)} -%}}"
                       f"{{{{- {_s(pre)} ~ {body} ~ {_s(post)} -}}}}"
                       for i, (role, (pre, post)) in enumerate(roles.items()))
    if other is not None:
        branches += f"{{%- else -%}}{{{{- {_s(other[0])} ~ {body} ~ {_s(other[1])} -}}}}"
    return f"{_TEXT}{{%- for m in messages -%}}{branches}{{%- endif -%}}{{%- endfor -%}}{_gen(gen)}"


def _mistral(lead: str, space: str, trim_assistant: bool) -> str:
    """mistral-v1/v3/v3-tekken: an [INST] opened before each turn's first message (no generation
    prompt: the prompt ends in [/INST])."""
    reply = "text(m) | trim" if trim_assistant else "text(m)"
    return (f"{_TEXT}{{%- set ns = namespace(inside=false) -%}}{{%- for m in messages -%}}"
            f"{{%- if not ns.inside -%}}{{{{- {_s(lead + '[INST]' + space)} -}}}}"
            "{%- set ns.inside = true -%}{%- endif -%}"
            f"{{%- if m['role'] == 'system' -%}}{{{{- text(m) ~ '\\n\\n' -}}}}"
            f"{{%- elif m['role'] == 'user' -%}}{{{{- text(m) ~ {_s(lead + '[/INST]')} -}}}}"
            f"{{%- else -%}}{{{{- {_s(space)} ~ {reply} ~ '</s>' -}}}}{{%- set ns.inside = false -%}}{{%- endif -%}}"
            f"{{%- endfor -%}}")


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    """llama2 and its -sys, -sys-bos, -sys-strip variants (no generation prompt)."""
    body = "text(m) | trim" if strip else "text(m)"
    sys_block = "'<<SYS>>\\n' ~ c ~ '\\n<</SYS>>\\n\\n'" if system else "c ~ '\\n'"
    reopen = "<s>[INST] " if bos_inside else "[INST] "
    return (f"{_TEXT}{{{{- '[INST] ' -}}}}{{%- set ns = namespace(inside=true) -%}}{{%- for m in messages -%}}"
            f"{{%- set c = {body} -%}}"
            f"{{%- if not ns.inside -%}}{{%- set ns.inside = true -%}}{{{{- {_s(reopen)} -}}}}{{%- endif -%}}"
            f"{{%- if m['role'] == 'system' -%}}{{{{- {sys_block} -}}}}"
            f"{{%- elif m['role'] == 'user' -%}}{{{{- c ~ ' [/INST]' -}}}}"
            f"{{%- else -%}}{{{{- c ~ '</s>' -}}}}{{%- set ns.inside = false -%}}{{%- endif -%}}{{%- endfor -%}}")


# gemma has no system role: the system text (trimmed) opens the next user turn.
_GEMMA = (f"{_TEXT}{{%- set ns = namespace(system='') -%}}{{%- for m in messages -%}}"
          "{%- if m['role'] == 'system' -%}{%- set ns.system = ns.system ~ (text(m) | trim) -%}{%- else -%}"
          "{%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}"
          "{{- '<start_of_turn>' ~ role ~ '\\n' -}}"
          "{%- if ns.system and role != 'model' -%}{{- ns.system ~ '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}"
          "{{- (text(m) | trim) ~ '<end_of_turn>\\n' -}}{%- endif -%}{%- endfor -%}"
          f"{_gen('<start_of_turn>model' + chr(10))}")

_COMMAND_R_TURN = "<|START_OF_TURN_TOKEN|>"
_MISTRAL_V7 = {space: _by_role({"system": (f"[SYSTEM_PROMPT]{space}", "[/SYSTEM_PROMPT]"),
                                "user": (f"[INST]{space}", "[/INST]")}, "", other=(space, "</s>"))
               for space in (" ", "")}
_DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"

LLAMA_CPP_TEMPLATES: dict[str, str] = {
    "llama3": _headed("<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>",
                      "<|start_header_id|>assistant<|end_header_id|>\n\n", trim=True),
    "llama4": _headed("<|header_start|>", "<|header_end|>\n\n", "<|eot|>",
                      "<|header_start|>assistant<|header_end|>\n\n", trim=True),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", trim_assistant=False),
    "mistral-v3": _mistral("", " ", trim_assistant=True),
    "mistral-v3-tekken": _mistral("", "", trim_assistant=False),
    "mistral-v7": _MISTRAL_V7[" "],
    "mistral-v7-tekken": _MISTRAL_V7[""],
    "phi3": _headed("<|", "|>\n", "<|end|>\n", "<|assistant|>\n"),
    "phi4": _headed("<|im_start|>", "<|im_sep|>", "<|im_end|>", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _headed("<|", "|>\n", "\n", "<|assistant|>\n"),
    "zephyr": _headed("<|", "|>\n", "<|endoftext|>\n", "<|assistant|>\n"),
    "chatglm4": _headed("<|", "|>\n", "", "<|assistant|>\n", start="[gMASK]<sop>"),
    "glmedge": _headed("<|", "|>\n", "", "<|assistant|>"),
    "gemma": _GEMMA,
    "vicuna": _by_role({"system": ("", "\n\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "</s>\n")},
                       "ASSISTANT:"),
    "vicuna-orca": _by_role({"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"),
                             "assistant": ("ASSISTANT: ", "</s>\n")}, "ASSISTANT:"),
    "deepseek": _by_role({"system": ("", ""), "user": ("### Instruction:\n", "\n"),
                          "assistant": ("### Response:\n", "\n<|EOT|>\n")}, "### Response:\n"),
    "deepseek2": _by_role({"system": ("", "\n\n"), "user": ("User: ", "\n\n"),
                           "assistant": ("Assistant: ", _DEEPSEEK_EOS)}, "Assistant:"),
    "deepseek3": _by_role({"system": ("", "\n\n"), "user": ("<｜User｜>", ""),
                           "assistant": ("<｜Assistant｜>", _DEEPSEEK_EOS)}, "<｜Assistant｜>"),
    "command-r": _by_role({role: (f"{_COMMAND_R_TURN}<|{token}|>", "<|END_OF_TURN_TOKEN|>") for role, token in
                           (("system", "SYSTEM_TOKEN"), ("user", "USER_TOKEN"), ("assistant", "CHATBOT_TOKEN"))},
                          f"{_COMMAND_R_TURN}<|CHATBOT_TOKEN|>", trim=True),
}
