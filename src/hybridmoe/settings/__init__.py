"""Typed runtime settings, one frozen dataclass per group, each with its command-line flags.

`add_<group>_args(parser)` declares a group's flags and `<Group>.from_args(args)` reads them back,
so `generate`, `serve` and `plan` share one flag table: the same names, defaults, help and
validation. Library users build the dataclasses directly; a bad value raises SettingsError naming
the flag. Imports neither torch nor the rest of hybridmoe.
"""

from hybridmoe.settings.compute import ComputeSettings, add_compute_args
from hybridmoe.settings.context import (
    ContextSettings,
    ParallelSettings,
    PromptCacheSettings,
    add_context_args,
    add_parallel_args,
    add_prompt_cache_args,
)
from hybridmoe.settings.loading import LoadSettings, add_load_args
from hybridmoe.settings.placement import GPU_DENSE_DTYPES, PlacementSettings, add_placement_args, gpu_layers
from hybridmoe.settings.sampling_defaults import (
    SAMPLER_NAMES,
    SAMPLER_ORDER,
    SAMPLING_DEFAULTS,
    SamplerSettings,
    SamplingDefaults,
    add_sampling_args,
    check_sampling,
    parse_samplers,
)
from hybridmoe.settings.server import ServerLimits, add_server_limit_args
from hybridmoe.settings.speculative import SpeculativeSettings, add_speculative_args, spec_type_notes
from hybridmoe.settings.values import SettingsError, byte_size, on_off

__all__ = [
    "GPU_DENSE_DTYPES", "SAMPLER_NAMES", "SAMPLER_ORDER", "SAMPLING_DEFAULTS", "ComputeSettings", "ContextSettings",
    "LoadSettings", "ParallelSettings",
    "PlacementSettings", "PromptCacheSettings", "SamplerSettings", "SamplingDefaults", "ServerLimits",
    "SettingsError", "SpeculativeSettings", "add_compute_args", "add_context_args", "add_load_args", "add_parallel_args",
    "add_placement_args", "add_prompt_cache_args", "add_sampling_args", "add_server_limit_args",
    "add_speculative_args", "byte_size", "check_sampling", "gpu_layers", "on_off", "parse_samplers",
    "spec_type_notes",
]
