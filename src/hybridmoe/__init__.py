"""hybridmoe: MoE inference with experts on the CPU and everything else on the GPU."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name: str):
    # Lazy so that `hybridmoe inspect` etc. do not pay for importing torch.
    if name == "LLM":
        from hybridmoe.engine.llm import LLM

        return LLM
    raise AttributeError(name)
