"""Shared fixtures: tiny synthetic gpt-oss models written by the project's own writer."""

from __future__ import annotations

import os

import pytest

# One thread everywhere: spinning OpenMP pools collapse on a shared 2-core machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning waits collapse on a shared 2-core CI box


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> str:
    from hybridmoe.synth import write_synthetic

    path = tmp_path_factory.mktemp("synth") / "tiny.gguf"
    return write_synthetic(path, "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llm(tiny_gguf):
    from hybridmoe import LLM, ComputeSettings

    return LLM(tiny_gguf, compute=ComputeSettings(threads=1))
