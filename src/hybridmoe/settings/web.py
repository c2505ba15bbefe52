"""Web settings: the chat page at / (`--no-ui`, `--path`, `--ui-config`) and what browsers on other
origins may call (`--cors-*`), as llama-server names them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridmoe.settings.values import json_object


@dataclass(frozen=True)
class WebSettings:
    """ui (--ui / --no-ui): serve the web chat page (else its paths answer 404).
    static_path (--path): a directory whose files are served at / in place of the page (public, as it is).
    ui_config (--ui-config) / ui_config_file (--ui-config-file): the page's defaults for new visitors
        (llama-server's keys), as /props ui_settings; ui_settings() reads them.
    cors_origins (--cors-origins): * (echo any), localhost, or a comma-separated list;
        cors_methods / cors_headers / cors_credentials: what a preflight answers allows.
    """

    ui: bool = True
    static_path: str | None = None
    ui_config: dict[str, Any] | None = None
    ui_config_file: str | None = None
    cors_origins: str = "*"
    cors_methods: str = "GET, POST, DELETE, OPTIONS"
    cors_headers: str = "*"
    cors_credentials: bool = True

    def ui_settings(self) -> dict[str, Any]:
        """--ui-config-file, else --ui-config (llama-server reads the one given last; both is a
        mistake). ValueError naming the file if it cannot be read or holds no JSON object."""
        if not self.ui_config_file:
            return dict(self.ui_config or {})
        try:
            return json_object(Path(self.ui_config_file).read_text())
        except OSError as e:
            raise ValueError(f"--ui-config-file {self.ui_config_file}: {e.strerror or e}") from None
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--ui-config-file {self.ui_config_file}: {e}") from None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WebSettings:
        return cls(ui=args.ui, static_path=args.static_path, ui_config=args.ui_config,
                   ui_config_file=args.ui_config_file, cors_origins=args.cors_origins,
                   cors_methods=args.cors_methods, cors_headers=args.cors_headers,
                   cors_credentials=args.cors_credentials)


def add_web_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = WebSettings()
    g = parser.add_argument_group("web page and CORS")
    return [
        g.add_argument("--ui", "--webui", dest="ui", action="store_true", default=True,
                       help="serve the web chat page (default)"),
        g.add_argument("--no-ui", "--no-webui", dest="ui", action="store_false",
                       help="no web chat page (its paths answer 404)"),
        g.add_argument("--path", dest="static_path", default=None, metavar="DIR",
                       help="serve this directory's files at / in place of the chat page (another web UI; public "
                            "like the page)"),
        g.add_argument("--ui-config", "--webui-config", type=json_object, default=None, metavar="JSON",
                       help="the chat page's defaults for new visitors (llama-server's keys: systemMessage, "
                            "temperature, top_k, top_p, min_p, repeat_penalty, max_tokens), as /props ui_settings"),
        g.add_argument("--ui-config-file", "--webui-config-file", default=None, metavar="PATH",
                       help="--ui-config from a file"),
        g.add_argument("--cors-origins", default=d.cors_origins,
                       help="allowed origins: * (echo any), localhost, or a comma-separated list"),
        g.add_argument("--cors-methods", default=d.cors_methods),
        g.add_argument("--cors-headers", default=d.cors_headers,
                       help="allowed headers (* = those the browser asks for)"),
        g.add_argument("--cors-credentials", dest="cors_credentials", action="store_true", default=True),
        g.add_argument("--no-cors-credentials", dest="cors_credentials", action="store_false"),
    ]
