"""The GPU paths of the CLI, end to end, on a bundle built for this machine's GPU:

- `ingot verify --device` runs the bundle's self-test on the GPU: it passes on an intact bundle, and exits 4 when
  the recorded CPU reference (a logit, the argmax) disagrees with what the GPU computes;
- `ingot run BUNDLE --device cuda` loads the bundle's OWN fatbins: it runs with $INGOT_KERNELS pointing at an empty
  folder, the Kernels it loads are byte for byte the bundle's, and a bundle whose fatbins hold only another GPU
  generation's SASS is refused (exit 3) although $INGOT_KERNELS holds kernels that run here;
- `ingot bench --device cuda` reports well-formed JSON for every test it ran;
- `ingot serve BUNDLE --device cuda` answers the official openai client with the greedy text of `ingot run`.

The model is `ingot model synth --shape smollm2-135m --quant Q4_0` (SmolLM2's shape, random weights, a real
tokenizer): its head_dim 64 runs on the GPU engine, and at the self-test position its top two logits are 0.45
apart (about 6% of the top logit), while the GPU engine's logits are within ~1e-3 relative of the CPU
reference's, so the argmax the self-test compares cannot flip on rounding (the fixture checks that margin).
"""

from __future__ import annotations

import copy
import json
import math

import openai
import pytest
from bundle_fixtures import run_cli
from server_fixtures import ServerProcess

from ingot.runtime.gpu.probe import probe

PROMPT = "The capital of France is"
MARGIN = 0.2  # logits: the self-test model's top-two gap must exceed this (rounding noise is ~0.01)


@pytest.fixture(scope="module")
def cc() -> int:
    return probe().gpus[0].cc


def _build(tmp_path_factory, archs: str):
    from ingot.toolchain.archs import parse_arch_list
    from ingot.toolchain.build import build
    from ingot.toolchain.nvcc import find_toolkit

    if find_toolkit() is None:
        pytest.fail("the GPU CLI tests need nvcc to build kernels for this GPU (see tests/gpu/device_env.sh)")
    out = tmp_path_factory.mktemp("kernels")
    build(archs=parse_arch_list(archs), out_dir=out)
    return out


@pytest.fixture(scope="module")
def local_kernels(tmp_path_factory, cc):
    """Kernels for exactly this GPU: SASS sm_<cc>, no PTX."""
    return _build(tmp_path_factory, f"sm_{cc}")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from ingot.runtime.model.synth import synthesize

    return synthesize("smollm2-135m", "Q4_0", tmp_path_factory.mktemp("models") / "smol-synth.gguf", seed=0)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, model, local_kernels):
    """The model packed with this GPU's kernels and its self-test record."""
    from ingot.toolchain.pack import pack

    out = tmp_path_factory.mktemp("bundles") / "smol-synth.ingot"
    pack(model, kernels=local_kernels, out=out, selftest=True)
    st = _manifest(out)["selftest"]
    assert st["top_logits"][0] - st["top_logits"][1] > MARGIN, (
        f"the self-test model's top logits are too close for an argmax check: {st['top_logits'][:3]}"
    )
    return out


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("INGOT_CACHE_DIR", str(tmp_path / "cache"))  # verified-stamps, never the user's cache


def _manifest(bundle) -> dict:
    from ingot.runtime.bundle.open import open_bundle

    return open_bundle(bundle).manifest


def _cli(monkeypatch, capsys, *args):
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert "Traceback" not in err, err
    return code, out, err


# --- verify --device ---------------------------------------------------------------------------------


def test_verify_device_passes_on_an_intact_bundle(monkeypatch, capsys, bundle):
    code, out, err = _cli(monkeypatch, capsys, "verify", bundle, "--device", "--json")
    assert code == 0, err
    report = json.loads(out)
    st, recorded = report["selftest"], _manifest(bundle)["selftest"]
    assert report["ok"] and st["argmax"] == st["expected_argmax"] == recorded["argmax"]
    assert st["top_rel_err"] < 1e-2  # runtime/selftest.py's TOLERANCE
    assert abs(st["logsumexp"] - recorded["logsumexp"]) < 0.05 and st["tokens"] == len(recorded["tokens"])


@pytest.fixture(scope="module")
def recorded_selftest(bundle) -> dict:
    return _manifest(bundle)["selftest"]


def _pack_with_selftest(monkeypatch, tmp_path, model, kernels, record: dict):
    """A bundle sealed by the pack code itself (consistent root digest) around the given self-test record."""
    import ingot.toolchain.pack as pack_mod

    monkeypatch.setattr(pack_mod, "record_selftest", lambda path: copy.deepcopy(record))
    out = tmp_path / "edited.ingot"
    pack_mod.pack(model, kernels=kernels, out=out, selftest=True)
    return out


@pytest.mark.parametrize(
    "edit, says",
    [
        # +3 on the top logit: a relative L2 error over the top 32 of ~3 / (7 * sqrt(32)) = 7.6e-2, past 1e-2
        (lambda st: st["top_logits"].__setitem__(0, st["top_logits"][0] + 3.0), "logits differ"),
        (lambda st: st.__setitem__("argmax", st["top_ids"][1]), "argmax"),
        (lambda st: st.__setitem__("logsumexp", st["logsumexp"] + 1.0), "log-sum-exp"),
    ],
    ids=["top logit", "argmax", "logsumexp"],
)
def test_verify_device_fails_when_the_gpu_disagrees_with_the_record(
    monkeypatch, capsys, tmp_path, model, local_kernels, recorded_selftest, edit, says
):
    record = copy.deepcopy(recorded_selftest)
    edit(record)
    edited = _pack_with_selftest(monkeypatch, tmp_path, model, local_kernels, record)
    code, _, err = _cli(monkeypatch, capsys, "verify", edited)
    assert code == 0, f"the edited bundle must still verify on disk (its root covers the edit): {err}"
    code, _, err = _cli(monkeypatch, capsys, "verify", edited, "--device")
    assert code == 4 and "self-test failed" in err and says in err, err


def test_verify_device_without_a_selftest_record_is_a_usage_error(monkeypatch, capsys, tmp_path, model, local_kernels):
    from ingot.toolchain.pack import pack

    out = tmp_path / "noselftest.ingot"
    pack(model, kernels=local_kernels, out=out, selftest=False)
    code, _, err = _cli(monkeypatch, capsys, "verify", out, "--device")
    assert code == 2 and "--no-selftest" in err


# --- the bundle's own fatbins ---------------------------------------------------------------------------


def test_run_loads_the_bundles_own_fatbins(monkeypatch, capsys, tmp_path, bundle):
    from ingot.runtime.bundle.open import open_bundle
    from ingot.runtime.gpu import kernels as K

    empty = tmp_path / "no-kernels"
    empty.mkdir()
    monkeypatch.setenv("INGOT_KERNELS", str(empty))  # kernel_images() would fail: only the bundle's remain
    loaded = []
    original = K.Kernels.__init__

    def spy(self, device, images):
        loaded.append(dict(images))
        original(self, device, images)

    monkeypatch.setattr(K.Kernels, "__init__", spy)
    code, out, err = _cli(monkeypatch, capsys, "run", bundle, "-p", PROMPT, "-n", "8", "--device", "cuda", "--json")
    assert code == 0, err
    result = json.loads(out)
    assert result["engine"] == "CudaEngine" and result["completion_tokens"] >= 1
    assert loaded == [open_bundle(bundle).fatbins]


def test_a_bundle_for_another_gpu_is_refused_even_with_good_INGOT_KERNELS(
    monkeypatch, capsys, tmp_path_factory, model, local_kernels, cc
):
    from ingot.toolchain.nvcc import find_toolkit
    from ingot.toolchain.pack import pack

    other = next(t for t in find_toolkit().targets if t // 10 != cc // 10)
    foreign = pack(
        model,
        kernels=_build(tmp_path_factory, f"sm_{other}"),
        out=tmp_path_factory.mktemp("bundles") / "foreign.ingot",
        selftest=False,
    )["bundle"]
    monkeypatch.setenv("INGOT_KERNELS", str(local_kernels))  # would run here, if the runtime fell back to them
    code, _, err = _cli(monkeypatch, capsys, "run", foreign, "-p", PROMPT, "-n", "4", "--device", "cuda")
    assert code == 3 and f"sm_{other}" in err, err


# --- bench ------------------------------------------------------------------------------------------------


def test_bench_reports_sane_json(monkeypatch, capsys, bundle, model):
    from ingot.runtime.model.gguf import load_model

    code, out, err = _cli(
        monkeypatch,
        capsys,
        "bench",
        bundle,
        "-p",
        "64",
        "-n",
        "8",
        "-r",
        "2",
        "--batch",
        "1,4",
        "--device",
        "cuda",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    results = {r["test"]: r for r in report["results"]}
    assert list(results) == ["pp64", "tg8", "tg8@b4", "cold start (spawn -> first token)"]
    assert [results[t]["n_tokens"] for t in results] == [64, 8, 32, 1]
    assert [r["reps"] for r in report["results"]] == [2, 2, 2, 3]
    for r in report["results"]:
        assert r["ms_mean"] > 0 and math.isfinite(r["ms_mean"]) and r["tok_s_std"] >= 0, r
        assert r["tok_s_mean"] > 0 and math.isfinite(r["tok_s_mean"]), r
    m = load_model(model)
    assert report["model"]["backend"] == "cuda" and report["model"]["arch"] == "llama"
    assert report["model"]["params"] == m.n_params and report["model"]["quant_types"] == m.quant_types
    g = report["gpu"]
    assert g["device"] in {gpu.name for gpu in probe().gpus}
    # the weights are part of what the engine allocated, which is part of what the device has in use
    assert 0 < g["weights_bytes"] <= g["engine_bytes"] <= g["device_used_bytes"] and g["kv_pages"] > 0
    # on a GPU the ceilings table knows, every throughput figure carries its share of the hardware's limit: a
    # physical fraction (a share above 1 would mean the byte or FLOP count undercounts the work)
    if "ceiling" in report:
        for r in report["results"][:-1]:
            assert r["bound"] == ("compute" if r["test"].startswith("pp") else "memory"), r
            assert 0 < r["ceiling_share"] < 1, r


# --- serve --device cuda ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpu_server(bundle):
    s = ServerProcess(bundle, "--device", "cuda").wait_ready()
    yield s
    s.stop()


def _run_text(monkeypatch, capsys, bundle, *args) -> str:
    code, out, err = _cli(monkeypatch, capsys, "run", bundle, "-n", "16", "--device", "cuda", "--json", *args)
    assert code == 0, err
    return json.loads(out)["text"]


def test_serve_cuda_greedy_equals_run(monkeypatch, capsys, gpu_server, bundle):
    client = openai.OpenAI(base_url=f"{gpu_server.url}/v1", api_key="unused", max_retries=0)
    model_id = client.models.list().data[0].id
    question = "What is the capital of France?"
    chat = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=16
    )
    assert chat.choices[0].message.content == _run_text(monkeypatch, capsys, bundle, "--chat", "-p", question)
    text = client.completions.create(model=model_id, prompt=PROMPT, temperature=0, max_tokens=16)
    assert text.choices[0].text == _run_text(monkeypatch, capsys, bundle, "-p", PROMPT)
    stream = client.chat.completions.create(
        model=model_id, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=16, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
