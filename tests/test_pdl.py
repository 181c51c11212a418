"""Programmatic dependent launch (PDL), without a GPU: which kernels may be launched early (the opt-in list against
the sources and the built PTX), on which GPUs and settings, and when a launch gets the attribute.

A kernel launched with PDL may start while its predecessor still runs; it is correct only if its first statement
is INGOT_PDL_ENTRY() (griddepcontrol.wait), or INGOT_PDL_ENTRY_AFTER with a prefetch of weights into L2 (the
matvec kernels: no load, store or return before the wait, which the PTX check below confirms), or
INGOT_PDL_READ_AHEAD() (norms, decode attention: loads of what no kernel of a step writes before the wait, and
still no store, atomic or return there). So the host list
(kernels.PDL_KERNELS) must never name a kernel that lacks one of them. The checks here fail if a merge drops the
macro from a listed kernel, if a kernel gains the macro without being listed (so a lost speedup is noticed too),
or if the compiled PTX touches global memory or returns before the wait.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from ingot.runtime.errors import IngotError
from ingot.runtime.gpu import driver, fatbin
from ingot.runtime.gpu.driver import Event, Graph, Kernel, Launch, Memset, Stream
from ingot.runtime.gpu.kernels import MATVEC_STAGED_TYPES, MODULES, PDL_KERNELS, kernel_images, mark_pdl, pdl_enabled

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "cuda"
MACRO = "INGOT_PDL_ENTRY();"
# cuda/common.cuh's other first statements: the wait alone (the kernel triggers later: the PTX check below
# finds the trigger after the wait), or after L2 prefetches of weights by the matvec kernels' helpers
_WAIT = "INGOT_PDL_WAIT();"
_AFTER_PREFETCH = re.compile(r"INGOT_PDL_WAIT_AFTER\([^,]+, prefetch_rows(?:_h|_mma|_cs)?\(.*\)\);$")
READ_AHEAD = "INGOT_PDL_READ_AHEAD();"  # loads ahead of the wait (common.cuh): the PTX check allows those


def _waits_first(first: str) -> bool:
    return first in (MACRO, _WAIT, READ_AHEAD) or _AFTER_PREFETCH.match(first) is not None


# `extern "C" __global__ void [__launch_bounds__(..)] name(` or, inside a #define, `prefix_##NAME(`
_DEFINITION = re.compile(
    r"__global__\s+void[\s\\]+(?:(?:(?:__launch_bounds__|MVN?_BOUNDS)\([^)]*\)|MATMUL_BOUNDS)[\s\\]*)?"
    r"(\w+?)(##NAME(?:##(\w+))?)?\s*\("
)


def _types(text: str, define_at: int) -> list[str]:
    """The NAME arguments a kernel-defining macro expands over: the FOR_EACH_*_TYPE list (cuda/weights.cuh,
    matvec.cu) that the source applies to the #define enclosing define_at, nested lists included."""
    macro = re.findall(r"#define (\w+)", text[:define_at])[-1]
    lists = (CUDA / "weights.cuh").read_text() + text

    def expand(each: str) -> list[str]:
        block = lists[lists.index(f"#define {each}(X)") :].split("\n\n")[0].split("\n", 1)[1]
        nested = [t for sub in re.findall(r"(FOR_EACH_\w+)\(X\)", block) for t in expand(sub)]
        return re.findall(r"X\((\w+),", block) + nested

    return expand(re.search(rf"(FOR_EACH_\w+)\({macro}\)", text).group(1))


def _first_statement(text: str, open_paren: int) -> str:
    """The first statement of the body of the function whose parameter list opens at text[open_paren]."""
    depth, i = 0, open_paren
    while True:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    body = text[text.index("{", i) + 1 :]
    body = re.sub(r"//[^\n]*", "", body).replace("\\\n", "\n")
    return " ".join(body[: body.index(";") + 1].split())  # up to its ';', whitespace folded (it may span lines)


def kernel_definitions() -> dict[str, str]:
    """Every kernel defined in cuda/*.cu (macro-generated ones expanded) -> the first statement of its body."""
    out: dict[str, str] = {}
    for src in sorted(CUDA.glob("*.cu")):
        text = src.read_text()
        for m in _DEFINITION.finditer(text):
            first = _first_statement(text, m.end() - 1)
            suffix = m.group(3) or ""
            names = [m.group(1) + t + suffix for t in _types(text, m.start())] if m.group(2) else [m.group(1)]
            for name in names:
                assert name not in out, f"{name} defined twice"
                out[name] = first
    return out


def test_the_definitions_are_found():
    """The parser sees the kernels the host launches (a parser that found nothing would pass everything below)."""
    defs = kernel_definitions()
    assert {"rmsnorm_f32", "matvec_q4_0", "matvec_q4_k", "embed_iq4_xs", "attn_decode_f16", "sample_f32"} <= set(defs)
    assert len(defs) > 60


def test_every_listed_kernel_starts_with_the_wait_and_every_kernel_with_it_is_listed():
    defs = kernel_definitions()
    missing = sorted(PDL_KERNELS - set(defs))
    assert not missing, f"PDL_KERNELS names kernels that cuda/*.cu does not define: {missing}"
    unsafe = sorted(n for n in PDL_KERNELS if not _waits_first(defs[n]))
    assert not unsafe, f"listed for PDL but not starting with {MACRO} (a race): {unsafe}"
    unlisted = sorted(n for n, first in defs.items() if _waits_first(first) and n not in PDL_KERNELS)
    assert not unlisted, f"start with {MACRO} but are not in kernels.PDL_KERNELS (no PDL for them): {unlisted}"


def test_the_macro_is_guarded_for_older_archs():
    text = (CUDA / "common.cuh").read_text()
    guarded = text[text.index("__CUDA_ARCH__ >= 900") :]
    assert guarded.index("griddepcontrol.wait") < guarded.index("#else") < guarded.index("#endif")
    assert '"memory"' in guarded.split("#else")[0], "without the memory clobber loads may move above the wait"


def _ptx_entries() -> dict[str, str]:
    """Kernel name -> its PTX text, from the newest PTX image of each installed fatbin (compute_120: sm_90+ code,
    so the guarded griddepcontrol is in it)."""
    try:
        images = kernel_images()
    except IngotError:
        pytest.skip("no built kernels (pip install with nvcc, or INGOT_KERNELS)")
    out: dict[str, str] = {}
    for name in MODULES:
        data = images[name]
        ptx = [e for e in fatbin.parse_fatbin(data, name).entries if e.kind == "ptx" and e.cc >= 90]
        if not ptx:
            pytest.skip(f"{name}.fatbin holds no sm_90+ PTX to inspect")
        e = max(ptx, key=lambda e: e.cc)
        (header,) = struct.unpack_from("<I", data, e.offset + 4)
        payload = data[e.offset + header : e.offset + header + e.stored_size]
        text = fatbin._decompress(payload, e.compression, e.size, name, e.offset).decode()
        parts = re.split(r"^\s*\.visible\s+\.entry\s+", text, flags=re.M)[1:]
        out.update({p[: p.index("(")].strip(): p for p in parts})
    return out


# What may not happen before griddepcontrol.wait: a global memory access (it could read a buffer the previous
# kernel is still writing, or write one it is still reading), a return or exit (the block would leave without
# waiting) or the trigger (launch_dependents: the next grid would start before this one waited). The READ_AHEAD
# kernels may load (what they load is named in their source; review keeps it to what no kernel of a step
# writes), and nothing else.
_NEVER_BEFORE_WAIT = r"st\.global|atom\.|red\.|ret;|exit;|griddepcontrol\.launch"
_BEFORE_WAIT = re.compile(rf"^\s*(?:@!?%p\d+\s+)?(ld\.global|{_NEVER_BEFORE_WAIT})")
_BEFORE_WAIT_READ_AHEAD = re.compile(rf"^\s*(?:@!?%p\d+\s+)?({_NEVER_BEFORE_WAIT})")
_LABEL = re.compile(r"^\s*(\$\w+):")
_BRANCH = re.compile(r"^\s*(@!?%p\d+\s+)?bra(?:\.uni)?\s+(\$\w+);")
_ENDS = ("ret;", "exit;")  # unpredicated: a block ends and nothing falls through


def unwaited(body: str, forbidden: re.Pattern) -> str | None:
    """The first instruction of a kernel's PTX matching `forbidden` that some path from the entry reaches without
    passing a griddepcontrol.wait, or None. The body is cut into basic blocks at labels and branches; a block
    starts waited if every predecessor ends waited (the entry does not), solved to a fixed point. Every path,
    not the text before the first wait: the norms' first wait in the text is a branch's own."""
    blocks: list[list[str]] = [[]]
    labels: dict[str, int] = {}
    for line in body.splitlines():
        if m := _LABEL.match(line):
            if blocks[-1]:
                blocks.append([])
            labels[m.group(1)] = len(blocks) - 1
        elif line.strip() and not line.strip().startswith(("//", "{", "}", ".reg", ".local", ".shared")):
            blocks[-1].append(line.strip())
            if _BRANCH.match(line) or line.strip() in _ENDS:
                blocks.append([])
    succ: list[list[int]] = []
    for i, block in enumerate(blocks):
        last = block[-1] if block else ""
        out = [labels[m.group(2)]] if (m := _BRANCH.match(last)) else []
        if not (m and not m.group(1)) and last not in _ENDS and i + 1 < len(blocks):
            out.append(i + 1)  # falls through: no branch, or a predicated one
        succ.append(out)
    waited_in = [i != 0 for i in range(len(blocks))]
    changed = True
    while changed:
        changed = False
        for i, block in enumerate(blocks):
            out = waited_in[i] or any("griddepcontrol.wait" in ins for ins in block)
            for j in succ[i]:
                if waited_in[j] and not out:
                    waited_in[j], changed = False, True
    for i, block in enumerate(blocks):
        waited = waited_in[i]
        for ins in block:
            if "griddepcontrol.wait" in ins:
                waited = True
            elif not waited and forbidden.match(ins):
                return ins
    return None


def test_the_built_ptx_waits_first_in_exactly_the_listed_kernels():
    entries = _ptx_entries()
    assert PDL_KERNELS <= set(entries), sorted(PDL_KERNELS - set(entries))
    waiting = {n for n, body in entries.items() if "griddepcontrol.wait" in body}
    assert waiting == PDL_KERNELS, (sorted(waiting - PDL_KERNELS), sorted(PDL_KERNELS - waiting))
    read_ahead = {n for n, first in kernel_definitions().items() if first == READ_AHEAD}
    assert read_ahead == {
        "rmsnorm_f32",
        "add_rmsnorm_f32",
        "attn_decode_tile_f16",
        "attn_decode_tile_f16_hd256",
        *(f"matvec_{q.lower()}_b1s" for q in MATVEC_STAGED_TYPES),
    }
    for name in sorted(PDL_KERNELS):
        forbidden = _BEFORE_WAIT_READ_AHEAD if name in read_ahead else _BEFORE_WAIT
        early = unwaited(entries[name], forbidden)
        assert early is None, f"{name}: `{early}` reachable before griddepcontrol.wait"


def test_the_ptx_path_check_finds_what_comes_before_a_wait_on_any_path():
    """unwaited() on hand-written PTX: a store after the wait on one branch but reached around it on the other is
    found, though the text has a wait before it; a load is allowed only under the read-ahead rule; a loop back
    to a waited block stays waited."""
    ok = "\n".join(
        [
            "ld.global.nc.f32 %f1, [%rd1];",
            "griddepcontrol.wait;",
            "$L__BB0_1:",
            "st.global.f32 [%rd2], %f1;",
            "@%p1 bra $L__BB0_1;",
            "ret;",
        ]
    )
    assert unwaited(ok, _BEFORE_WAIT_READ_AHEAD) is None
    assert unwaited(ok, _BEFORE_WAIT) == "ld.global.nc.f32 %f1, [%rd1];"
    around = "\n".join(
        [
            "@%p1 bra $L__BB0_2;",
            "griddepcontrol.wait;",
            "bra.uni $L__BB0_3;",
            "$L__BB0_2:",
            "add.s32 %r1, %r1, 1;",
            "$L__BB0_3:",
            "st.global.f32 [%rd2], %f1;",
            "ret;",
        ]
    )
    assert unwaited(around, _BEFORE_WAIT_READ_AHEAD) == "st.global.f32 [%rd2], %f1;"
    assert unwaited(around.replace("add.s32 %r1, %r1, 1;", "griddepcontrol.wait;"), _BEFORE_WAIT) is None
    assert unwaited("\n".join(["@%p1 ret;", "griddepcontrol.wait;", "ret;"]), _BEFORE_WAIT) == "@%p1 ret;"


# --- which kernels get it, on which GPU -------------------------------------------------------------------


def _kernels() -> dict[str, Kernel]:
    return {n: Kernel(None, n) for n in ["rmsnorm_f32", "matvec_q4_0", "attn_decode_f16", "new_kernel_without_it"]}


@pytest.mark.parametrize("cc", [90, 100, 120])
def test_pdl_kernels_are_marked_on_sm90_and_newer(cc, monkeypatch):
    monkeypatch.delenv("INGOT_PDL", raising=False)
    ks = _kernels()
    mark_pdl(ks, cc)
    assert {n for n, k in ks.items() if k.pdl} == {"rmsnorm_f32", "matvec_q4_0", "attn_decode_f16"}


@pytest.mark.parametrize("cc", [75, 80, 86, 89])
def test_no_pdl_before_sm90(cc, monkeypatch):
    monkeypatch.setenv("INGOT_PDL", "1")
    ks = _kernels()
    mark_pdl(ks, cc)
    assert not any(k.pdl for k in ks.values()) and not pdl_enabled(cc)


def test_ingot_pdl_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("INGOT_PDL", "0")
    ks = _kernels()
    mark_pdl(ks, 90)
    assert not any(k.pdl for k in ks.values())
    monkeypatch.setenv("INGOT_PDL", "1")
    mark_pdl(ks, 90)  # marking again follows the setting of the moment
    assert ks["rmsnorm_f32"].pdl and not ks["new_kernel_without_it"].pdl


# --- when a launch gets the attribute ------------------------------------------------------------------------


class _Driver:
    """cuda.bindings.driver with every call that needs a GPU recorded instead (structs and enums are real)."""

    def __init__(self, real):
        self.real, self.calls = real, []
        self.ok = real.CUresult.CUDA_SUCCESS

    def __getattr__(self, name):
        if name.startswith("cu") and name[2:3].isupper():
            return lambda *a: self._record(name, a)
        return getattr(self.real, name)

    def _record(self, name, args):
        self.calls.append((name, args))
        return (self.ok, 0x5000) if name in ("cuStreamCreate", "cuEventCreate") else (self.ok,)

    def launches(self) -> list[str]:
        """'pdl' or 'plain' for each kernel launch so far."""
        names = {"cuLaunchKernelEx": "pdl", "cuLaunchKernel": "plain"}
        return [names[n] for n, _ in self.calls if n in names]


@pytest.fixture
def cu(monkeypatch):
    real = pytest.importorskip("cuda.bindings.driver")
    fake = _Driver(real)
    monkeypatch.setattr(driver, "cu", fake)
    return fake


def test_a_pdl_launch_follows_a_kernel_and_nothing_else(cu):
    s = Stream()
    a, b = Kernel("fa", "a", pdl=True), Kernel("fb", "b", pdl=False)
    la, lb = Launch(a, (3, 2), 64, [np.int32(1)], smem=256), Launch(b, (1,), 32, [])
    la(s)  # the stream's first work: nothing to overlap
    la(s)
    lb(s)  # a kernel without the macro is never launched early
    la(s)  # ... but one with it may follow it (its wait covers any predecessor)
    assert cu.launches() == ["plain", "pdl", "plain", "pdl"]
    for step in (
        lambda: s.memset(0, 0, 4),
        lambda: Memset(0, 0, 1)(s),
        lambda: s.upload(0, np.zeros(4, np.uint8)),
        lambda: s.download(np.zeros(4, np.uint8), 0),
        lambda: Event().record(s),
    ):
        step()
        la(s)  # after a copy, memset or event: fully serialized
        la(s)
    assert cu.launches()[4:] == ["plain", "pdl"] * 5
    name, (config, fn, params, extra) = next(c for c in cu.calls if c[0] == "cuLaunchKernelEx")
    assert fn == "fa" and params == la._params.ctypes.data and extra == 0
    assert (config.gridDimX, config.gridDimY, config.gridDimZ) == (3, 2, 1)
    assert (config.blockDimX, config.blockDimY, config.blockDimZ, config.sharedMemBytes) == (64, 1, 1, 256)
    attr = cu.real.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert config.numAttrs == 1 and config.attrs[0].id == attr
    assert config.attrs[0].value.programmaticStreamSerializationAllowed == 1


def test_a_captured_graph_starts_plain_and_leaves_the_stream_as_it_was(cu):
    s = Stream()
    la = Launch(Kernel("fa", "a", pdl=True), (1,), 32, [])
    la(s)
    g = Graph(s, lambda: [la(s), la(s), la(s)])  # captured: the first node has no kernel before it
    assert cu.launches() == ["plain", "plain", "pdl", "pdl"]
    la(s)  # after the capture: the stream's last real work is still... whatever it was; serialize
    g.launch(s)
    la(s)  # after a graph launch: serialize
    assert cu.launches()[4:] == ["plain", "plain"]


def test_without_pdl_every_launch_is_plain(cu):
    s = Stream()
    la = Launch(Kernel("fa", "a", pdl=False), (1,), 32, [])
    for _ in range(3):
        la(s)
    assert cu.launches() == ["plain"] * 3 and not la.pdl
