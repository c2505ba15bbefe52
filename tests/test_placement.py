"""Placement plan: rule precedence, errors, byte counts vs gpt-oss.md §7, --fit, JSON.

The 20b/120b files are sparse (header only, no disk), written with the real synth tensor table
but minimal metadata (no 201k-token vocab), so the whole file runs in a few seconds.
Expected bytes are recomputed here from the §7 formulas, not read back from the plan.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hybridmoe.gguf.reader import open_model
from hybridmoe.gguf.writer import write_gguf
from hybridmoe.gpt_oss_config import GptOssConfig
from hybridmoe.placement import PlacementError, PlacementOptions, check_fits, make_plan
from hybridmoe.placement import fit as fit_mod
from hybridmoe.placement.report import format_plan
from hybridmoe.placement.rules import normalize_device, parse_overrides
from hybridmoe.settings import PlacementSettings, SettingsError
from hybridmoe.synth import ARCH, PRESETS, synth_tensors

GIB = 1 << 30
H, V, KVW = 2880, 201088, 8 * 64  # hidden, vocab, kv width (gpt-oss.md §1)


def _metadata(preset: str) -> dict:
    """The preset's own config keys; no tokenizer in these files, so the vocab size is a key."""
    c = PRESETS[preset].config
    return {"general.architecture": ARCH, "general.name": f"sparse {preset}", **c.to_metadata(),
            f"{ARCH}.vocab_size": c.vocab_size}


@pytest.fixture(scope="module")
def sparse_files(tmp_path_factory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("sparse")
    out = {}
    for preset in ("20b", "120b"):
        path = d / f"{preset}.gguf"
        write_gguf(path, _metadata(preset), synth_tensors(PRESETS[preset], 0, True), sparse=True)
        out[preset] = str(path)
    return out


@pytest.fixture(scope="module")
def index(sparse_files):
    out = {}
    for preset, path in sparse_files.items():
        mf = open_model(path)
        # The real config class, built the way the loader builds it: placement must accept it.
        out[preset] = (GptOssConfig.from_metadata(mf.metadata), dict(mf.tensors))
        mf.close()
    return out


SIZES = ("ctx_size", "n_parallel", "batch_size", "kv_dtype_bytes", "fast_math")


def options(**kw) -> PlacementOptions:
    """PlacementOptions from one flat set of keywords: PlacementSettings' fields and the plan's sizes."""
    sizes = {k: kw.pop(k) for k in SIZES if k in kw}
    return PlacementOptions(PlacementSettings(**kw), **sizes)


def plan_for(index, preset: str, **kw):
    # The §7 byte formulas are for the file's stored types; the default converts Q8_0 to bf16.
    kw.setdefault("gpu_dense_dtype", "stored")
    cfg, tensors = index[preset]
    return make_plan(cfg, tensors, options(**kw))


def test_bf16_dense_weights_cost_exactly_their_bf16_bytes(index):
    stored = plan_for(index, "120b", cpu_moe=True)
    bf16 = plan_for(index, "120b", cpu_moe=True, gpu_dense_dtype="bf16")
    s, d = stored.devices["cuda:0"].weights_by_kind, bf16.devices["cuda:0"].weights_by_kind
    q8_elems = 36 * (2 * H * 4096 + 2 * H * 512) + V * H  # attention + output head
    assert sum(d.values()) - sum(s.values()) == q8_elems * 2 - q8_elems * 34 // 32


@pytest.mark.parametrize("fast_math", [False, True])
def test_auto_precision_picks_the_most_precise_choice_that_fits(index, monkeypatch, fast_math):
    # Exact numerics (the default): f32 dense + f32 KV, then stored dense (same values), then an
    # f16 cache; --fast-math starts from bf16 dense + f16 KV. No budget known: the smallest.
    monkeypatch.setattr(fit_mod, "cuda_free_bytes", lambda device: None)
    assert PlacementOptions().placement.gpu_dense_dtype == "auto" and PlacementOptions().kv_dtype_bytes is None
    big, big_kv = ("bf16", 2.0) if fast_math else ("f32", 4.0)
    order = list(dict.fromkeys([(big, big_kv), ("stored", big_kv), (big, 2.0), ("stored", 2.0)]))
    kw = dict(cpu_moe=True, ctx_size=131072, n_parallel=1, fast_math=fast_math)
    totals = {c: plan_for(index, "120b", gpu_dense_dtype=c[0], kv_dtype_bytes=c[1], **kw).devices["cuda:0"].total_bytes
              for c in order}
    assert len(set(totals.values())) == len(order)
    for c in order:
        want = next(d for d in order if totals[d] <= totals[c])
        p = plan_for(index, "120b", gpu_dense_dtype="auto", vram_budget=(totals[c] + 1) / GIB, **kw)
        assert (p.options.placement.gpu_dense_dtype, p.options.kv_dtype_bytes) == want, c
        assert p.devices["cuda:0"].total_bytes == totals[want]
        assert any(n.startswith(f"dense GPU weights: {want[0]}") for n in p.notes), p.notes
        kv_note = next(n for n in p.notes if n.startswith("KV cache on the GPU"))
        assert kv_note.startswith(f"KV cache on the GPU: {'f32' if want[1] == 4 else 'f16'}")
        assert ("5e-4" in kv_note) == (want[1] == 2 and not fast_math)
    p = plan_for(index, "120b", gpu_dense_dtype="auto", vram_budget=None, **kw)
    assert (p.options.placement.gpu_dense_dtype, p.options.kv_dtype_bytes) == ("stored", 2.0)
    assert any("no VRAM budget known" in n for n in p.notes)
    # An explicit choice is kept whatever the budget.
    p = plan_for(index, "120b", gpu_dense_dtype="f32", kv_dtype_bytes=4.0, vram_budget=1.0, **kw)
    assert (p.options.placement.gpu_dense_dtype, p.options.kv_dtype_bytes) == ("f32", 4.0)


def test_cpu_only_plan_keeps_a_float32_cache(index):
    p = plan_for(index, "20b", gpu_device="cpu", gpu_dense_dtype="auto", fast_math=True)
    assert p.options.kv_dtype_bytes == 4.0 and set(p.devices) == {"cpu"}


# --- §7 formulas, written out independently --------------------------------------------------
def expert_layer_bytes(E: int) -> int:
    weights = 3 * H * H * E * 17 // 32  # gate, up, down: MXFP4, 17 B per 32 weights
    biases = 3 * H * E * 4  # F32
    return weights + biases


def non_expert_gpu_bytes(L: int, E: int) -> dict[str, int]:
    return {
        "attention": (H * 4096 * 2 + H * 512 * 2) * L * 34 // 32,  # Q8_0
        "output": V * H * 34 // 32,
        "router": (H * E + E) * 4 * L,
        "norms_biases": ((4096 + 512 + 512 + H) + 64 + 2 * H) * 4 * L + H * 4,
    }


def kv_bytes(L: int, ctx_per_slot: int, n_parallel: int = 1, ubatch: int = 512) -> int:
    per_pos = KVW * 2 * 2  # K and V, f16: 2048 B per layer and token
    full = (L // 2) * ctx_per_slot * per_pos
    swa = (L // 2) * min(ctx_per_slot, 128 + ubatch) * per_pos
    return (full + swa) * n_parallel


# --- devices and regexes ---------------------------------------------------------------------
@pytest.mark.parametrize("spec,want", [
    ("cpu", "cpu"), ("CPU", "cpu"), ("CUDA_Host", "cpu"), ("cuda", "cuda:0"), ("CUDA0", "cuda:0"),
    ("cuda:1", "cuda:1"), ("CUDA1", "cuda:1"), (" cuda:2 ", "cuda:2")])
def test_device_spellings_normalise(spec, want):
    assert normalize_device(spec) == want


def test_bare_cuda_means_the_chosen_gpu():
    assert normalize_device("cuda", gpu_device="CUDA3") == "cuda:3"


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "", "tpu0", "cuda:-1"])
def test_bad_device_is_named(spec):
    with pytest.raises(PlacementError, match="unknown device"):
        normalize_device(spec)


def test_override_parsing_keeps_order_and_splits_on_last_equals():
    rules = parse_overrides([r"exps=CPU,attn_(q|k)=cuda:1", r"a=b=CUDA0"])
    assert [(r.pattern.pattern, r.device) for r in rules] == [
        ("exps", "cpu"), ("attn_(q|k)", "cuda:1"), ("a=b", "cuda:0")]


@pytest.mark.parametrize("spec,msg", [
    (r"blk\.(=CPU", "invalid regex"), ("exps", "expected REGEX=DEVICE"), ("=CPU", "empty regex"),
    ("exps=tpu", "unknown device 'tpu'")])
def test_bad_override_names_the_problem(index, spec, msg):
    with pytest.raises(PlacementError, match=msg) as e:
        plan_for(index, "20b", override_tensor=[spec])
    assert "-ot" in str(e.value)


# --- rule precedence -------------------------------------------------------------------------
def test_default_everything_on_gpu_but_token_embedding(index):
    p = plan_for(index, "20b")
    on_cpu = [t.name for t in p.tensors if t.device == "cpu"]
    assert on_cpu == ["token_embd.weight"]
    assert p.device_of("blk.23.ffn_down_exps.weight") == "cuda:0"


def test_cpu_moe_moves_expert_weights_and_biases_only(index):
    p = plan_for(index, "20b", cpu_moe=True)
    for t in p.tensors:
        expert = "_exps." in t.name
        assert (t.device == "cpu") == (expert or t.name == "token_embd.weight"), t.name
    assert p.device_of("blk.3.ffn_gate_exps.bias") == "cpu"
    assert p.device_of("blk.3.ffn_gate_inp.weight") == "cuda:0"  # router is not an expert tensor
    assert p.n_gpu_expert_layers == 0


def test_n_cpu_moe_takes_the_lowest_layers(index):
    p = plan_for(index, "20b", n_cpu_moe=2)
    assert p.expert_devices == ["cpu"] * 2 + ["cuda:0"] * 22
    # blk.1 must not catch blk.10..19
    assert p.device_of("blk.10.ffn_up_exps.weight") == "cuda:0"
    assert p.device_of("blk.1.ffn_up_exps.weight") == "cpu"


def test_n_cpu_moe_beyond_layer_count_equals_cpu_moe(index):
    a = plan_for(index, "20b", n_cpu_moe=99)
    b = plan_for(index, "20b", cpu_moe=True)
    assert [t.device for t in a.tensors] == [t.device for t in b.tensors]


def test_override_beats_cpu_moe(index):
    p = plan_for(index, "20b", cpu_moe=True, override_tensor=[r"blk\.5\.ffn_.*_exps=CUDA0"])
    assert p.expert_devices[5] == "cuda:0"
    assert p.n_gpu_expert_layers == 1
    t = next(t for t in p.tensors if t.name == "blk.5.ffn_down_exps.weight")
    assert t.rule.startswith("-ot")
    assert p.device_of("blk.4.ffn_down_exps.weight") == "cpu"


def test_override_beats_n_cpu_moe(index):
    p = plan_for(index, "20b", n_cpu_moe=24, override_tensor=[r"blk\.(0|1)\.ffn=cuda"])
    assert p.expert_devices[:3] == ["cuda:0", "cuda:0", "cpu"]


def test_first_matching_override_wins(index):
    a = plan_for(index, "20b", override_tensor=[r"blk\.5\.=cpu", r"blk\.5\.attn_q=cuda:1"])
    b = plan_for(index, "20b", override_tensor=[r"blk\.5\.attn_q=cuda:1", r"blk\.5\.=cpu"])
    assert a.device_of("blk.5.attn_q.weight") == "cpu"
    assert b.device_of("blk.5.attn_q.weight") == "cuda:1"
    assert b.device_of("blk.5.attn_k.weight") == "cpu"
    assert list(b.devices) == ["cuda:0", "cuda:1", "cpu"]


def test_token_embedding_ignores_overrides(index):
    p = plan_for(index, "20b", override_tensor=[".*=cuda:0"])
    assert p.device_of("token_embd.weight") == "cpu"


@pytest.mark.parametrize("ngl,gpu_layers,output_on_gpu", [
    (0, [], False), (1, [], True), (2, [23], True), (24, list(range(1, 24)), True),
    (25, list(range(24)), True), (None, list(range(24)), True)])
def test_ngl_counts_from_the_last_layer_with_output_as_one(index, ngl, gpu_layers, output_on_gpu):
    p = plan_for(index, "20b", n_gpu_layers=ngl)
    assert [i for i, d in enumerate(p.layer_devices) if d != "cpu"] == gpu_layers
    assert (p.device_of("output.weight") != "cpu") == output_on_gpu
    assert p.device_of("output_norm.weight") == p.device_of("output.weight")
    # a CPU layer keeps its experts and KV on the CPU too
    assert [i for i, d in enumerate(p.expert_devices) if d != "cpu"] == gpu_layers


def test_ngl_layers_kv_follows_attention(index):
    cfg, _ = index["20b"]
    p = plan_for(index, "20b", n_gpu_layers=24, ctx_size=1024)  # layer 0 (sliding) on the CPU
    swa_layer = min(1024, 128 + 512) * 2048
    assert p.devices["cpu"].kv_bytes == swa_layer
    assert p.devices["cuda:0"].kv_bytes == kv_bytes(24, 1024) - swa_layer


def test_overrides_apply_under_ngl_zero(index):
    p = plan_for(index, "20b", n_gpu_layers=0, override_tensor=["attn_q=cuda:0"])
    assert p.device_of("blk.0.attn_q.weight") == "cuda:0"
    assert p.device_of("blk.0.attn_k.weight") == "cpu"


def test_cpu_only_gpu_device_puts_everything_on_cpu(index):
    p = plan_for(index, "20b", gpu_device="cpu")
    assert {t.device for t in p.tensors} == {"cpu"}
    assert list(p.devices) == ["cpu"]
    assert p.devices["cpu"].compute.expert_upload == 0


def test_unknown_tensor_name_is_an_error(index):
    p = plan_for(index, "20b")
    with pytest.raises(PlacementError, match="not in the plan"):
        p.device_of("blk.0.nonexistent.weight")


@pytest.mark.parametrize("kw,msg", [
    (dict(n_parallel=0), "--parallel"), (dict(ctx_size=-5), "ctx-size"),
    (dict(fit=True, cpu_moe=True, vram_budget=10), "--fit chooses"),
    (dict(ctx_size=2, n_parallel=4), "slots"), (dict(gpu_device="gpu0"), "--gpu-device")])
def test_bad_options(index, kw, msg):
    with pytest.raises(PlacementError, match=msg):
        plan_for(index, "20b", **kw)


@pytest.mark.parametrize("kw,msg", [
    (dict(n_cpu_moe=-1), "--n-cpu-moe"), (dict(n_gpu_layers=-2), "-ngl"),
    (dict(vram_budget=0), "--vram-budget"), (dict(override_tensor="exps=CPU"), "list"),
    (dict(upload_buffers=-1), "--upload-buffers")])
def test_bad_placement_settings_name_the_flag(kw, msg):
    with pytest.raises(SettingsError, match=msg):
        PlacementSettings(**kw)


def test_fit_without_budget_or_cuda_says_what_to_pass(index, monkeypatch):
    monkeypatch.setattr(fit_mod, "cuda_free_bytes", lambda device: None)
    with pytest.raises(PlacementError, match="--vram-budget"):
        plan_for(index, "120b", fit=True)


def test_fit_default_budget_is_free_memory_minus_margin(index, monkeypatch):
    monkeypatch.setattr(fit_mod, "cuda_free_bytes", lambda device: 100 * GIB)
    p = plan_for(index, "120b", fit=True)
    assert p.n_gpu_expert_layers == 36
    assert "budget 99.00 GiB" in p.notes[0]


# --- bytes vs gpt-oss.md §7 ------------------------------------------------------------------
@pytest.mark.parametrize("preset,L,E", [("20b", 24, 32), ("120b", 36, 128)])
def test_cpu_moe_bytes_match_section_7(index, preset, L, E):
    p = plan_for(index, preset, cpu_moe=True, ctx_size=8192, n_parallel=2)
    gpu, cpu = p.devices["cuda:0"], p.devices["cpu"]
    assert gpu.weights_by_kind == non_expert_gpu_bytes(L, E)
    assert cpu.weights_by_kind == {"experts": expert_layer_bytes(E) * L, "embedding": V * H * 34 // 32}
    assert gpu.kv_bytes == kv_bytes(L, 4096, n_parallel=2)
    assert cpu.kv_bytes == 0
    assert p.ram.mmap_expert_bytes == expert_layer_bytes(E) * L
    assert gpu.compute.expert_upload == expert_layer_bytes(E)  # one upload buffer by default
    assert gpu.total_bytes == gpu.weights_bytes + gpu.kv_bytes + gpu.compute_bytes


def test_dense_weights_converted_on_gpu(index):
    # §7: attention 1.780 GiB and output head 1.079 GiB in BF16 for 120b; the CPU side unchanged.
    p = plan_for(index, "120b", cpu_moe=True, gpu_dense_dtype="bf16")
    w = p.devices["cuda:0"].weights_by_kind
    assert w["attention"] == 26_542_080 * 36 * 2 and round(w["attention"] / GIB, 3) == 1.780
    assert w["output"] == V * H * 2 and round(w["output"] / GIB, 3) == 1.079
    assert w["router"] == non_expert_gpu_bytes(36, 128)["router"]  # F32 stays F32
    assert p.devices["cpu"].weights_by_kind["embedding"] == V * H * 34 // 32
    f32 = plan_for(index, "120b", cpu_moe=True, gpu_dense_dtype="f32")
    assert f32.devices["cuda:0"].weights_by_kind["attention"] == 2 * w["attention"]
    with pytest.raises(SettingsError, match="gpu-dense-dtype"):
        plan_for(index, "120b", gpu_dense_dtype="q4")


def test_file_totals_match_section_7(index):
    # §7: 11.27 GiB (20b) and 59.02 GiB (120b) of tensor data.
    for preset, gib in (("20b", 11.27), ("120b", 59.02)):
        p = plan_for(index, preset)
        total = sum(t.nbytes for t in p.tensors)
        assert round(total / GIB, 2) == gib


def test_120b_kv_at_full_context(index):
    p = plan_for(index, "120b", cpu_moe=True, ctx_size=0)
    assert p.ctx_size == 131072
    # §7: 36,864 B/token over the 18 full layers -> 4.5 GiB at 128k, plus 18 sliding windows.
    assert p.devices["cuda:0"].kv_bytes == 36864 * 131072 + 18 * 640 * 2048
    assert round(36864 * 131072 / GIB, 2) == 4.5


def test_each_expert_layer_moved_adds_exactly_its_bytes(index):
    layer = expert_layer_bytes(128)
    assert round(layer / GIB, 2) == 1.58  # "~1.6 GiB" per 120b layer
    plans = [plan_for(index, "120b", n_cpu_moe=36 - g) for g in (0, 1, 2, 17, 35)]
    totals = [p.devices["cuda:0"].total_bytes for p in plans]
    # The first layer on the GPU also brings the GPU's routed-expert scratch (one micro-batch).
    scratch = 512 * 4 * (3 * 2880 + 2880) * 4
    assert plans[1].devices["cuda:0"].compute.experts == scratch
    assert totals[1] - totals[0] == layer + scratch
    assert totals[2] - totals[1] == layer
    assert totals[3] - totals[1] == 16 * layer
    assert totals[4] - totals[1] == 34 * layer


def test_120b_gpu_totals_in_the_field_range(index):
    # Field (llama-cpp-moe-offload.md §8): ~5 GB VRAM at a short context (measured, so with the
    # CUDA context, which the plan leaves out), ~8 GB with -c 0; all experts on the CPU.
    # docs/placement.md compares them term by term.
    short = plan_for(index, "120b", cpu_moe=True, ctx_size=4096).devices["cuda:0"].total_bytes
    full = plan_for(index, "120b", cpu_moe=True, ctx_size=0).devices["cuda:0"].total_bytes
    assert 3.5e9 < short < 5.5e9
    assert 7.5e9 < full < 9e9
    assert full - short == kv_bytes(36, 131072) - kv_bytes(36, 4096)


# --- fit -------------------------------------------------------------------------------------
def test_fit_picks_the_most_layers_that_fit(index):
    one = plan_for(index, "120b", n_cpu_moe=35).devices["cuda:0"].total_bytes
    layer = expert_layer_bytes(128)
    for budget_gib in (5.5, 6.0, 12.0, 22.0, 40.0):
        budget = int(budget_gib * GIB)
        want = 0 if budget < one else min(35, 1 + (budget - one) // layer)
        p = plan_for(index, "120b", fit=True, vram_budget=budget_gib, kv_dtype_bytes=2.0)
        assert p.n_gpu_expert_layers == want, budget_gib
        assert p.expert_devices == ["cpu"] * (36 - want) + ["cuda:0"] * want
        assert p.devices["cuda:0"].total_bytes <= budget
        assert p.options.placement.n_cpu_moe == 36 - want
        assert f"{want} of 36 expert layers" in p.notes[0]
        assert f"{want + 1} would need" in p.notes[0]


def test_fit_all_on_gpu_drops_the_upload_buffers(index):
    # With every layer on the GPU there is nothing to upload, so 36 layers can fit a budget
    # that 35 layers plus two upload buffers would not (the plan is not monotone at the end).
    full = plan_for(index, "120b").devices["cuda:0"].total_bytes
    p = plan_for(index, "120b", fit=True, vram_budget=full / GIB, upload_buffers=2, kv_dtype_bytes=2.0)
    assert p.n_gpu_expert_layers == 36
    assert plan_for(index, "120b", n_cpu_moe=1, upload_buffers=2).devices["cuda:0"].total_bytes > full


def test_fit_keeps_exact_numerics_before_adding_layers(index):
    # An f32 cache costs layers; --fit takes precision first, the f16 cache only when nothing
    # else fits with every expert on the CPU.
    kw = dict(ctx_size=131072, n_parallel=1, gpu_dense_dtype="auto")
    exact_lo = plan_for(index, "120b", n_cpu_moe=36, gpu_dense_dtype="stored", kv_dtype_bytes=4.0, ctx_size=131072)
    budget = exact_lo.devices["cuda:0"].total_bytes + 3 * expert_layer_bytes(128)
    p = plan_for(index, "120b", fit=True, vram_budget=budget / GIB, **kw)
    f16 = plan_for(index, "120b", fit=True, vram_budget=budget / GIB, kv_dtype_bytes=2.0, **kw)
    assert p.options.kv_dtype_bytes == 4.0 and f16.options.kv_dtype_bytes == 2.0
    assert p.n_gpu_expert_layers < f16.n_gpu_expert_layers
    assert p.devices["cuda:0"].total_bytes <= budget and p.notes[0].startswith("fit:")
    assert any(n.startswith("KV cache on the GPU: f32") for n in p.notes)
    small = exact_lo.devices["cuda:0"].total_bytes - 1
    q = plan_for(index, "120b", fit=True, vram_budget=small / GIB, **kw)
    assert q.options.kv_dtype_bytes == 2.0 and any("5e-4" in n for n in q.notes)


def test_fit_refuses_with_the_numbers(index):
    with pytest.raises(PlacementError, match=r"even with every expert on the CPU.*budget is 1.00 GiB"):
        plan_for(index, "120b", fit=True, vram_budget=1.0)


def test_fit_keeps_user_overrides(index):
    p = plan_for(index, "120b", fit=True, vram_budget=12.0,
                 override_tensor=[r"blk\.0\.ffn_.*_exps=cuda:0"])
    assert p.expert_devices[0] == "cuda:0"
    assert p.devices["cuda:0"].total_bytes <= 12 * GIB


def test_check_fits_names_the_numbers(index):
    p = plan_for(index, "120b", cpu_moe=True)
    gpu_total = p.devices["cuda:0"].total_bytes
    check_fits(p, vram_budget=gpu_total, ram_available=p.ram.total_bytes)
    with pytest.raises(PlacementError, match=r"cuda:0 needs .* > VRAM budget 2.00 GiB"):
        check_fits(p, vram_budget=2 * GIB)
    with pytest.raises(PlacementError, match=r"RAM: needs 57\.\d\d GiB .*available 24.00 GiB"):
        check_fits(p, ram_available=24 * GIB)


# --- the model consumes the plan -------------------------------------------------------------
def test_model_runs_under_a_cpu_plan_with_identical_logits(tiny_gguf):
    # Every device is `cpu` here (no CUDA), so this checks that the model asks the plan only for
    # names it has, and that a plan-driven load computes the same logits as the default one.
    from hybridmoe.models.gpt_oss import GptOss, SeqChunk

    mf = open_model(tiny_gguf)
    cfg = GptOssConfig.from_metadata(mf.metadata)
    plan = make_plan(cfg, mf.tensors, options(
        gpu_device="cpu", n_cpu_moe=2, override_tensor=[r"blk\.3\.attn_q=cpu"]))
    asked = []

    class Recording:
        def device_of(self, name: str) -> str:
            asked.append(name)
            return plan.device_of(name)

    ids = list(range(1, 40))
    out = []
    for placement in (None, Recording()):
        model = GptOss(mf, placement)
        out.append(model.forward([SeqChunk(model.make_cache(64), ids)], all_logits=True))
    assert "blk.0.attn_q.weight" in asked and "output.weight" in asked
    ref, got = out
    assert got.shape == ref.shape == (len(ids), cfg.vocab_size)
    assert (got - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item())


# --- output ----------------------------------------------------------------------------------
def test_json_has_the_contract_schema(index):
    p = plan_for(index, "120b", cpu_moe=True)
    out = json.loads(json.dumps(p.to_json()))
    for dev in ("cuda:0", "cpu"):
        d = out["devices"][dev]
        assert d["total_bytes"] == d["weights_bytes"] + d["kv_bytes"] + d["compute_bytes"]
    assert len(out["tensors"]) == len(index["120b"][1])
    t = next(t for t in out["tensors"] if t["name"] == "blk.0.ffn_up_exps.weight")
    assert (t["device"], t["type"], t["bytes"]) == ("cpu", "MXFP4", H * H * 128 * 17 // 32)


def test_report_lists_each_device_and_the_ram_side(index):
    text = format_plan(plan_for(index, "120b", cpu_moe=True), ram_available=24 * GIB)
    assert "cuda:0" in text and "mmap'd experts 56.879 GiB" in text
    assert "DOES NOT FIT" in text


@pytest.mark.parametrize("kw,want", [
    (dict(n_cpu_moe=20), ["stream"] * 20 + ["gpu"] * 16),
    (dict(n_cpu_moe=20, upload_buffers=0), ["staged"] * 20 + ["gpu"] * 16),
    (dict(n_gpu_layers=10, override_tensor=[r"blk\.(3[0-5])\.ffn_.*_exps=cpu"]),
     ["cpu"] * 27 + ["gpu"] * 3 + ["stream"] * 6),
])
def test_report_shows_the_expert_backend_of_each_layer(index, kw, want):
    from hybridmoe.placement.report import format_layers

    p = plan_for(index, "120b", **kw)
    assert p.expert_backends == want
    text = format_plan(p)
    for row in format_layers(p):
        assert row in text
    assert "0-19      cuda:0      stream" in format_plan(plan_for(index, "120b", n_cpu_moe=20))


def _run_cli(capsys, path: str, *flags: str) -> tuple[int, str, str]:
    from hybridmoe.cli import main

    rc = main(["plan", "-m", path, *flags])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_json_table_fit_and_errors(sparse_files, capsys):
    rc, out, err = _run_cli(capsys, sparse_files["120b"], "--cpu-moe", "-c", "0", "--json")
    assert rc == 0, err
    data = json.loads(out)
    assert set(data["devices"]) == {"cuda:0", "cpu"}
    # serve's defaults: -c 0 = 131072 tokens split over -np 4 slots
    assert data["devices"]["cuda:0"]["kv_bytes"] == kv_bytes(36, 32768, n_parallel=4)
    assert {"name", "device", "type", "bytes"} <= set(data["tensors"][0])
    rc, out, err = _run_cli(capsys, sparse_files["120b"], "--fit", "--vram-budget", "24")
    assert rc == 0, err
    assert "of 36 expert layers on the GPU" in out and "TOTAL" in out
    rc, out, _ = _run_cli(capsys, sparse_files["120b"], "--n-cpu-moe", "30", "--vram-budget", "4")
    assert rc == 1 and "> VRAM budget 4.00 GiB" in out
    rc, _, err = _run_cli(capsys, sparse_files["120b"], "-ot", "blk.(=CPU")
    assert rc == 2 and "invalid regex" in err


def test_cli_plans_serves_numerics(sparse_files, capsys):
    # The default plans float32 weights and cache when the budget holds them; --fast-math plans
    # bf16 / f16; --kv-bytes fixes the cache.
    f = sparse_files["120b"]
    plans = {}
    for name, extra in (("exact", ()), ("fast", ("--fast-math",)), ("kv2", ("--kv-bytes", "2"))):
        rc, out, err = _run_cli(capsys, f, "--cpu-moe", "-c", "4096", "-np", "1", "--vram-budget", "8", "--json",
                                *extra)
        assert rc == 0, err
        plans[name] = json.loads(out)
    opts = {k: (p["options"]["placement"]["gpu_dense_dtype"], p["options"]["kv_dtype_bytes"], p["options"]["fast_math"])
            for k, p in plans.items()}
    assert opts == {"exact": ("f32", 4.0, False), "fast": ("bf16", 2.0, True), "kv2": ("f32", 2.0, False)}
    kv = {k: p["devices"]["cuda:0"]["kv_bytes"] for k, p in plans.items()}
    assert kv["exact"] == 2 * kv["fast"] == 2 * kv["kv2"]


def test_cli_json_lists_each_layers_devices_and_expert_backend(sparse_files, capsys):
    rc, out, err = _run_cli(capsys, sparse_files["120b"], "--n-cpu-moe", "20", "-ot", r"blk\.35\.attn_=cpu",
                            "--upload-buffers", "0", "--json")
    assert rc == 0, err
    layers = json.loads(out)["layers"]
    assert [x["layer"] for x in layers] == list(range(36))
    assert [x["expert_backend"] for x in layers] == ["staged"] * 20 + ["gpu"] * 16
    assert [x["experts"] for x in layers] == ["cpu"] * 20 + ["cuda:0"] * 16
    assert [x["attention"] for x in layers] == ["cuda:0"] * 35 + ["cpu"]
    # The same per-layer backends as the table, which the plain output prints.
    rc, out, err = _run_cli(capsys, sparse_files["120b"], "--n-cpu-moe", "20", "--upload-slots", "0")
    assert rc == 0, err
    assert "0-19      cuda:0      staged" in out and "20-35     cuda:0      gpu" in out


def test_placement_and_plan_command_modules_do_not_import_torch():
    # The command's own import chain must stay torch-free (the config class it reads is the
    # model module's business).
    code = ("import sys, hybridmoe.placement, hybridmoe.placement.report, hybridmoe.commands.plan; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_cli_plan_takes_the_cache_type_flags(sparse_files, capsys):
    # -ctk/-ctv fix the cache as --kv-bytes does; --kv-bytes wins when both are given.
    f = sparse_files["120b"]
    got = {}
    for extra in ((), ("-ctk", "f16", "-ctv", "f16"), ("-ctk", "q8_0"), ("-ctk", "f16", "--kv-bytes", "4")):
        rc, out, err = _run_cli(capsys, f, "--cpu-moe", "-c", "4096", "-np", "1", "--vram-budget", "40", "--json",
                                *extra)
        assert rc == 0, err
        got[extra] = json.loads(out)["options"]["kv_dtype_bytes"]
    assert list(got.values()) == [4.0, 2.0, 2.0, 4.0]
