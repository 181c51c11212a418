"""Deliverable 5 of issue #13: a run-time trust policy (--pubkey, repeatable, and INGOT_TRUSTED_KEYS).

With a policy, `ingot run/serve/bench` only run a bundle signed by one of the trusted keys (exit 4 otherwise,
a bare GGUF included); without one, an unsigned bundle runs with a one-line notice on stderr."""

from __future__ import annotations

import json

import pytest
from measure import one_line

RUN = ["-p", "hi", "-n", "2", "--device", "cpu", "--json"]


@pytest.fixture(scope="module")
def tiny_bundles(tmp_path_factory, kernel_dir, tiny_llama, keys):
    from ingot.toolchain.pack import pack
    from ingot.toolchain.sign import sign_bundle

    d = tmp_path_factory.mktemp("trust")
    pack(tiny_llama, kernels=kernel_dir, out=d / "unsigned.ingot", selftest=False)
    sign_bundle(d / "unsigned.ingot", keys["a"]["key"], d / "signed.ingot")
    return {"unsigned": d / "unsigned.ingot", "signed": d / "signed.ingot"}


def test_signed_by_a_trusted_key_runs(ingot, stamp_cache, tiny_bundles, keys):
    code, out, err = ingot("run", tiny_bundles["signed"], *RUN, "--pubkey", keys["a"]["pub"])
    assert code == 0 and json.loads(out)["text"] is not None and "unsigned" not in err, err


def test_any_one_of_several_trusted_keys_is_enough(ingot, stamp_cache, tiny_bundles, keys):
    code, _, err = ingot(
        "run", tiny_bundles["signed"], *RUN, "--pubkey", keys["b"]["pub"], "--pubkey", keys["a"]["pub"]
    )
    assert code == 0, err


@pytest.mark.parametrize("which", ["signed", "unsigned"])
def test_a_bundle_not_signed_by_a_trusted_key_is_refused(ingot, stamp_cache, tiny_bundles, keys, which):
    code, out, err = ingot("run", tiny_bundles[which], *RUN, "--pubkey", keys["b"]["pub"])
    assert code == 4 and out == "", err
    assert ("not by --pubkey" if which == "signed" else "unsigned") in one_line(err)


def test_the_policy_from_the_environment(ingot, monkeypatch, stamp_cache, tiny_bundles, keys):
    monkeypatch.setenv("INGOT_TRUSTED_KEYS", f"{keys['b']['pub']}:{keys['a']['pub']}")
    assert ingot("run", tiny_bundles["signed"], *RUN)[0] == 0
    code, _, err = ingot("run", tiny_bundles["unsigned"], *RUN)
    assert code == 4 and "unsigned" in one_line(err)


def test_a_bare_gguf_is_refused_under_a_policy(ingot, stamp_cache, tiny_llama, keys):
    code, _, err = ingot("run", tiny_llama, *RUN, "--pubkey", keys["a"]["pub"])
    assert code == 4 and "trust policy" in one_line(err)


def test_without_a_policy_an_unsigned_bundle_runs_with_one_notice(ingot, stamp_cache, tiny_bundles):
    code, _, err = ingot("run", tiny_bundles["unsigned"], *RUN)
    assert code == 0
    notes = [line for line in err.splitlines() if "unsigned" in line]
    assert len(notes) == 1 and "INGOT_TRUSTED_KEYS" in notes[0]
    code, _, err = ingot("run", tiny_bundles["signed"], *RUN)
    assert code == 0 and "unsigned" not in err


def test_a_bad_key_file_is_a_usage_error(ingot, stamp_cache, tiny_bundles, tmp_path):
    bad = tmp_path / "x.pub"
    bad.write_text("not a key")
    code, _, err = ingot("run", tiny_bundles["signed"], *RUN, "--pubkey", bad)
    assert code == 2, err


@pytest.mark.parametrize("command", ["run", "serve", "bench"])
def test_every_running_command_takes_pubkey(ingot, command):
    code, out, _ = ingot(command, "--help")
    assert code == 0 and "--pubkey" in out


def test_the_server_applies_the_policy(stamp_cache, tiny_bundles, keys):
    from ingot.runtime.errors import VerificationError
    from ingot.runtime.server.server import Options, Server

    server = Server(str(tiny_bundles["unsigned"]), Options(device="cpu", pubkeys=(keys["a"]["pub"],)))
    with pytest.raises(VerificationError, match="unsigned"):
        server.load()
