"""Sampling defaults: the one place that states them, for the CLI, `SamplingParams`, `LLM.generate`
and the server's requests that leave a field out (llama-server's values)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from hybridmoe.settings.values import SettingsError, require


FLAG_NAMES = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
              "seed": "-s/--seed"}
FIELD_NAMES = {name: name for name in FLAG_NAMES}


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float, seed: int | None,
                   names: Mapping[str, str] = FIELD_NAMES) -> None:
    """The valid ranges, for the CLI's defaults (named by flag) and for each request's
    SamplingParams (named by field); SettingsError otherwise."""
    require(temperature >= 0, names["temperature"], "be >= 0", temperature)
    require(top_k >= 0, names["top_k"], "be >= 0", top_k)
    require(0 < top_p <= 1, names["top_p"], "be in (0, 1]", top_p)
    require(0 <= min_p <= 1, names["min_p"], "be in [0, 1]", min_p)
    require(seed is None or -(2**63) <= seed < 2**64, names["seed"], "be a 64-bit integer (negative: random)", seed)


# llama.cpp's sampler names in its default order, then "adaptive_p" (the final draw when listed)
# and "infill" (accepted, does nothing: no fill-in-the-middle), aliases and one-letter codes.
SAMPLER_ORDER = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
SAMPLER_NAMES = frozenset(SAMPLER_ORDER) | {"infill", "adaptive_p"}
SAMPLER_ALIASES = {"top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "min-p": "min_p", "temp": "temperature",
                   "typical_p": "typ_p", "typical": "typ_p", "top-n-sigma": "top_n_sigma", "adaptive-p": "adaptive_p"}
SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                   "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties", "a": "adaptive_p"}


def parse_samplers(value: list[str] | str) -> tuple[str, ...]:
    """llama-server's `samplers`: a list of names (aliases allowed) or a string of letters
    ("edskypmxt") -> names; ValueError naming an unknown one."""
    if isinstance(value, str):
        bad = [ch for ch in value if ch not in SAMPLER_LETTERS]
        if bad:
            raise ValueError(f"unknown sampler letter {bad[0]!r} in samplers")
        return tuple(SAMPLER_LETTERS[ch] for ch in value)
    names = tuple(SAMPLER_ALIASES.get(n.lower(), n.lower()) for n in value)
    unknown = [n for n in names if n not in SAMPLER_NAMES]
    if unknown:
        raise ValueError(f"unknown sampler {unknown[0]!r} in samplers; known: {', '.join(sorted(SAMPLER_NAMES))}")
    return names


def parse_logit_bias_flag(value: str) -> tuple[int, float]:
    """llama.cpp's `-l/--logit-bias TOKEN_ID(+/-)BIAS` (e.g. 15043+1, 15043-inf)."""
    m = re.fullmatch(r"\s*(\d+)\s*([+-])\s*(\S+)\s*", value)
    try:
        bias = float(m.group(3)) if m else math.nan
    except ValueError:
        bias = math.nan
    if m is None or math.isnan(bias) or (bias == math.inf and m.group(2) == "+"):
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID+BIAS or TOKEN_ID-BIAS (e.g. 15043+1), got {value!r}")
    return int(m.group(1)), bias if m.group(2) == "+" else -bias


# llama-server's default DRY sequence breakers (common/common.h)
DRY_BREAKERS = ("\n", ":", "\"", "*")


@dataclass(frozen=True)
class SamplerSettings:
    """llama.cpp's other samplers, under llama-server's request field names; each is off at its
    default. Penalties and DRY count the last N tokens of prompt and reply (-1: all, 0: off)."""

    repeat_penalty: float = 1.0  # a repeated token's logit divided by it (multiplied when <= 0)
    repeat_last_n: int = 64
    presence_penalty: float = 0.0  # subtracted once from a repeated token's logit
    frequency_penalty: float = 0.0  # subtracted per repetition
    dry_multiplier: float = 0.0  # DRY: a repeat-extending token loses multiplier * base^(len - allowed)
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: tuple[str, ...] = DRY_BREAKERS
    top_n_sigma: float = -1.0  # keep tokens within n standard deviations of the top logit; <= 0: off
    typical_p: float = 1.0  # locally typical sampling; 1: off
    xtc_probability: float = 0.0  # XTC: with this probability drop the top choices but the least likely
    xtc_threshold: float = 0.1  # ... of those at or above this probability; > 0.5: off
    min_keep: int = 0  # top-p, min-p, typical and XTC keep at least this many
    dynatemp_range: float = 0.0  # temperature moves within +- range with the entropy; 0: off
    dynatemp_exponent: float = 1.0
    mirostat: int = 0  # 1 or 2: Mirostat replaces the filters (temperature, then Mirostat's draw)
    mirostat_tau: float = 5.0  # target surprise (bits)
    mirostat_eta: float = 0.1  # learning rate
    # adaptive-p (with "adaptive_p" in the sampler order it makes the final draw): favours tokens
    # whose probability is near a target that moves so the chosen ones average `adaptive_target`
    adaptive_target: float = -1.0  # < 0: off (the draw is plain)
    adaptive_decay: float = 0.9  # the average's memory, about 1 / (1 - decay) tokens

    def check(self, names: Mapping[str, str] | None = None) -> None:
        """Valid ranges (finite numbers; a positive repeat_penalty, since it divides); ValueError
        (SettingsError) naming the field, or with `names` the flag."""
        n = names or {}

        def need(ok: bool, field: str, rule: str) -> None:
            require(ok, n.get(field, field), rule, getattr(self, field))

        for f in ("presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base", "top_n_sigma", "typical_p",
                  "xtc_probability", "xtc_threshold", "dynatemp_range", "dynatemp_exponent", "mirostat_tau",
                  "mirostat_eta", "adaptive_target"):
            need(math.isfinite(getattr(self, f)), f, "be a finite number")
        need(0 < self.repeat_penalty < math.inf, "repeat_penalty", "be > 0 (1 = off)")
        for f in ("repeat_last_n", "dry_penalty_last_n"):
            need(getattr(self, f) >= -1, f, "be >= -1 (-1: all tokens, 0: off)")
        need(self.dry_allowed_length >= 0, "dry_allowed_length", "be >= 0")
        need(self.min_keep >= 0, "min_keep", "be >= 0")
        need(self.dynatemp_range >= 0, "dynatemp_range", "be >= 0")
        need(self.mirostat in (0, 1, 2), "mirostat", "be 0 (off), 1 or 2")
        need(0.0 <= self.adaptive_decay <= 0.99, "adaptive_decay", "be in [0, 0.99]")
        need(all(isinstance(b, str) for b in self.dry_sequence_breakers), "dry_sequence_breakers",
             "be a list of strings")


SAMPLER_FLAGS = {"repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n",
                 "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                 "dry_multiplier": "--dry-multiplier", "dry_base": "--dry-base",
                 "dry_allowed_length": "--dry-allowed-length", "dry_penalty_last_n": "--dry-penalty-last-n",
                 "dry_sequence_breakers": "--dry-sequence-breaker", "top_n_sigma": "--top-nsigma",
                 "typical_p": "--typical", "xtc_probability": "--xtc-probability", "xtc_threshold": "--xtc-threshold",
                 "min_keep": "--min-keep", "dynatemp_range": "--dynatemp-range",
                 "dynatemp_exponent": "--dynatemp-exp", "mirostat": "--mirostat", "mirostat_tau": "--mirostat-ent",
                 "mirostat_eta": "--mirostat-lr", "adaptive_target": "--adaptive-target",
                 "adaptive_decay": "--adaptive-decay"}


@dataclass(frozen=True)
class SamplingDefaults:
    """temperature 0 = greedy; top_k 0, top_p 1 and min_p 0 switch that filter off.
    seed < 0: a random seed per request. n_predict -1: up to the end of the context."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int = -1
    n_predict: int = -1
    samplers: SamplerSettings = SamplerSettings()
    order: tuple[str, ...] = SAMPLER_ORDER  # --samplers / --sampling-seq
    logit_bias: tuple[tuple[int, float], ...] = ()  # -l/--logit-bias, for requests that send none

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, FLAG_NAMES)
        self.samplers.check(SAMPLER_FLAGS)
        require(self.n_predict >= -1 and self.n_predict != 0, "-n/--n-predict", "be > 0 or -1 (no limit)",
                self.n_predict)

    @property
    def request_seed(self) -> int | None:
        """The seed a request without one gets (None: a random one each time)."""
        return None if self.seed < 0 else self.seed

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SamplingDefaults:
        chain = {f.name: getattr(args, f.name) for f in dataclasses.fields(SamplerSettings)}
        breakers = chain["dry_sequence_breakers"]
        chain["dry_sequence_breakers"] = (DRY_BREAKERS if breakers is None
                                          else () if breakers == ["none"] else tuple(breakers))
        order = SAMPLER_ORDER
        try:
            if args.samplers is not None:
                order = parse_samplers(args.samplers.split(";"))
            if args.sampling_seq is not None:
                order = parse_samplers(args.sampling_seq)
        except ValueError as e:
            raise SettingsError(f"--samplers / --sampling-seq: {e}") from None
        return cls(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   seed=args.seed, n_predict=args.n_predict, samplers=SamplerSettings(**chain), order=order,
                   logit_bias=tuple(args.logit_bias or ()))


SAMPLING_DEFAULTS = SamplingDefaults()


def add_sampling_args(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    d = SAMPLING_DEFAULTS
    g = parser.add_argument_group("sampling (defaults of requests that give none)")
    return [
        g.add_argument("--temp", type=float, default=d.temperature,
                       help=f"temperature, 0 = greedy (default {d.temperature})"),
        g.add_argument("--top-k", type=int, default=d.top_k, help=f"top-k, 0 = off (default {d.top_k})"),
        g.add_argument("--top-p", type=float, default=d.top_p, help=f"top-p, 1 = off (default {d.top_p})"),
        g.add_argument("--min-p", type=float, default=d.min_p, help=f"min-p, 0 = off (default {d.min_p})"),
        *_sampler_args(g, d.samplers),
        g.add_argument("--samplers", default=None,
                       help="the samplers in order, ';'-separated (default " + ";".join(SAMPLER_ORDER) + ")"),
        g.add_argument("--sampling-seq", "--sampler-seq", dest="sampling_seq", default=None,
                       help="the same as letters (default edskypmxt)"),
        g.add_argument("-l", "--logit-bias", dest="logit_bias", type=parse_logit_bias_flag, action="append",
                       default=None, help="TOKEN_ID(+/-)BIAS added to a token's logit, e.g. 15043+1 or 15043-inf "
                                          "(repeatable); for requests without logit_bias"),
        g.add_argument("-s", "--seed", type=int, default=d.seed, help="RNG seed (-1: random)"),
        g.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=d.n_predict,
                       help="tokens to generate (-1: up to the end of the context or an end token)"),
    ]


def _sampler_args(g: argparse._ArgumentGroup, d: SamplerSettings) -> list[argparse.Action]:
    """llama.cpp's flags for the samplers beyond the four above (SamplerSettings has the rules)."""
    helps = {
        "repeat_penalty": "penalize repeated tokens, 1 = off", "repeat_last_n": "tokens the penalties look back "
        "over, -1 = all, 0 = off", "presence_penalty": "subtracted once from a repeated token's logit, 0 = off",
        "frequency_penalty": "subtracted per repetition, 0 = off", "dry_multiplier": "DRY penalty, 0 = off",
        "dry_base": "DRY base", "dry_allowed_length": "repeats up to this long are free",
        "dry_penalty_last_n": "tokens DRY looks back over, -1 = all, 0 = off", "top_n_sigma": "keep tokens "
        "within n standard deviations of the top logit, -1 = off", "typical_p": "locally typical sampling, 1 = off",
        "xtc_probability": "XTC probability, 0 = off", "xtc_threshold": "XTC threshold",
        "min_keep": "top-p, min-p, typical and XTC keep at least this many", "dynatemp_range": "dynamic "
        "temperature range, 0 = off", "dynatemp_exponent": "dynamic temperature exponent",
        "mirostat": "Mirostat 1 or 2 (replaces the other filters), 0 = off", "mirostat_tau": "Mirostat target "
        "entropy", "mirostat_eta": "Mirostat learning rate",
        "adaptive_target": "adaptive-p: favour tokens near this probability (with adaptive_p in --samplers), "
        "< 0 = off", "adaptive_decay": "adaptive-p: memory of its running average, 0 to 0.99",
    }
    out = []
    for f in dataclasses.fields(SamplerSettings):
        if f.name == "dry_sequence_breakers":
            out.append(g.add_argument(SAMPLER_FLAGS[f.name], dest=f.name, action="append", default=None,
                                      help="a DRY sequence breaker (repeatable; 'none' for none; default "
                                           "newline, ':', '\"', '*')"))
            continue
        default = getattr(d, f.name)
        out.append(g.add_argument(SAMPLER_FLAGS[f.name], dest=f.name, type=type(default), default=default,
                                  help=f"{helps[f.name]} (default {default})"))
    return out
