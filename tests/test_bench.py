"""`ingot bench`: the tests it runs (depths, batches), its errors, and the arithmetic of its "share of the ceiling"
column (bytes a decode step reads, FLOPs a prefill costs, which GPU row applies). The timings themselves are
proven on the H200, not here."""

import json
import math

import pytest

from ingot.runtime.bench import (
    KV_BYTES,
    Result,
    ceiling_share,
    decode_step_bytes,
    prefill_flops,
)
from ingot.runtime.gpu.ceilings import Ceiling, ceiling_for
from ingot.runtime.model.gguf import load_model


def test_cpu_bench_runs_every_test_at_every_depth(ingot, synth_model):
    path = synth_model("tiny", "Q8_0")
    code, out, err = ingot(
        "bench", path, "-p", "12,8", "-n", "2", "-r", "1", "--batch", "1,2", "-d", "0,24", "--device", "cpu",
        "--no-cold-start", "--json",
    )  # fmt: skip
    assert code == 0, err
    results = json.loads(out)["results"]
    names = [r["test"] for r in results]
    assert names == ["pp8", "pp12", "tg2", "tg2@b2", "pp8@d24", "pp12@d24", "tg2@d24", "tg2@b2@d24"]
    assert [r["depth"] for r in results] == [0, 0, 0, 0, 24, 24, 24, 24]
    assert [r["batch"] for r in results] == [1, 1, 1, 2, 1, 1, 1, 2]
    assert [r["n_tokens"] for r in results[:2]] == [8, 12]
    assert all(r["tok_s_mean"] > 0 for r in results)
    assert all(r["ceiling_share"] is None for r in results)  # no GPU ceiling for the CPU engine


def test_pp_lengths_do_not_serve_each_other_from_the_prefix_cache(ingot, synth_model):
    # one seed's token stream starts the same whatever its length: pp96 drawn like pp64 would find pp64's first two
    # pages cached (the pool of 8 sequences keeps them) and time 32 computed tokens as 96
    code, out, err = ingot(
        "bench", synth_model("tiny", "Q8_0"), "-p", "64,96", "-n", "0", "-r", "2", "--batch", "8", "--device", "cpu",
        "--no-cold-start", "--json",
    )  # fmt: skip
    assert code == 0, err
    report = json.loads(out)
    assert [r["test"] for r in report["results"]] == ["pp64", "pp96"]
    assert report["prefix_cache"]["queried_tokens"] > 0 and report["prefix_cache"]["hit_tokens"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-d", "x"], "--depth 'x' is not a list of integers"),
        (["-d", "-5"], "--depth values must be >= 0"),
        (["--batch", "0"], "--batch values must be >= 1"),
        (["--batch", "1,a"], "--batch '1,a' is not a list of integers"),
        (["-p", "512,2k"], "-p '512,2k' is not a list of integers"),
        (["-p", "-1"], "-p values must be >= 0"),
        (["-p", "0", "--prefix", "8"], "--prefix times a pp test, and -p 0 asks for none"),
        (["-p", "64,16", "--prefix", "16"], "--prefix 16 leaves no prompt tokens to compute in pp16"),
        # the CPU engine's KV cache for the deepest test (tiny: 512 bytes a token) checked before it is mapped
        (["-p", "1000000000", "-n", "0"], "GiB of KV cache a sequence on the CPU, more than this machine's"),
        (["-d", "0,1000000000"], "GiB of KV cache a sequence on the CPU, more than this machine's"),
    ],
)
def test_bad_lists_are_one_line_usage_errors(ingot, synth_model, args, message):
    code, out, err = ingot("bench", synth_model("tiny", "Q8_0"), "--device", "cpu", "--no-cold-start", *args)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


# --- the ceilings table ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cc", "expected"),
    [
        ("NVIDIA H200", 90, "NVIDIA H200"),
        ("NVIDIA H100 80GB HBM3", 90, "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", 90, "NVIDIA H100 PCIe"),  # the more specific row wins over "H100"
        ("NVIDIA A100-SXM4-80GB", 80, "NVIDIA A100 80GB SXM"),
        ("NVIDIA A100-PCIE-40GB", 80, "NVIDIA A100 40GB"),
        ("NVIDIA GeForce RTX 4090", 89, "NVIDIA GeForce RTX 4090"),
        ("NVIDIA H200", 80, None),  # a name with the wrong compute capability is not trusted
        ("NVIDIA Tesla T4", 75, None),
    ],
)
def test_ceiling_rows_match_by_name_and_compute_capability(name, cc, expected):
    row = ceiling_for(name, cc)
    assert (row.gpu if row else None) == expected


def test_the_h200_row_is_the_measured_one():
    row = ceiling_for("NVIDIA H200", 90)
    assert row is not None and row.source == "measured"
    assert row.memory_bytes_s == pytest.approx(4.3e12) and row.tensor_flop_s == pytest.approx(790e12)


# --- bytes and FLOPs ------------------------------------------------------------------------------


def _matrix_bytes(model, tied_head: str) -> int:
    blk = sum(t.nbytes for n, t in model.tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    return blk + model.tensors[tied_head].nbytes


def test_decode_bytes_are_every_matrix_once_plus_each_sequence_kv(synth_model):
    m = load_model(synth_model("tiny", "Q8_0"))  # tied: the head is token_embd
    c = m.config
    weights = _matrix_bytes(m, "token_embd.weight")
    kv_pos = 2 * c.n_kv_heads * c.head_dim * KV_BYTES * c.n_layers
    assert decode_step_bytes(m, []) == weights
    assert decode_step_bytes(m, [10]) == weights + 10 * kv_pos
    # the batch shares the weights but not the caches
    assert decode_step_bytes(m, [10, 30]) == weights + 40 * kv_pos


def test_untied_models_read_the_output_matrix(synth_model):
    m = load_model(synth_model("tiny-qwen2", "Q8_0"))
    assert "output.weight" in m.tensors
    assert decode_step_bytes(m, []) == _matrix_bytes(m, "output.weight")


def test_sliding_window_layers_stop_growing_at_the_window(synth_model):
    m = load_model(synth_model("tiny-gemma3", "Q8_0"))
    c = m.config
    w = c.sliding_window
    n_global = sum(1 for i in range(c.n_layers) if not c.layer_window(i))
    n_local = c.n_layers - n_global
    assert w > 0 and n_local > 0
    kv = 2 * c.n_kv_heads * c.head_dim * KV_BYTES
    below = decode_step_bytes(m, [w]) - decode_step_bytes(m, [w - 1])
    above = decode_step_bytes(m, [w + 11]) - decode_step_bytes(m, [w + 10])
    assert below == c.n_layers * kv  # every layer still takes the new position
    assert above == n_global * kv  # past the window only the global layers grow


def test_prefill_flops_count_weights_and_causal_attention(synth_model):
    m = load_model(synth_model("tiny", "Q8_0"))
    c = m.config
    layer_params = sum(math.prod(t.shape) for n, t in m.tensors.items() if n.startswith("blk.") and len(t.shape) == 2)
    head = 2 * math.prod(m.tensors["token_embd.weight"].shape)
    per_pair = 4 * c.n_heads * c.head_dim * c.n_layers  # q.k and p.v for every query head, every layer
    # three tokens after five cached ones attend to 6, 7 and 8 positions
    assert prefill_flops(m, 3, depth=5) == 2 * 3 * layer_params + head + per_pair * (6 + 7 + 8)
    assert prefill_flops(m, 1) == 2 * layer_params + head + per_pair


def _result(test: str, tok_s: float, n_tokens: int, batch: int = 1, depth: int = 0) -> Result:
    return Result(test, n_tokens, 1, tok_s, 0.0, 1000 * n_tokens / tok_s, depth, batch)


def test_share_is_one_exactly_at_the_ceiling(synth_model):
    m = load_model(synth_model("tiny", "Q8_0"))
    ceiling = Ceiling("test GPU", 1e12, 1e14, "measured")
    n_gen, batch = 16, 4
    contexts = [1 + 7 * i + n_gen // 2 for i in range(batch)]  # mid-run contexts of bench's tg test
    steps_s = ceiling.memory_bytes_s / decode_step_bytes(m, contexts)
    bound, share = ceiling_share(m, _result("tg16@b4", steps_s * batch, n_gen * batch, batch), ceiling, n_gen)
    assert bound == "memory" and share == pytest.approx(1.0)
    tok_s = ceiling.tensor_flop_s / prefill_flops(m, 64) * 64
    bound, share = ceiling_share(m, _result("pp64", tok_s, 64), ceiling, n_gen)
    assert bound == "compute" and share == pytest.approx(1.0)
    bound, share = ceiling_share(m, _result("pp64", tok_s / 4, 64), ceiling, n_gen)
    assert share == pytest.approx(0.25)
