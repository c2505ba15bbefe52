"""Sampling fields beyond the basic filters, through a real server: `logit_bias` in OpenAI's and
llama-server's forms, the repetition penalties over prompt and reply, DRY, XTC, Mirostat and the
rest of llama.cpp's chain (each step's rule is checked against a reference in
tests/test_sampler_chain.py; here: that the fields reach it, and the errors)."""

from __future__ import annotations

import pytest

PROMPT = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
GREEDY = {"temperature": 0, "ignore_eos": True, "return_tokens": True}


def tokens(server, **body) -> list[int]:
    status, out = server.request("POST", "/completion", {"prompt": PROMPT, **GREEDY, **body})
    assert status == 200, out
    return out["tokens"]


def test_logit_bias_bans_the_greedy_choice_in_every_form(server, client):
    (first,) = tokens(server, n_predict=1)
    for bias in ({str(first): False}, [[first, False]], {str(first): -1000}):
        (other,) = tokens(server, n_predict=1, logit_bias=bias)
        assert other != first, bias
    (boosted,) = tokens(server, n_predict=1, logit_bias=[[77, 1000.0]])
    assert boosted == 77
    _, tok = server.request("POST", "/tokenize", {"content": " hello there"})
    for bias in ([[" hello there", 1000.0]], {" hello there": 1000.0}):  # text: each of its tokens
        (boosted,) = tokens(server, n_predict=1, logit_bias=bias)
        assert boosted in tok["tokens"], bias
    r = client.completions.create(model="tiny-test", prompt=PROMPT, max_tokens=1, temperature=0,
                                  logit_bias={str(first): -100}, extra_body={"return_tokens": True})
    assert r.choices[0].model_extra.get("tokens", [None])[0] != first


def test_frequency_penalty_keeps_prompt_and_reply_tokens_from_repeating(server):
    plain = tokens(server, n_predict=24)
    assert len(set(plain)) < len(plain) or set(plain) & set(PROMPT)  # the model repeats: the check has teeth
    out = tokens(server, n_predict=24, frequency_penalty=1000.0, repeat_last_n=-1)
    assert len(set(out)) == len(out) and not set(out) & set(PROMPT), out
    # a window of 1: only the token just written is held back
    out = tokens(server, n_predict=24, presence_penalty=1000.0, repeat_last_n=1)
    assert all(a != b for a, b in zip(out, out[1:])), out


def test_settings_are_reported_under_llama_server_names(server):
    status, out = server.request("POST", "/completion", {
        "prompt": PROMPT, "n_predict": 1, "repeat_penalty": 1.2, "repeat_last_n": 32, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "logit_bias": [[5, False], [6, 1.5]]})
    assert status == 200, out
    g = out["generation_settings"]
    assert (g["repeat_penalty"], g["repeat_last_n"], g["presence_penalty"], g["frequency_penalty"]) == (
        1.2, 32, 0.5, 0.25)
    assert g["logit_bias"] == [{"bias": None, "token": 5}, {"bias": 1.5, "token": 6}]
    assert g["samplers"][0] == "penalties"


@pytest.mark.parametrize("body,param,msg", [
    ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"logit_bias": [[1]]}, "logit_bias", "logit_bias[0] must be a [token, bias] pair"),
    ({"logit_bias": {"1": "x"}}, "logit_bias", "finite number or false"),
    ({"logit_bias": {"1": True}}, "logit_bias", "finite number or false"),
    ({"logit_bias": [[None, 1]]}, "logit_bias", "an id or a text"),
    ({"logit_bias": 5}, "logit_bias", "an object"),
    ({"logit_bias": [["x" * 2000, 1.0]]}, "logit_bias", "at most 1024"),
    ({"logit_bias": {str(i): 1.0 for i in range(5000)}}, "logit_bias", "at most 4096 are accepted"),
    ({"repeat_penalty": 0}, "repeat_penalty", "repeat_penalty must be > 0"),
    ({"repeat_last_n": -2}, "repeat_last_n", "repeat_last_n must be >= -1"),
    ({"dry_penalty_last_n": -5}, "dry_penalty_last_n", "dry_penalty_last_n must be >= -1"),
    ({"mirostat": 3}, "mirostat", "mirostat must be 0 (off), 1 or 2"),
    ({"min_keep": -1}, "min_keep", "min_keep must be >= 0"),
    ({"dry_sequence_breakers": []}, "dry_sequence_breakers", "at least 1 item"),
    ({"dry_sequence_breakers": ["x"] * 65}, "dry_sequence_breakers", "at most 64 items"),
])
def test_bad_fields_are_400_naming_them(server, body, param, msg):
    for path, base in (("/completion", {"prompt": "a"}), ("/v1/chat/completions",
                                                         {"messages": [{"role": "user", "content": "a"}]})):
        status, out = server.request("POST", path, {**base, "max_tokens": 1, **body})
        assert status == 400, (path, out)
        assert msg in out["error"]["message"] and param in (out["error"].get("param") or out["error"]["message"]), out


def test_every_sampler_setting_is_a_request_field():
    import dataclasses

    from hybridmoe.server.protocol import SamplingFields
    from hybridmoe.settings import SamplerSettings

    assert {f.name for f in dataclasses.fields(SamplerSettings)} <= set(SamplingFields.model_fields)


def test_dry_xtc_and_mirostat_reach_the_sampler(server):
    def pairs(out: list[int]) -> list[tuple[int, int]]:
        text = PROMPT + out
        return [(a, b) for a, b in zip(text, text[1:])]

    plain = tokens(server, n_predict=40)
    assert len(set(pairs(plain))) < len(pairs(plain)), plain  # the model repeats itself: the check has teeth
    # DRY with a huge multiplier and allowed length 1: no two-token run of prompt or reply comes back
    out = tokens(server, n_predict=40, dry_multiplier=1000.0, dry_allowed_length=1, dry_sequence_breakers=["@@"])
    assert len(set(pairs(out))) == len(pairs(out)), out
    # XTC always on, with a low threshold: the greedy top choice goes whenever another is above it
    assert tokens(server, n_predict=6, xtc_probability=1.0, xtc_threshold=0.0001, top_k=0, top_p=1.0,
                  min_p=0.0) != plain[:6]
    status, out = server.request("POST", "/completion", {"prompt": PROMPT, "n_predict": 8, "mirostat": 2,
                                                         "mirostat_tau": 3.0, "temperature": 1.0, "seed": 5})
    assert status == 200 and out["generation_settings"]["mirostat"] == 2, out
    g = out["generation_settings"]
    assert (g["mirostat_tau"], g["dry_sequence_breakers"], g["xtc_threshold"]) == (3.0, ["\n", ":", "\"", "*"], 0.1)


def test_post_sampling_probs_are_the_distribution_the_draw_saw(server):
    """llama-server's post_sampling_probs: after top-k 2 (top-p and min-p off) the two candidates'
    probabilities sum to 1 and the chosen token is one of them; a greedy pick has probability 1."""
    body = {"prompt": PROMPT, "n_predict": 4, "n_probs": 3, "post_sampling_probs": True, "temperature": 1.0,
            "top_k": 2, "top_p": 1.0, "min_p": 0.0, "seed": 3}
    status, out = server.request("POST", "/completion", body)
    assert status == 200, out
    for e in out["completion_probabilities"]:
        tops = e["top_probs"]
        assert len(tops) == 2 and abs(sum(t["prob"] for t in tops) - 1) < 1e-5, e
        assert e["id"] in [t["id"] for t in tops] and e["prob"] in [t["prob"] for t in tops], e
    status, out = server.request("POST", "/completion", {**body, "temperature": 0})
    for e in out["completion_probabilities"]:
        assert e["prob"] == 1.0 and [t["id"] for t in e["top_probs"]] == [e["id"]], e
    status, raw = server.request("POST", "/completion", {**body, "post_sampling_probs": False})
    assert all(len(e["top_logprobs"]) == 3 for e in raw["completion_probabilities"])  # the model's own, top 3
