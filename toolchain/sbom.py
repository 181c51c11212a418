"""`ingot sbom`: an AI-BOM of a bundle, as a CycloneDX 1.6 ML-BOM built with `cyclonedx-python-lib`.

The bundle is verified first (every digest; the BOM describes only what verifies). Then:
  metadata.component   the bundle: its file sha256, root digest, format, kernel ABI, weight layout, signer hint
  metadata.tools       what built it: Ingot, nvcc, the host compiler, CMake, cuda-bindings (from the manifest)
  components           every member with its sha256: the model (type machine-learning-model, with the license
                       and source its GGUF declares, architecture, quant types), each kernel fatbin (SASS and
                       PTX archs, kernel count), manifest.json, provenance.json and the signature; then the
                       Python distributions the bundle was packed with (provenance.json), as pkg:pypi purls
  dependencies         bundle -> members; the model -> the kernels that run it
The output is validated against the CycloneDX 1.6 JSON schema by the library's validator before it is written.
Reproducible: the serial number derives from the bundle's root digest and the timestamp is the members' mtime
($SOURCE_DATE_EPOCH at pack time), so the same bundle gives the same BOM.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path

from ingot.runtime.bundle.container import load_manifest, open_file, read_index, read_member
from ingot.runtime.bundle.manifest import MANIFEST, MAX_MANIFEST_SIZE, SIGNATURE
from ingot.runtime.bundle.verify import verify_bundle
from ingot.runtime.errors import UsageError

FORMATS = ("cyclonedx-json",)
_RELEASE_EXTRA = "install the release extra: pip install '.[release]' in a checkout, or 'WHEEL.whl[release]'"


def _bundle_facts(path: Path) -> dict:
    """Verify the bundle, then read what the BOM describes: manifest, provenance, members, file digest."""
    report = verify_bundle(path)
    with open_file(path) as f:
        index = read_index(f, os.fstat(f.fileno()).st_size)
        manifest = load_manifest(f, index)
        by_name = {m.name: m for m in index}
        provenance = json.loads(read_member(f, by_name[manifest["provenance"]], MAX_MANIFEST_SIZE))
        signature = read_member(f, by_name[SIGNATURE], 1 << 20) if SIGNATURE in by_name else None
        whole = hashlib.sha256()
        f.seek(0)
        while chunk := f.read(8 << 20):
            whole.update(chunk)
    return {
        "report": report,
        "manifest": manifest,
        "provenance": provenance,
        "signature": signature,
        "sha256": whole.hexdigest(),
        "mtime": by_name[MANIFEST].mtime,
    }


def build_sbom(bundle: str | Path) -> str:
    """The CycloneDX 1.6 JSON text of the bundle's AI-BOM, validated against the schema."""
    try:  # deferred: the `release` extra, only `ingot sbom` needs it
        from cyclonedx.contrib.license.factories import LicenseFactory
        from cyclonedx.model import ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, Property, XsUri
        from cyclonedx.model.bom import Bom, BomMetaData
        from cyclonedx.model.component import Component, ComponentType
        from cyclonedx.model.tool import ToolRepository
        from cyclonedx.output.json import JsonV1Dot6
        from cyclonedx.schema import SchemaVersion
        from cyclonedx.validation.json import JsonStrictValidator
        from packageurl import PackageURL
    except ImportError:
        raise UsageError("`ingot sbom` needs cyclonedx-python-lib", hint=_RELEASE_EXTRA) from None

    path = Path(bundle)
    facts = _bundle_facts(path)
    m = facts["manifest"]
    root = m["root_digest"]

    def sha(digest: str) -> list:
        return [HashType(alg=HashAlgorithm.SHA_256, content=digest)]

    def props(**kv) -> list:
        return [Property(name=f"ingot:{k}", value=str(v)) for k, v in kv.items() if v not in (None, "", [])]

    files = {f["name"]: f for f in m["files"]}
    model = m["model"]
    origin = model.get("origin") or {}
    model_c = Component(
        type=ComponentType.MACHINE_LEARNING_MODEL,
        name=model.get("name") or Path(model["path"]).stem,
        bom_ref=model["path"],
        hashes=sha(model["sha256"]),
        licenses=[LicenseFactory().make_from_string(origin["license"])] if origin.get("license") else [],
        external_references=[
            ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(url))
            for url in origin.get("sources", [])
        ],
        properties=props(
            path=model["path"],
            size=model["size"],
            architecture=model.get("architecture"),
            quant_types=",".join(model.get("quant_types", [])),
            n_tensors=model.get("n_tensors"),
            weight_layout=m["runtime"]["weight_layout"].split(":")[0],
        ),
    )
    kernels = [
        Component(
            type=ComponentType.FILE,
            name=k["path"],
            bom_ref=k["path"],
            hashes=sha(k["sha256"]),
            description=f"CUDA fatbin of module {k['name']}",
            properties=props(
                size=k["size"],
                sass_archs=",".join(k["archs"]["sass"]),
                ptx_archs=",".join(f"{p['arch']} (PTX ISA {p['isa']})" for p in k["archs"]["ptx"]),
                kernels=len(k["kernels"]),
            ),
        )
        for k in m["kernels"]
    ]
    plain: list[tuple[str, str, int | None]] = [(MANIFEST, m["manifest_digest"], None)]
    described = {model["path"], *(k["path"] for k in m["kernels"])}
    plain += [(n, f["digest"], f["size"]) for n, f in files.items() if n not in described]
    if facts["signature"] is not None:
        plain.append((SIGNATURE, hashlib.sha256(facts["signature"]).hexdigest(), len(facts["signature"])))
    other = [
        Component(type=ComponentType.FILE, name=name, bom_ref=name, hashes=sha(digest), properties=props(size=size))
        for name, digest, size in plain
    ]
    python = [
        Component(
            type=ComponentType.LIBRARY,
            name=d["name"],
            version=d["uri"].rsplit("@", 1)[1],
            bom_ref=d["uri"],
            purl=PackageURL.from_string(d["uri"]),
        )
        for d in facts["provenance"]["predicate"]["buildDefinition"]["resolvedDependencies"]
        if d.get("uri", "").startswith("pkg:pypi/")
    ]
    tc = m["toolchain"]
    tools = [
        Component(type=ComponentType.APPLICATION, name="ingot-llm", version=tc.get("ingot")),
        Component(type=ComponentType.APPLICATION, name="nvcc", version=(tc.get("nvcc") or {}).get("version")),
        Component(type=ComponentType.APPLICATION, name="host-compiler", version=tc.get("host_compiler")),
        Component(type=ComponentType.APPLICATION, name="cmake", version=tc.get("cmake")),
        Component(type=ComponentType.LIBRARY, name="cuda-bindings", version=tc.get("cuda_bindings")),
    ]
    sig = facts["report"]["signature"]
    subject = Component(
        type=ComponentType.APPLICATION,
        name=m["name"],
        bom_ref="bundle",
        description="Ingot inference bundle (kernels, model, manifest, provenance)",
        hashes=sha(facts["sha256"]),
        properties=props(
            file=path.name,
            format=m["format"],
            root_digest=root,
            kernel_abi=m["runtime"]["kernel_abi"],
            packed_by=m["runtime"]["ingot"],
            signature_key_hint=sig["keyid"] if sig else None,
        ),
    )
    members = [model_c, *kernels, *other]
    bom = Bom(
        components=[*members, *python],
        serial_number=uuid.uuid5(uuid.NAMESPACE_URL, f"https://ingot-llm.dev/bundles/sha256:{root}"),
        metadata=BomMetaData(
            component=subject,
            tools=ToolRepository(components=[t for t in tools if t.version]),
            timestamp=datetime.fromtimestamp(facts["mtime"], tz=timezone.utc),
        ),
    )
    bom.register_dependency(subject, members)
    bom.register_dependency(model_c, kernels)
    text = JsonV1Dot6(bom).output_as_string(indent=2)
    error = JsonStrictValidator(SchemaVersion.V1_6).validate_str(text)
    if error is not None:
        raise AssertionError(f"the CycloneDX 1.6 schema refuses the BOM Ingot built: {error}")
    return text + "\n"


def write_sbom(bundle: str | Path, out: str | Path | None = None, fmt: str = "cyclonedx-json") -> str:
    if fmt not in FORMATS:
        raise UsageError(f"unknown SBOM format {fmt!r}", hint=f"choose one of {', '.join(FORMATS)}")
    text = build_sbom(bundle)
    if out is not None:
        Path(out).write_text(text)
    return text
