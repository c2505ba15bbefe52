"""Chat settings: the template chats are rendered with and how replies' reasoning is handled
(`--chat-template`, `--reasoning-format`, `--reasoning-budget`, ...), as llama-server names them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from hybridmoe.settings.values import json_object, on_off

# llama-server's --reasoning-effort levels -> the gpt-oss template's three (or none; None: the template's).
REASONING_EFFORTS = {"default": None, "none": "none", "minimal": "low", "low": "low", "medium": "medium",
                     "high": "high", "xhigh": "high", "max": "high"}
REASONING_FORMATS = ("none", "auto", "deepseek")


def reasoning_effort(value: str) -> str | None:
    """--reasoning-effort's level as the template's (minimal = low; xhigh, max = high)."""
    if value.lower() not in REASONING_EFFORTS:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(REASONING_EFFORTS)}, got {value!r}")
    return REASONING_EFFORTS[value.lower()]


@dataclass(frozen=True)
class ChatSettings:
    """chat_template (--chat-template): a built-in template's name or Jinja text;
        chat_template_file (--chat-template-file) wins over it; neither: the GGUF's template.
    chat_template_kwargs (--chat-template-kwargs): template variables for every chat.
    jinja (--jinja): accepted; the template is always Jinja.
    reasoning_format (--reasoning-format): none | auto | deepseek; skip_chat_parsing
        (--skip-chat-parsing) serves replies as raw text, as reasoning_format none.
    reasoning (-rea): on | off | auto: the template's enable_thinking.
    reasoning_effort (--reasoning-effort): for chats that give none (None: the template's).
    reasoning_budget (--reasoning-budget): thinking tokens per reply (-1: no limit, 0: end at
        once); reasoning_budget_message: written before the end the server writes for the model.
    """

    chat_template: str | None = None
    chat_template_file: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    jinja: bool = False
    reasoning_format: str = "auto"
    skip_chat_parsing: bool = False
    reasoning: str = "auto"
    reasoning_effort: str | None = None
    reasoning_budget: int = -1
    reasoning_budget_message: str = ""

    @property
    def parsed_format(self) -> str:
        """The reasoning format replies are parsed with (--skip-chat-parsing: none)."""
        return "none" if self.skip_chat_parsing else self.reasoning_format

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChatSettings:
        return cls(chat_template=args.chat_template, chat_template_file=args.chat_template_file,
                   chat_template_kwargs=args.chat_template_kwargs, jinja=args.jinja,
                   reasoning_format=args.reasoning_format, skip_chat_parsing=args.skip_chat_parsing,
                   reasoning=args.reasoning, reasoning_effort=args.reasoning_effort,
                   reasoning_budget=args.reasoning_budget, reasoning_budget_message=args.reasoning_budget_message)


def add_chat_args(parser: argparse.ArgumentParser, builtin_templates: list[str]) -> list[argparse.Action]:
    """`builtin_templates`: the names --chat-template knows (tokenizer.builtin_templates, which
    this package does not import)."""
    d = ChatSettings()
    g = parser.add_argument_group("chat")
    return [
        g.add_argument("--jinja", action="store_true", help="accepted; the GGUF's Jinja template is always used"),
        g.add_argument("--chat-template-file", default=None),
        g.add_argument("--chat-template", default=None,
                       help=f"a built-in template name ({', '.join(sorted(builtin_templates))}) or a Jinja template"),
        g.add_argument("--chat-template-kwargs", type=json_object, default=None),
        g.add_argument("--reasoning-format", choices=list(REASONING_FORMATS), default=d.reasoning_format),
        g.add_argument("-rea", "--reasoning", default=d.reasoning, type=on_off,
                       help="reasoning in chats: on, off (harmony replies skip the analysis channel) or auto; the "
                            "template's enable_thinking"),
        g.add_argument("--reasoning-effort", type=reasoning_effort, default=None, metavar="LEVEL",
                       help="reasoning effort for chat requests that give none: low, medium, high or none (minimal "
                            "= low; xhigh, max = high: gpt-oss knows three levels); default: the template's"),
        g.add_argument("--skip-chat-parsing", dest="skip_chat_parsing", action="store_true",
                       help="replies as raw text in content (analysis channel and tool calls unparsed): "
                            "--reasoning-format none"),
        g.add_argument("--no-skip-chat-parsing", dest="skip_chat_parsing", action="store_false"),
        g.add_argument("--reasoning-budget", type=int, default=d.reasoning_budget, metavar="N",
                       help="thinking tokens per reply: -1 no limit, 0 end at once, N then the end is written for "
                            "the model"),
        g.add_argument("--reasoning-budget-message", default=d.reasoning_budget_message, metavar="MESSAGE",
                       help="written before the end of the thinking when the budget is spent"),
    ]
