"""hybridmoe: MoE inference with experts on the CPU and everything else on the GPU.

No OpenMP setting is needed: decode steps keep torch on one thread, so its pool has no spinning
waits to take the expert kernels' cores (bench/api_env.py: the API decodes as fast as the CLI
with OMP_WAIT_POLICY unset, PASSIVE, or torch imported first).
"""

from __future__ import annotations

from hybridmoe.settings import ComputeSettings, ContextSettings, PlacementSettings, SamplingDefaults

__version__ = "0.1.0"

__all__ = ["LLM", "ComputeSettings", "ContextSettings", "PlacementSettings", "SamplingDefaults", "__version__"]


def __getattr__(name: str):
    # Lazy so that `hybridmoe inspect` etc. do not pay for importing torch.
    if name == "LLM":
        from hybridmoe.engine.llm import LLM

        return LLM
    raise AttributeError(name)
