"""Resource limits for parsing untrusted input, in one place.

A hostile file must cost nothing: every parser of bundle, model and request bytes checks counts, sizes and
nesting against these bounds (and against the bytes actually present) before it allocates, and refuses with
a one-line error (exit 4 for bundle structure, 5 for models). The README's "Limits" section lists them.

Where each bound is enforced:
    JSON (manifest, signature)   bounded_json_loads below: size, nesting depth
    tar headers                  bundle/container.py MAX_TAR_HEADER, MAX_MEMBERS
    GGUF metadata and tensors    model/gguf.py MAX_GGUF_* (counts, array lengths, dims, offsets vs file size)
    fatbin / ELF                 gpu/fatbin.py MAX_FATBIN_ENTRIES, offsets and sizes vs the buffer
    chat templates               model/chat.py TEMPLATE_TIME_S, TEMPLATE_OUTPUT_CHARS
"""

from __future__ import annotations

import json
import re
from itertools import accumulate

from ingot.runtime.errors import IngotError, VerificationError

MAX_JSON_DEPTH = 64  # manifest.json nests 5 deep, the signature 4; anything deeper is not ours

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEPS = bytes.maketrans(b"[{]}", b"\x02\x02\x00\x00")  # +1 / -1, offset by one to stay unsigned


def bounded_json_loads(
    data: bytes,
    *,
    what: str,
    max_size: int,
    max_depth: int = MAX_JSON_DEPTH,
    error: type[IngotError] = VerificationError,
    hint: str | None = None,
):
    """json.loads for untrusted bytes: at most max_size bytes and max_depth nested arrays/objects; anything
    else (too big, too deep, not UTF-8 JSON) raises `error` with one line naming `what`."""
    if len(data) > max_size:
        raise error(f"{what} is {len(data):,} bytes (at most {max_size:,})", hint=hint)
    # Depth first, without recursion (the C parser would recurse until RecursionError): drop the strings,
    # keep only the brackets, and take the running sum's maximum, all in C.
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    if len(brackets) > 2 * max_depth:  # cheap skip: fewer brackets cannot nest deeper
        steps = brackets.translate(_STEPS)
        if max(accumulate(b - 1 for b in steps), default=0) > max_depth:
            raise error(f"{what} nests deeper than {max_depth} levels", hint=hint)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise error(f"{what} is not valid UTF-8 JSON ({str(e)[:120]})", hint=hint) from None
