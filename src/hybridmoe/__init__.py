"""hybridmoe: MoE inference with experts on the CPU and everything else on the GPU."""

from __future__ import annotations

import os as _os
import sys as _sys

# Our kernels run their own thread pool beside torch's OpenMP pool; spinning OpenMP waits
# collapse when the two (or other processes) share cores. Must be set before torch loads.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"

__all__ = ["LLM", "__version__"]


def __getattr__(name: str):
    # Lazy so that `hybridmoe inspect` etc. do not pay for importing torch.
    if name == "LLM":
        from hybridmoe.engine.llm import LLM

        return LLM
    raise AttributeError(name)
