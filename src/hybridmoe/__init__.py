"""hybridmoe: MoE inference with experts on the CPU and everything else on the GPU.

Set OMP_WAIT_POLICY=PASSIVE before importing torch when using the library (the CLI does): the
expert kernels' own threads share the cores with torch's OpenMP pool, whose spinning waits would
steal them.
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
