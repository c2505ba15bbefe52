"""Typed runtime settings, one frozen dataclass per group, each with its command-line flags.

`add_<group>_args(parser)` declares a group's flags and `<Group>.from_args(args)` reads them back,
so `generate`, `serve` and `plan` share one flag table: the same names, defaults, help and
validation. Library users build the dataclasses directly; a bad value raises SettingsError naming
the flag. Imports neither torch nor the rest of hybridmoe.
"""

from hybridmoe.settings.chat import ChatSettings, add_chat_args
from hybridmoe.settings.compute import ComputeSettings, add_compute_args
from hybridmoe.settings.context import (
    AttentionSettings,
    ContextSettings,
    ParallelSettings,
    PromptCacheSettings,
    add_attention_args,
    add_context_args,
    add_parallel_args,
    add_prompt_cache_args,
)
from hybridmoe.settings.loading import LoadSettings, ResidencySettings, add_load_args, add_residency_args
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
from hybridmoe.settings.server import (
    EndpointSettings,
    RequestDefaults,
    ServerLimits,
    ServerSettings,
    add_endpoint_args,
    add_request_default_args,
    add_server_args,
    add_server_limit_args,
)
from hybridmoe.settings.speculative import SpeculativeSettings, add_speculative_args, spec_type_notes
from hybridmoe.settings.values import SettingsError, byte_size, on_off
from hybridmoe.settings.web import WebSettings, add_web_args

__all__ = [
    "GPU_DENSE_DTYPES", "SAMPLER_NAMES", "SAMPLER_ORDER", "SAMPLING_DEFAULTS", "AttentionSettings", "ChatSettings",
    "ComputeSettings", "ContextSettings", "EndpointSettings", "LoadSettings", "ParallelSettings", "PlacementSettings",
    "PromptCacheSettings", "RequestDefaults", "ResidencySettings", "SamplerSettings", "SamplingDefaults",
    "ServerLimits", "ServerSettings", "SettingsError", "SpeculativeSettings", "WebSettings", "add_attention_args",
    "add_chat_args", "add_compute_args", "add_context_args", "add_endpoint_args", "add_load_args",
    "add_parallel_args", "add_placement_args", "add_prompt_cache_args", "add_request_default_args",
    "add_residency_args", "add_sampling_args", "add_server_args", "add_server_limit_args", "add_speculative_args",
    "add_web_args", "byte_size", "check_sampling", "gpu_layers", "on_off", "parse_samplers", "spec_type_notes",
]
