"""Which GGUF a command opens: `-m FILE`, or `-hf ORG/NAME[:TAG]` (`-hff FILE`) as llama-server
takes them, the latter found in the Hugging Face cache (gguf/hf_cache.py; nothing is downloaded)."""

from __future__ import annotations

import argparse
import logging

log = logging.getLogger("hybridmoe")


def add_model_args(p: argparse.ArgumentParser, model_help: str) -> None:
    p.add_argument("-m", "--model", default=None, help=model_help)
    p.add_argument("-hf", "-hfr", "--hf-repo", default=None, metavar="ORG/NAME[:TAG]",
                   help="a model in the Hugging Face cache, picked as llama-server -hf does (which, or "
                        "huggingface-cli, fetched it); nothing is downloaded")
    p.add_argument("-hff", "--hf-file", default=None, metavar="FILE", help="with -hf: this file of the repository")


def model_file(args: argparse.Namespace) -> str | None:
    """-hf's cached file (it wins over -m, as in llama-server), else -m; None when neither is given.
    ValueError when -hf names nothing in the cache, saying how to fetch it."""
    if args.hf_repo:
        from hybridmoe.gguf.hf_cache import resolve

        path = resolve(args.hf_repo, args.hf_file)
        if args.model:
            log.warning("-hf %s replaces -m %s, as in llama-server", args.hf_repo, args.model)
        log.info("-hf %s: %s (from the Hugging Face cache)", args.hf_repo, path)
        return path
    if args.hf_file:
        log.warning("ignoring -hff %s: it picks a file of the -hf repository, and no -hf was given", args.hf_file)
    return args.model
