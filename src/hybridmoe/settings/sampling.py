"""Sampling defaults: the one place that states them, for the CLI, `SamplingParams`, `LLM.generate`
and the server's requests that leave a field out (llama-server's values)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass

from hybridmoe.settings.values import require


FLAG_NAMES = {"temperature": "--temp", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
              "seed": "-s/--seed", "repeat_penalty": "--repeat-penalty", "repeat_last_n": "--repeat-last-n",
              "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty"}
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


def check_penalties(repeat_penalty: float, repeat_last_n: int, presence_penalty: float, frequency_penalty: float,
                    names: Mapping[str, str] = FIELD_NAMES) -> None:
    """The repetition penalties' valid ranges (finite; a positive repeat_penalty, since it divides)."""
    require(0 < repeat_penalty < math.inf, names["repeat_penalty"], "be > 0 (1 = off)", repeat_penalty)
    require(repeat_last_n >= -1, names["repeat_last_n"], "be >= -1 (-1: all tokens, 0: off)", repeat_last_n)
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        require(math.isfinite(v), names[name], "be a finite number (0 = off)", v)


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
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, FLAG_NAMES)
        check_penalties(self.repeat_penalty, self.repeat_last_n, self.presence_penalty, self.frequency_penalty,
                        FLAG_NAMES)
        require(self.n_predict >= -1 and self.n_predict != 0, "-n/--n-predict", "be > 0 or -1 (no limit)",
                self.n_predict)

    @property
    def request_seed(self) -> int | None:
        """The seed a request without one gets (None: a random one each time)."""
        return None if self.seed < 0 else self.seed

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SamplingDefaults:
        return cls(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                   seed=args.seed, n_predict=args.n_predict, repeat_penalty=args.repeat_penalty,
                   repeat_last_n=args.repeat_last_n, presence_penalty=args.presence_penalty,
                   frequency_penalty=args.frequency_penalty)


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
        g.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty,
                       help=f"penalize repeated tokens, 1 = off (default {d.repeat_penalty})"),
        g.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n,
                       help=f"tokens the penalties look back over, -1 = all, 0 = off (default {d.repeat_last_n})"),
        g.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                       help=f"subtracted from a repeated token's logit, 0 = off (default {d.presence_penalty})"),
        g.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                       help=f"subtracted per repetition, 0 = off (default {d.frequency_penalty})"),
        g.add_argument("-s", "--seed", type=int, default=d.seed, help="RNG seed (-1: random)"),
        g.add_argument("-n", "--predict", "--n-predict", dest="n_predict", type=int, default=d.n_predict,
                       help="tokens to generate (-1: up to the end of the context or an end token)"),
    ]
