"""Llama-family models from GGUF: the one place that reads GGUF metadata keys.

Sections:
  - Config: hyperparameters, read once into a frozen dataclass
  - Vocab: the embedded tokenizer data (tokens, merges, scores, special ids, chat template)
  - QTensor / Model / load_model: the opened GGUF, tensors mapped in place (zero-copy)

Supported: the architectures described in architectures.py (llama, mistral, qwen2, qwen3, gemma3); the tensor
types of quants.py (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS), each tensor its
own type. Anything else is refused with a ModelError naming what and where.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np

from ingot.runtime.errors import ModelError, UsageError
from ingot.runtime.files import cache_root, write_atomic

if TYPE_CHECKING:
    from gguf import GGUFReader

from ingot.runtime.model.architectures import ARCHITECTURES, Architecture, block_tensors
from ingot.runtime.model.quants import QUANT_TYPES, dequantize

# Limits (README: Limits): a GGUF's counts, lengths and offsets are checked against these and against the
# bytes present before anything is allocated, so a small hostile file costs little memory and time.
MAX_GGUF_KV = 1 << 16  # metadata key/values
MAX_GGUF_TENSORS = 1 << 16  # Llama 3.1 405B has 1,138
MAX_GGUF_STRINGS = 1 << 20  # strings in all metadata arrays together (Llama 3: 128k tokens + 280k merges)
MAX_GGUF_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_ELEMENTS = 1 << 40
MAX_LAYERS = 1024
MAX_WIDTH = 1 << 20  # embedding, feed-forward and vocabulary sizes
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_CTX = 1 << 24
MAX_TOKEN_CHARS = 4096  # one vocabulary entry (merges are derived per split of each entry)


# --- Config ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    arch: str
    n_vocab: int
    n_ctx_train: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    norm_eps: float
    rope_theta: float
    rope_dim: int  # the first rope_dim dims of each head are rotated
    rope_neox: bool
    rope_freq_factors: tuple[float, ...] | None  # [rope_dim/2] divisors of the rope frequencies (Llama 3.1)
    qkv_bias: bool
    tied_embeddings: bool  # no output.weight: the output head is token_embd
    # What the architecture's block adds to Llama's (architectures.py), as numbers for this model:
    attn_scale: float = 0.0  # on q.k before softmax (0: 1/sqrt(head_dim))
    sliding_window: int = 0  # positions a local layer attends to, itself included (0: every layer is global)
    rope_theta_local: float = 0.0  # RoPE base of the local layers (0: rope_theta)
    rope_scale: float = 1.0  # linear RoPE scaling of the global layers: positions divided by this
    attn_softcap: float = 0.0  # attention scores -> cap * tanh(scores / cap) (0: none)
    final_softcap: float = 0.0  # logits -> cap * tanh(logits / cap) (0: none)

    @property
    def block(self) -> Architecture:
        """What each block computes (the architecture's description)."""
        return ARCHITECTURES[self.arch]

    def layer_window(self, layer: int) -> int:
        """How many positions `layer` attends to (itself included); 0: all of them."""
        return self.sliding_window if self.sliding_window and self.block.is_local(layer) else 0

    def layer_rope(self, layer: int) -> tuple[float, float]:
        """(RoPE base, linear position scale) of `layer`: local layers use their own base and no scaling."""
        if self.layer_window(layer) and self.rope_theta_local:
            return self.rope_theta_local, 1.0
        return self.rope_theta, self.rope_scale

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention): query head h reads KV head h // n_rep."""
        return self.n_heads // self.n_kv_heads

    def as_dict(self) -> dict:
        return asdict(self) | {"n_rep": self.n_rep}


# --- Vocab ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vocab:
    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style, scored)
    pre: str  # pre-tokenizer name, e.g. "smollm", "llama-bpe", "qwen2", "default"
    tokens: list[str]
    types: list[int]  # gguf.TokenType per token: 1 normal, 3 control, 4 user-defined, 6 byte...
    scores: list[float] | None
    merges: list[str] | None  # "left right" per merge, highest priority first
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    eom_id: int | None
    unk_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None = field(repr=False)


# --- tensors and the opened model -----------------------------------------------------------------


@dataclass(frozen=True)
class QTensor:
    """One tensor, mapped in place. shape is in math order: (rows, cols) for a matrix (GGUF lists ne0=cols first)
    and (n,) for a vector; a matrix multiplies as y = W @ x with x of length cols."""

    name: str
    qtype: str
    shape: tuple[int, ...]
    raw: np.ndarray = field(repr=False)  # uint8 view of the tensor's bytes in the file, [rows, row_bytes] or [bytes]

    @property
    def nbytes(self) -> int:
        return self.raw.nbytes

    def dequantize(self) -> np.ndarray:
        """float32 array of `shape`."""
        return dequantize(self.raw, self.qtype, self.shape[-1])

    def dequantize_rows(self, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 [len(rows), cols]: only the rows asked for (embedding lookups)."""
        return dequantize(self.raw[np.asarray(rows, dtype=np.int64)], self.qtype, self.shape[-1])


@dataclass(frozen=True)
class Model:
    path: Path
    offset: int  # where the GGUF starts inside `path` (non-zero inside a bundle)
    size: int
    name: str
    config: Config
    vocab: Vocab
    tensors: dict[str, QTensor] = field(repr=False)

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)

    @property
    def quant_types(self) -> list[str]:
        return sorted({t.qtype for t in self.tensors.values()})

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors.values())


class _Truncated(ValueError):
    pass


class _Hostile(ValueError):
    """A count, length or offset beyond the limits or the file (reported as ModelError)."""


@functools.cache
def _window_reader_class():
    """gguf is imported only when a file is actually parsed: a model found in the index cache (below) never
    needs it, which keeps `ingot run`'s cold start short."""
    from gguf import GGUFReader  # deferred: see the docstring

    class _WindowReader(GGUFReader):
        """A GGUFReader over bytes [offset, offset + size) of a file, so a GGUF stored uncompressed inside a bundle
        (a tar) is parsed and mapped in place, without a copy.

        GGUFReader.__init__ maps the whole file (`self.data = np.memmap(path)`) and parses from byte 0. Making
        `data` a property lets us narrow that one map to the window as it is assigned; every offset the reader
        computes is then relative to the GGUF's first byte. The reader also slices past the end of a truncated
        file without noticing; `_get` turns that into one clear error instead.
        """

        def __init__(self, source, offset: int, size: int | None):
            # source: a path, or an open file whose descriptor is mapped (the verified one, for a bundle)
            self._window = (offset, size)
            self._strings = 0
            self.decoded_strings: dict[int, list[str]] = {}
            super().__init__(source, "r")

        # gguf declares `data: np.memmap`; a property returning a plain view of it is what we want (see above)
        @property  # type: ignore[override]
        def data(self) -> np.ndarray:
            return self._data

        @data.setter
        def data(self, whole: np.memmap) -> None:
            offset, size = self._window
            # A plain ndarray view of the map: the reader slices it ~10 times per vocabulary entry, and np.memmap's
            # per-slice bookkeeping would double the load time of a 128k-token vocabulary.
            self._data = whole[offset : None if size is None else offset + size].view(np.ndarray)

        def _get(self, offset, dtype, count=1, override_order=None):
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > len(self._data):
                raise _Truncated(f"data ends at byte {len(self._data):,} but the file needs {end:,}")
            return super()._get(offset, dtype, count, override_order)

        # --- limits: counts and lengths are checked against the bytes left before the reader loops ---

        def _left(self, offs: int) -> int:
            return len(self._data) - int(offs)

        def _build_fields(self, offs, count):
            count = int(count)
            if count > MAX_GGUF_KV or count * 13 > self._left(offs):  # a key/value takes at least 13 bytes
                raise _Hostile(f"{count:,} metadata entries do not fit (at most {MAX_GGUF_KV:,} in the bytes left)")
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            count = int(count)
            if count > MAX_GGUF_TENSORS or count * 24 > self._left(offs):  # a tensor entry takes at least 24
                raise _Hostile(f"{count:,} tensors do not fit (at most {MAX_GGUF_TENSORS:,} in the bytes left)")
            return super()._build_tensor_info(offs, count)

        def _get_field_parts(self, orig_offs, raw_type):
            from gguf import GGUFValueType  # deferred with the reader (see _window_reader_class)

            if raw_type == GGUFValueType.STRING:
                self._strings += 1
                if self._strings > MAX_GGUF_STRINGS:
                    raise _Hostile(f"more than {MAX_GGUF_STRINGS:,} metadata strings")
            if raw_type != GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            n, item = int(alen[0]), int(itype[0])
            left = self._left(orig_offs + 12)
            if item == GGUFValueType.ARRAY:
                raise _Hostile("nested metadata arrays are not supported")
            if item == GGUFValueType.STRING:
                if n * 8 > left or self._strings + n > MAX_GGUF_STRINGS:
                    raise _Hostile(f"a metadata array of {n:,} strings does not fit")
                self._strings += n
                return self._string_array(orig_offs, n, [itype, alen])
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(item))
            if nptype is None:
                raise _Hostile(f"unknown metadata array type {item}")
            # One part holding all values, not one numpy view per element (gguf's way: ~300 bytes per value)
            values = self._get(orig_offs + 12, nptype, n)
            types = [GGUFValueType.ARRAY, GGUFValueType(item)]
            return 12 + int(values.nbytes), [itype, alen, values], [2] if n else [], types

        def _string_array(self, orig_offs: int, n: int, head: list):
            """A string array decoded in one pass (gguf's reader makes two numpy views per string: ~600 bytes
            and ~10 us each); the strings are kept in `decoded_strings` by the array's offset."""
            from gguf import GGUFValueType  # deferred with the reader

            view, size = memoryview(self._data.data), len(self._data)
            order: Literal["little", "big"] = (
                "big" if self.byte_order == "S" and sys.byteorder == "little" else "little"
            )
            pos = orig_offs + 12
            out = []
            for _ in range(n):
                if pos + 8 > size:
                    raise _Truncated(f"data ends at byte {size:,} inside a string array")
                length = int.from_bytes(view[pos : pos + 8], order)
                if pos + 8 + length > size:
                    raise _Truncated(f"data ends at byte {size:,} but a string needs {pos + 8 + length:,}")
                out.append(str(view[pos + 8 : pos + 8 + length], "utf-8", "replace"))
                pos += 8 + length
            self.decoded_strings[orig_offs] = out
            types = [GGUFValueType.ARRAY, GGUFValueType.STRING]
            return pos - orig_offs, [*head, self._data[orig_offs + 12 : pos]], [2] if n else [], types

        def _build_tensors(self, start_offs, fields):
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType  # deferred with the reader

            for entry in fields:
                _, name, n_dims, dims, raw_dtype, offset_tensor = entry.parts
                label = bytes(name).decode("utf-8", errors="replace")[:80]
                if not 1 <= int(n_dims[0]) <= MAX_GGUF_DIMS:
                    raise _Hostile(f"tensor {label} has {int(n_dims[0])} dimensions (1..{MAX_GGUF_DIMS})")
                n = math.prod(int(d) for d in dims)
                if not 0 < n <= MAX_TENSOR_ELEMENTS:
                    raise _Hostile(f"tensor {label} has {n:,} elements")
                try:
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_dtype[0]))]
                except (ValueError, KeyError):
                    raise _Hostile(f"tensor {label} has unknown type {int(raw_dtype[0])}") from None
                start = int(start_offs) + int(offset_tensor[0])  # Python ints: no uint64 wrap-around
                end = start + n * type_size // block
                if end > len(self._data):
                    raise _Truncated(
                        f"tensor {label} needs bytes {start:,}..{end:,} but the data ends at {len(self._data):,}"
                    )
            return super()._build_tensors(start_offs, fields)

    return _WindowReader


def load_model(path: str | Path, *, offset: int = 0, size: int | None = None, file=None) -> Model:
    """Open a GGUF (or the GGUF stored at [offset, offset+size) of a bigger file), validate it, map its tensors.

    file: an already open (raw, binary) file to map instead of opening `path` again; `path` then only names it.
    A bundle passes the descriptor it verified, so the bytes that run are the bytes that were checked even if
    the path is renamed over meanwhile (resolve.open_model).

    The first open parses the file with gguf's reader (about a second for a 49k-token vocabulary); what it
    learned (config, vocabulary, tensor table) is kept in an index cache keyed by the file's identity, so the
    next process maps the same file in a few milliseconds. Any change to the file invalidates its entry."""
    path = Path(path)
    if file is not None:
        st = os.fstat(file.fileno())
        if st.st_size == 0:
            raise ModelError(f"{path} is empty, not a GGUF file")
        index = _index_file(path, offset, size, st)
        model = _load_indexed(path, offset, index, file)
        if model is None:
            model, starts = _parse_model(path, offset, size, file)
            _save_index(model, starts, index)
        return model
    if not path.exists():
        raise UsageError(f"model file not found: {path}", hint="pass a .gguf path, a .ingot bundle, or 'smollm2'")
    if not path.is_file():
        raise UsageError(f"model path is not a file: {path}")
    if path.stat().st_size == 0:
        raise ModelError(f"{path} is empty, not a GGUF file")
    index = _index_file(path, offset, size, path.stat())
    model = _load_indexed(path, offset, index)
    if model is None:
        model, starts = _parse_model(path, offset, size)
        _save_index(model, starts, index)
    return model


def _parse_model(path: Path, offset: int, size: int | None, file=None) -> tuple[Model, dict[str, int]]:
    """Parse with gguf's reader. Returns the model and each tensor's byte offset from the GGUF's start."""
    try:
        reader = _window_reader_class()(path if file is None else file, offset, size)
    except _Truncated as e:
        raise ModelError(f"{path} is truncated: {e}", hint="download or copy the file again") from None
    except PermissionError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None
    except _Hostile as e:
        raise ModelError(f"{path} is not a valid GGUF file ({e})") from None
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        magic = "GGUF magic invalid" in str(e)
        raise ModelError(f"{path} is not a GGUF file" if magic else f"{path} is not a valid GGUF file ({e})") from None

    meta = _Metadata(reader, path)
    arch = meta.get_str("general.architecture")
    check_architecture(arch, path)
    if meta.get_int(f"{arch}.expert_count", 0) > 0:
        raise ModelError(f"{path}: mixture-of-experts models are not supported")

    tensors, starts = {}, {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists ne0 (cols) first
        qtype = t.tensor_type.name
        if qtype not in QUANT_TYPES:
            raise ModelError(
                f"{path}: tensor {t.name} has unsupported type {qtype}",
                hint=f"supported types: {', '.join(QUANT_TYPES)}; requantize with llama-quantize",
            )
        raw = reader.data[t.data_offset : t.data_offset + t.n_bytes]
        if len(shape) == 2:
            try:
                raw = raw.reshape(shape[0], QUANT_TYPES[qtype].row_bytes(shape[1]))
            except ValueError:
                raise ModelError(f"{path}: tensor {t.name} of shape {shape} does not fit {qtype} rows") from None
        tensors[t.name] = QTensor(t.name, qtype, shape, raw)
        starts[t.name] = int(t.data_offset)

    config = _read_config(meta, arch, tensors, path)
    _check_tensors(config, tensors, path)
    model = Model(
        path=path,
        offset=offset,
        size=len(reader.data),
        name=meta.get_str("general.name", path.stem),
        config=config,
        vocab=_read_vocab(meta, path),
        tensors=tensors,
    )
    return model, starts


# --- the index cache ---------------------------------------------------------------------------------------
#
# One JSON file per opened GGUF under $INGOT_CACHE_DIR/index (or $XDG_CACHE_HOME/ingot/index): the Config and
# Vocab this module read, and each tensor's type, shape and byte range. Keyed by (realpath, offset, size, file
# size, mtime_ns, ctime_ns, inode, device), so a rewritten or replaced file misses and is parsed again. Only
# this module writes or reads it; the GGUF keys are still read nowhere else.

_INDEX_SCHEMA = "ingot-model-index-v2"  # v2: Config gained the architecture's numbers


def _index_file(path: Path, offset: int, size: int | None, st: os.stat_result) -> Path:
    key = json.dumps(
        [
            _INDEX_SCHEMA,
            str(path.resolve()),
            offset,
            size,
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            st.st_ino,
            st.st_dev,
        ]
    )
    return cache_root() / "index" / (hashlib.sha256(key.encode()).hexdigest()[:32] + ".json")


def _save_index(model: Model, starts: dict[str, int], index: Path) -> None:
    data = {
        "schema": _INDEX_SCHEMA,
        "name": model.name,
        "size": model.size,
        "config": asdict(model.config),
        "vocab": asdict(model.vocab),
        "tensors": [[t.name, t.qtype, list(t.shape), starts[t.name], t.raw.nbytes] for t in model.tensors.values()],
    }
    try:  # a cache: failing to write it must not fail the load
        write_atomic(index, json.dumps(data).encode())
    except OSError:
        pass


def _load_indexed(path: Path, offset: int, index: Path, file=None) -> Model | None:
    try:
        data = json.loads(index.read_text())
        if data.get("schema") != _INDEX_SCHEMA:
            return None
        window = np.memmap(path if file is None else file, mode="r")[offset : offset + data["size"]].view(np.ndarray)
        tensors = {}
        for name, qtype, shape, start, nbytes in data["tensors"]:
            raw = window[start : start + nbytes]
            if len(shape) == 2:
                raw = raw.reshape(shape[0], QUANT_TYPES[qtype].row_bytes(shape[1]))
            tensors[name] = QTensor(name, qtype, tuple(shape), raw)
        c = data["config"]
        if c.get("rope_freq_factors") is not None:
            c["rope_freq_factors"] = tuple(c["rope_freq_factors"])
        return Model(
            path=path,
            offset=offset,
            size=data["size"],
            name=data["name"],
            config=Config(**c),
            vocab=Vocab(**data["vocab"]),
            tensors=tensors,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Metadata:
    """Typed access to GGUF key/values, with one-line errors for missing keys."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.fields = reader.fields
        self.path = path
        self.decoded = getattr(reader, "decoded_strings", {})

    def _value(self, key: str, default, want_string: bool = False):
        f = self.fields.get(key)
        if f is None:
            if default is _REQUIRED:
                raise ModelError(f"{self.path}: missing metadata key {key}")
            return default
        from gguf import GGUFValueType  # deferred with the reader (see _window_reader_class)

        if len(f.types) != 1 or (f.types[0] == GGUFValueType.STRING) != want_string:
            raise ModelError(f"{self.path}: metadata key {key} should hold one {'string' if want_string else 'number'}")
        return f

    def get_str(self, key: str, default=None):
        f = self._value(key, _REQUIRED if default is None else default, want_string=True)
        return f if isinstance(f, str) else bytes(f.parts[-1]).decode("utf-8", errors="replace")

    def get_int(self, key: str, default=None) -> int:
        f = self._value(key, _REQUIRED if default is None else default)
        return f if isinstance(f, int) else int(f.parts[-1][0])

    def get_float(self, key: str, default=None) -> float:
        f = self._value(key, _REQUIRED if default is None else default)
        return f if isinstance(f, float) else float(f.parts[-1][0])

    def get_bool(self, key: str, default: bool) -> bool:
        f = self._value(key, None)
        return default if f is None else bool(f.parts[-1][0])

    def optional_int(self, key: str) -> int | None:
        f = self._value(key, None)
        return None if f is None else int(f.parts[-1][0])

    def strings(self, key: str) -> list[str] | None:
        f = self.fields.get(key)
        if f is None:
            return None
        from gguf import GGUFValueType  # deferred with the reader (see _window_reader_class)

        if f.types != [GGUFValueType.ARRAY, GGUFValueType.STRING] and f.data:
            raise ModelError(f"{self.path}: metadata key {key} should hold a list of strings")
        value_at = f.offset + sum(int(p.nbytes) for p in f.parts[:3])  # after key length, key, type
        if value_at in self.decoded:
            return self.decoded[value_at]
        return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]

    def numbers(self, key: str) -> np.ndarray | None:
        f = self.fields.get(key)
        if f is None:
            return None
        from gguf import GGUFValueType  # deferred with the reader

        if f.types[-1] == GGUFValueType.STRING:
            raise ModelError(f"{self.path}: metadata key {key} should hold numbers")
        return np.concatenate([f.parts[i] for i in f.data]) if f.data else np.zeros(0)


_REQUIRED = object()


def check_architecture(arch: str, path: Path | str) -> Architecture:
    """The architecture's description, or a ModelError naming it and what is supported."""
    if arch not in ARCHITECTURES:
        raise ModelError(
            f"{path}: unsupported architecture {arch!r}",
            hint=f"Ingot runs {', '.join(ARCHITECTURES)}; convert or pick a model of one of these",
        )
    return ARCHITECTURES[arch]


def _read_config(meta: _Metadata, arch: str, tensors: dict[str, QTensor], path: Path) -> Config:
    a = ARCHITECTURES[arch]
    if "token_embd.weight" not in tensors:
        raise ModelError(f"{path}: missing tensor token_embd.weight")

    def bounded(key: str, hi: int, default=None) -> int:
        n = meta.get_int(f"{arch}.{key}", default)
        if not 1 <= n <= hi:
            raise ModelError(f"{path}: {arch}.{key} is {n} (expected 1..{hi:,})")
        return n

    dim = bounded("embedding_length", MAX_WIDTH)
    n_heads = bounded("attention.head_count", MAX_HEADS)
    n_kv_heads = bounded("attention.head_count_kv", n_heads, n_heads)
    head_dim = bounded("attention.key_length", MAX_HEAD_DIM, max(dim // n_heads, 1))
    if meta.get_int(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelError(f"{path}: different key and value head sizes are not supported")
    if n_heads % n_kv_heads:
        raise ModelError(f"{path}: {n_heads} attention heads is not a multiple of {n_kv_heads} KV heads")
    rope_dim = bounded("rope.dimension_count", head_dim, head_dim)
    if rope_dim % 2:
        raise ModelError(f"{path}: {arch}.rope.dimension_count is {rope_dim} (expected an even number)")
    n_layers = bounded("block_count", min(MAX_LAYERS, max(len(tensors) // 9, 1)))
    ffn_dim = bounded("feed_forward_length", MAX_WIDTH)
    n_ctx_train = bounded("context_length", MAX_CTX)
    norm_eps = meta.get_float(f"{arch}.attention.layer_norm_rms_epsilon")
    rope_theta = meta.get_float(f"{arch}.rope.freq_base", 10000.0)
    for key, x in (("attention.layer_norm_rms_epsilon", norm_eps), ("rope.freq_base", rope_theta)):
        if not (math.isfinite(x) and x > 0):
            raise ModelError(f"{path}: {arch}.{key} is {x} (expected a positive number)")
    n_vocab = tensors["token_embd.weight"].shape[0]
    if not 1 <= n_vocab <= MAX_WIDTH:
        raise ModelError(f"{path}: token_embd.weight has {n_vocab:,} rows (expected 1..{MAX_WIDTH:,})")

    scaling = meta.get_str(f"{arch}.rope.scaling.type", "none")
    rope_scale = meta.get_float(f"{arch}.rope.scaling.factor", 1.0) if scaling not in ("none", "") else 1.0
    if rope_scale <= 0 or (scaling != "linear" and rope_scale != 1.0):
        raise ModelError(
            f"{path}: rope scaling {scaling!r} (factor {rope_scale}) is not supported",
            hint="linear scaling and Llama 3.1-style scaling via rope_freqs.weight are",
        )
    factors = None
    if "rope_freqs.weight" in tensors:
        factors = tuple(float(f) for f in tensors["rope_freqs.weight"].dequantize().reshape(-1))
        if len(factors) != rope_dim // 2:
            raise ModelError(f"{path}: rope_freqs.weight has {len(factors)} values, expected {rope_dim // 2}")

    n_layers = meta.get_int(f"{arch}.block_count")
    sliding_window = meta.get_int(f"{arch}.attention.sliding_window", 0) if a.swa_pattern else 0
    softcaps = [
        meta.get_float(f"{arch}.{k}_logit_softcapping", 0.0) if a.softcapping else 0.0 for k in ("attn", "final")
    ]
    return Config(
        arch=arch,
        n_vocab=n_vocab,
        n_ctx_train=n_ctx_train,
        dim=dim,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_dim=ffn_dim,
        norm_eps=norm_eps,
        rope_theta=rope_theta,
        rope_dim=rope_dim,
        rope_neox=a.rope_neox,
        rope_freq_factors=factors,
        qkv_bias=a.qkv_bias if a.qkv_bias is not None else "blk.0.attn_q.bias" in tensors,
        tied_embeddings="output.weight" not in tensors,
        # the GGUF's own key when it has one (llama.cpp's `<arch>.attention.scale`), else the architecture's rule
        attn_scale=meta.get_float(f"{arch}.attention.scale", 0.0) or a.attn_scale(n_layers, dim, n_heads, head_dim),
        sliding_window=sliding_window,
        rope_theta_local=(a.local_rope_theta or 0.0) if sliding_window else 0.0,
        rope_scale=rope_scale,
        attn_softcap=softcaps[0],
        final_softcap=softcaps[1],
    )


def expected_shapes(c: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor the forward pass reads, with its math-order shape."""
    sizes = {
        "D": c.dim,
        "Q": c.n_heads * c.head_dim,
        "KV": c.n_kv_heads * c.head_dim,
        "F": c.ffn_dim,
        "HD": c.head_dim,
    }
    shapes = {"token_embd.weight": (c.n_vocab, c.dim), "output_norm.weight": (c.dim,)}
    if not c.tied_embeddings:
        shapes["output.weight"] = (c.n_vocab, c.dim)
    block = {
        name: tuple(sizes[s] for s in dims.split(",")) for name, dims in block_tensors(c.block, c.qkv_bias).items()
    }
    for i in range(c.n_layers):
        shapes |= {f"blk.{i}.{name}": shape for name, shape in block.items()}
    return shapes


def _check_tensors(c: Config, tensors: dict[str, QTensor], path: Path) -> None:
    for name, shape in expected_shapes(c).items():
        t = tensors.get(name)
        if t is None:
            raise ModelError(f"{path}: missing tensor {name}")
        if t.shape != shape:
            raise ModelError(f"{path}: tensor {name} has shape {t.shape}, expected {shape}")


def _read_vocab(meta: _Metadata, path: Path) -> Vocab:
    tokens = meta.strings("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelError(f"{path}: no tokenizer vocabulary (tokenizer.ggml.tokens)")
    types = meta.numbers("tokenizer.ggml.token_type")
    scores = meta.numbers("tokenizer.ggml.scores")
    model = meta.get_str("tokenizer.ggml.model")
    n = len(tokens)
    longest = max(len(t) for t in tokens)
    if longest > MAX_TOKEN_CHARS:
        raise ModelError(f"{path}: a vocabulary entry of {longest:,} characters (at most {MAX_TOKEN_CHARS:,})")
    for key, values in (("tokenizer.ggml.token_type", types), ("tokenizer.ggml.scores", scores)):
        if values is not None and len(values) != n:
            raise ModelError(f"{path}: {key} has {len(values):,} entries for {n:,} tokens")
    if scores is not None and not np.isfinite(np.asarray(scores, dtype=np.float64)).all():
        raise ModelError(f"{path}: tokenizer.ggml.scores holds NaN or infinite values")
    for key in ("bos", "eos", "eot", "eom", "unknown"):
        i = meta.optional_int(f"tokenizer.ggml.{key}_token_id")
        if i is not None and not 0 <= i < n:
            raise ModelError(f"{path}: tokenizer.ggml.{key}_token_id is {i}, outside the {n:,}-token vocabulary")
    return Vocab(
        model=model,
        pre=meta.get_str("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        types=[1] * len(tokens) if types is None else [int(t) for t in types],
        scores=None if scores is None else [float(s) for s in scores],
        merges=meta.strings("tokenizer.ggml.merges"),
        bos_id=meta.optional_int("tokenizer.ggml.bos_token_id"),
        eos_id=meta.optional_int("tokenizer.ggml.eos_token_id"),
        eot_id=meta.optional_int("tokenizer.ggml.eot_token_id"),
        eom_id=meta.optional_int("tokenizer.ggml.eom_token_id"),
        unk_id=meta.optional_int("tokenizer.ggml.unknown_token_id"),
        # llama.cpp's defaults when the flags are absent: SentencePiece vocabularies add BOS and a space prefix
        add_bos=meta.get_bool("tokenizer.ggml.add_bos_token", model == "llama"),
        add_eos=meta.get_bool("tokenizer.ggml.add_eos_token", False),
        add_space_prefix=meta.get_bool("tokenizer.ggml.add_space_prefix", model == "llama"),
        chat_template=meta.get_str("tokenizer.chat_template", "") or None,
    )


# --- the description a bundle records -------------------------------------------------------------


def _scalar(value):
    """GGUF metadata values -> plain JSON scalars (numpy ints/floats/bools come out of the reader)."""
    if isinstance(value, (bool, str)):
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def describe_file(path: Path) -> dict:
    """What a bundle's manifest records about a GGUF: architecture, name, hyperparameters (every `<arch>.*`
    metadata key, as stored), quant types (the set, and each tensor's), tensor count and tokenizer summary. Read
    with gguf's own reader, whole-file, so it describes even a model this runtime cannot run (pack refuses those at
    the self-test)."""
    import gguf  # deferred: gguf imports ~100 ms of numpy-heavy modules; `ingot run` reads the index cache

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise ModelError(
            f"{path}: not a readable GGUF model ({type(e).__name__}: {e})",
            hint="pass a .gguf file (llama.cpp's convert_hf_to_gguf.py writes them)",
        ) from None

    def value(key: str, default=None):
        field = reader.fields.get(key)
        return _scalar(field.contents()) if field is not None and len(field.types) == 1 else default

    arch = value("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path}: GGUF has no general.architecture", hint="re-convert the model with llama.cpp")
    hyper = {
        k[len(arch) + 1 :]: value(k) for k, f in reader.fields.items() if k.startswith(arch + ".") and len(f.types) == 1
    }
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "name": value("general.name"),
        "hyperparameters": dict(sorted(hyper.items())),
        "quant_types": sorted({t.tensor_type.name for t in reader.tensors}),
        "tensor_types": {t.name: t.tensor_type.name for t in sorted(reader.tensors, key=lambda t: t.name)},
        "n_tensors": len(reader.tensors),
        "tokenizer": {
            "model": value("tokenizer.ggml.model"),
            "pre": value("tokenizer.ggml.pre"),
            "n_tokens": len(tokens.data) if tokens is not None else 0,
            "chat_template": "tokenizer.chat_template" in reader.fields,
        },
    }
