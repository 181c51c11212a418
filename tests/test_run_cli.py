"""`ingot run`, `ingot perplexity` and `ingot model synth|info` end to end through main(): output, exit codes,
one-line errors."""

import json
import subprocess
import sys

import pytest
from model_fixtures import rewrite_gguf

from ingot.runtime.model import fetch
from ingot.runtime.model.gguf import load_model

WORDS = "the capital of France is Paris and the answer to the question is four or five".split()


# --- the real model -----------------------------------------------------------------------------------


def test_greedy_raw_prompt_continues_with_paris(ingot, real_model_path):
    code, out, err = ingot("run", real_model_path, "-p", "The capital of France is", "-n", "4", "--device", "cpu")
    assert code == 0, err
    assert out.startswith(" Paris")
    assert "tok/s" in err and "prompt 5 tokens" in err  # no BOS: SmolLM2's add_bos_token is False


def test_chat_answers_two_plus_two(ingot, real_model_path):
    code, out, err = ingot("run", real_model_path, "--chat", "-p", "What is 2+2?", "-n", "48", "--device", "cpu")
    assert code == 0, err
    assert "4" in out and "<|im_end|>" not in out
    assert "finish: eos" in err


def test_model_name_resolves_to_the_cached_model(ingot, real_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path))
    fetch.model_path("smollm2").parent.mkdir(parents=True)
    fetch.model_path("smollm2").symlink_to(real_model_path)  # already cached and verified: no download
    code, out, err = ingot("run", "smollm2", "-p", "The capital of France is", "-n", "2", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["text"].startswith(" Paris") and result["completion_tokens"] == 2
    assert result["finish_reason"] == "length" and result["prompt_tokens"] == 5


# --- the tiny synthetic model ------------------------------------------------------------------------


def _sample(ingot, model, seed):
    code, out, err = ingot(
        "run",
        model,
        "-p",
        "the capital of",
        "-n",
        "20",
        "--temp",
        "1",
        "--top-k",
        "0",
        "--top-p",
        "1",
        "--min-p",
        "0",
        "--seed",
        seed,
        "--json",
    )
    assert code == 0, err
    return json.loads(out)["text"]


def test_same_seed_same_text(ingot, tiny_model_path):
    a, b, c = (_sample(ingot, tiny_model_path, s) for s in (1, 1, 2))
    assert a == b and a != c


def test_stop_string_is_not_printed(ingot, tiny_model_path):
    code, out, _ = ingot("run", tiny_model_path, "-p", "the capital of", "-n", "30", "--json")
    text = json.loads(out)["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    code, out, err = ingot("run", tiny_model_path, "-p", "the capital of", "-n", "30", "--stop", stop)
    assert code == 0, err
    assert out == text[: text.index(stop)] + "\n" and "finish: stop" in err


def test_perplexity_prints_llama_cpp_lines(ingot, tiny_model_path, tmp_path):
    text = tmp_path / "words.txt"
    text.write_text(" ".join(WORDS * 20))
    code, out, err = ingot("perplexity", tiny_model_path, "-f", text, "-c", "64", "-b", "16")
    assert code == 0, err
    running, final = out.strip().splitlines()
    values = [float(v.split("]")[1]) for v in running.rstrip(",").split(",")]
    assert (
        running.startswith("[1]")
        and len(values)
        == json.loads(ingot("perplexity", tiny_model_path, "-f", text, "-c", "64", "--json")[1])["n_chunks"]
    )
    assert final.startswith("Final estimate: PPL = ") and f"{values[-1]:.4f}" in final


def test_model_synth_and_info(ingot, tmp_path):
    out_path = tmp_path / "m.gguf"
    code, out, err = ingot("model", "synth", "--shape", "tiny-qwen2", "--quant", "Q8_0", "--out", out_path, "--seed", 3)
    assert code == 0, err
    assert out.strip() == str(out_path)
    assert load_model(out_path).quant_types == ["F32", "Q8_0"]
    code, out, err = ingot("model", "info", out_path, "--json")
    info = json.loads(out)
    assert code == 0 and info["config"]["arch"] == "qwen2" and info["config"]["qkv_bias"] is True
    assert info["tokenizer"]["n_tokens"] == 512 and info["n_tensors"] == 2 + 1 + 2 * 12
    code, out, _ = ingot("model", "info", out_path)
    assert code == 0 and "rope_neox" in out


# --- bad input: one line, a documented exit code, no traceback ----------------------------------------


def _one_line_error(err):
    assert "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def bad_models(tmp_path_factory, synth_model):
    folder = tmp_path_factory.mktemp("bad")
    tiny = synth_model("tiny", "Q4_1")
    (folder / "text.gguf").write_text("this is not a model\n" * 20)
    (folder / "cut.gguf").write_bytes(tiny.read_bytes()[:50_000])
    rewrite_gguf(tiny, folder / "gpt2.gguf", arch="gpt2")
    rewrite_gguf(tiny, folder / "iq2.gguf", replace={"token_embd.weight": ("IQ2_XXS", (512, 256), bytes(512 * 66))})
    return folder


@pytest.mark.parametrize(
    "name, code, message",
    [
        ("missing.gguf", 2, "model file not found"),
        ("text.gguf", 5, "not a GGUF file"),
        ("cut.gguf", 5, "truncated"),
        ("gpt2.gguf", 5, "unsupported architecture 'gpt2'"),
        ("iq2.gguf", 5, "tensor token_embd.weight has unsupported type IQ2_XXS"),
    ],
)
def test_bad_models_exit_with_documented_codes(ingot, bad_models, name, code, message):
    got, out, err = ingot("run", bad_models / name, "-p", "hi")
    assert got == code and message in _one_line_error(err) and out == ""


def test_prompt_longer_than_the_context_is_a_usage_error(ingot, tiny_model_path):
    code, _, err = ingot("run", tiny_model_path, "-p", " the" * 300)  # tiny's context is 256
    assert code == 2 and "prompt is 300 tokens, longer than the context of 256" in _one_line_error(err)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--temp", "-1"], "temp"),
        (["--top-p", "0"], "top_p must be in (0, 1]"),
        (["--device", "tpu"], "device"),
        (["-n", "0"], "max-tokens"),
    ],
)
def test_bad_arguments_are_usage_errors(ingot, tiny_model_path, args, message):
    code, _, err = ingot("run", tiny_model_path, "-p", "hi", *args)
    assert code == 2 and message in err and "Traceback" not in err


def test_devices(ingot, tiny_model_path, tiny_model):
    from ingot.runtime.engines import open_engine
    from ingot.runtime.engines.cpu import CpuEngine
    from ingot.runtime.gpu.probe import probe

    assert isinstance(open_engine(tiny_model, "cpu"), CpuEngine)
    if not probe().gpus:
        assert isinstance(open_engine(tiny_model, "auto"), CpuEngine)
    # head_dim 16 is not one the GPU kernels take: refused as incompatible, with or without a GPU
    code, _, err = ingot("run", tiny_model_path, "-p", "hi", "--device", "cuda")
    assert code == 3 and "--device cpu" in _one_line_error(err)


def test_perplexity_bad_input(ingot, tiny_model_path, tmp_path):
    code, _, err = ingot("perplexity", tiny_model_path, "-f", tmp_path / "none.txt")
    assert code == 2 and "text file not found" in _one_line_error(err)
    short = tmp_path / "short.txt"
    short.write_text("the capital")
    code, _, err = ingot("perplexity", tiny_model_path, "-f", short, "-c", "64")
    assert code == 2 and "needs at least 128 tokens" in _one_line_error(err)


def test_errors_through_a_real_process(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_text("nope")
    for model, code in ((tmp_path / "missing.gguf", 2), (bad, 5)):
        p = subprocess.run(
            [sys.executable, "-m", "ingot", "run", str(model), "-p", "hi"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert p.returncode == code and p.stdout == ""
        _one_line_error(p.stderr)


# --- bundles (packed with the bundle tests' kernels) ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bundle(tmp_path_factory, kernel_dir, tiny_model_path):
    from ingot.toolchain.pack import pack

    out = tmp_path_factory.mktemp("bundles") / "tiny.ingot"
    pack(tiny_model_path, kernels=kernel_dir, out=out, selftest=False)
    return out


def test_run_a_bundle_like_its_gguf(ingot, tiny_bundle, tiny_model_path, stamp_cache):
    args = ["-p", "the capital of", "-n", "8", "--device", "cpu", "--json"]
    code, out, err = ingot("run", tiny_bundle, *args)
    assert code == 0, err
    assert json.loads(out)["text"] == json.loads(ingot("run", tiny_model_path, *args)[1])["text"]


def test_tampered_bundle_is_refused_unless_allowed(ingot, tiny_bundle, copy_of, stamp_cache):
    import tarfile

    from bundle_fixtures import flip_byte

    bad = copy_of(tiny_bundle)
    with tarfile.open(bad) as tar:
        gguf_member = next(m for m in tar.getmembers() if m.name.endswith(".gguf"))
    flip_byte(bad, gguf_member.offset_data + gguf_member.size - 10)  # a weight byte
    code, _, err = ingot("run", bad, "-p", "hi", "-n", "2", "--device", "cpu")
    assert code == 4 and "Traceback" not in err
    code, _, err = ingot("run", bad, "-p", "hi", "-n", "2", "--device", "cpu", "--allow-unverified")
    assert code == 0 and "WARNING" in err
