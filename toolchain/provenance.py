"""SLSA v1 build provenance for the kernels in a bundle (the `provenance.json` member).

An in-toto v1 Statement: the subjects are the fatbin members and their sha256; the predicate
(https://slsa.dev/provenance/v1) records what `ingot rebuild --check` needs to rebuild them and to explain
a difference: the archs and nvcc flags (externalParameters), each module's exact nvcc command line and the
digests of its source and every header it includes, the nvcc and host-compiler versions
(internalParameters), and every input file by digest (resolvedDependencies, including cuda/archs.json and
CMakeLists.txt and the Python lock file ci/requirements.lock when the build ran from a checkout) and
every Python distribution installed where it ran, as `pkg:pypi/NAME@VERSION` (what packed the bundle and
computed its self-test). No host paths, user names or timestamps, so the same build in the same environment
always gives the same bytes.
"""

from __future__ import annotations

import re
from importlib.metadata import distributions

from ingot.runtime.errors import VerificationError

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = "https://ingot-llm.dev/buildtypes/kernel-fatbin/v1"
BUILDER_ID = "https://ingot-llm.dev/builders/ingot-build"
# The hash-pinned Python dependency set of a release build (pip-compile --generate-hashes; ci/release.sh
# installs from it). Path relative to the checkout.
LOCK_FILE = "ci/requirements.lock"


def python_environment() -> dict[str, str]:
    """Normalized distribution name -> version of every Python distribution installed here, except Ingot."""
    out = {}
    for d in distributions():
        name = re.sub(r"[-_.]+", "-", d.metadata["Name"] or "").lower()
        if name and name != "ingot-llm":
            out[name] = d.version
    return dict(sorted(out.items()))


def portable_command(argv: list[str], name: str) -> list[str]:
    """The nvcc argv a build ran, without what is host-specific and cannot change the bytes: the nvcc path,
    `--threads N`, `--time FILE` and the temp output path. nvcc runs in the source folder on `<name>.cu`."""
    out, args = ["nvcc"], iter(argv[1:])
    for a in args:
        if a in ("--threads", "--time", "-o"):
            next(args, None)
        elif a != f"{name}.cu":
            out.append(a)
    return out + ["-o", f"{name}.fatbin", f"{name}.cu"]


def kernel_provenance(
    record: dict,
    modules: list[dict],
    extra_inputs: dict[str, str],
    ingot_version: str,
    python: dict[str, str] | None = None,
) -> dict:
    """record: build.json of the kernel build; modules: the manifest's kernel entries (path, sha256);
    extra_inputs: 'cuda/archs.json' / 'CMakeLists.txt' / the lock file -> sha256; python: python_environment()."""
    built = {m["name"]: m for m in record["fatbins"]}
    per_module = {}
    deps: dict[str, str] = dict(extra_inputs)
    for k in modules:
        b = built[k["name"]]
        per_module[k["name"]] = {
            "command": portable_command(b["command"], k["name"]),
            "inputs": dict(sorted(b["inputs"].items())),
        }
        deps.update({f"cuda/{n}": d for n, d in b["inputs"].items()})
    tk = record["toolkit"]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": k["path"], "digest": {"sha256": k["sha256"]}} for k in modules],
        "predicateType": PREDICATE_TYPE,
        "predicate": {
            "buildDefinition": {
                "buildType": BUILD_TYPE,
                "externalParameters": {"archs": record["archs"], "flags": record["flags"]},
                "internalParameters": {
                    "modules": per_module,
                    "nvcc": {"version": tk["version"], "build": tk["build"], "version_text": tk["version_text"]},
                    "host_compiler": (record.get("host_compiler") or {}).get("version"),
                },
                "resolvedDependencies": [{"name": n, "digest": {"sha256": d}} for n, d in sorted(deps.items())]
                + [{"name": n, "uri": f"pkg:pypi/{n}@{v}"} for n, v in (python or {}).items()],
            },
            "runDetails": {"builder": {"id": BUILDER_ID, "version": {"ingot": ingot_version}}},
        },
    }


def recorded_build(statement: dict) -> dict:
    """The parts of a provenance statement a rebuild needs; VerificationError if it is not one of ours."""
    bad = VerificationError(
        "provenance.json is not an Ingot kernel-build provenance statement",
        hint="re-pack the bundle with this version of Ingot",
    )
    try:
        d = statement["predicate"]["buildDefinition"]
        if statement["predicateType"] != PREDICATE_TYPE or d["buildType"] != BUILD_TYPE:
            raise bad
        ext, internal = d["externalParameters"], d["internalParameters"]
        out = {
            "archs": list(ext["archs"]),
            "flags": list(ext["flags"]),
            "modules": dict(internal["modules"]),
            "nvcc": dict(internal["nvcc"]),
            "host_compiler": internal["host_compiler"],
            "subjects": {s["name"]: s["digest"]["sha256"] for s in statement["subject"]},
        }
    except (KeyError, TypeError, AttributeError):
        raise bad from None
    if not all(
        isinstance(m, dict) and isinstance(m.get("command"), list) and isinstance(m.get("inputs"), dict)
        for m in out["modules"].values()
    ):
        raise bad
    return out
