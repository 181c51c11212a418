"""What a GPU can do at most, for `ingot bench`'s "share of the ceiling" column: memory bandwidth (what bounds
decode, which reads every weight once per step) and dense fp16/bf16 tensor-core throughput (what bounds prefill).

A small table keyed by compute capability and a substring of the device name (compute capability 9.0 is both
the H100 and the H200, whose memory differs). The H200 row is measured on the H200 this project benchmarks on
(device-to-device copy counting bytes read and written; an 8192^3 bf16 matrix product on random data, the mean
of ten after three warm-ups); the others are the vendors' datasheet figures for dense (not sparse) math, which
measured copies and GEMMs usually reach to 85-95%. A GPU not listed gets no share column rather than a guess.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ceiling:
    gpu: str  # the name the row matches
    memory_bytes_s: float  # HBM/GDDR bandwidth, bytes per second
    tensor_flop_s: float  # dense fp16/bf16 tensor-core FLOP/s with fp32 accumulation
    source: str  # "measured" or "datasheet"


# (compute capability, substring of the device name, ceiling); the first match wins, so the more specific
# names come first within a compute capability.
_TABLE: tuple[tuple[int, str, Ceiling], ...] = (
    (90, "H200", Ceiling("NVIDIA H200", 4.3e12, 790e12, "measured")),
    (90, "H100 PCIe", Ceiling("NVIDIA H100 PCIe", 2.0e12, 756e12, "datasheet")),
    (90, "H100", Ceiling("NVIDIA H100 SXM", 3.35e12, 989e12, "datasheet")),
    (90, "GH200", Ceiling("NVIDIA GH200", 4.0e12, 989e12, "datasheet")),
    (80, "A100-SXM4-80GB", Ceiling("NVIDIA A100 80GB SXM", 2.039e12, 312e12, "datasheet")),
    (80, "A100", Ceiling("NVIDIA A100 40GB", 1.555e12, 312e12, "datasheet")),
    (86, "A10", Ceiling("NVIDIA A10", 0.6e12, 125e12, "datasheet")),
    (89, "L40S", Ceiling("NVIDIA L40S", 0.864e12, 362e12, "datasheet")),
    (89, "L4", Ceiling("NVIDIA L4", 0.3e12, 121e12, "datasheet")),
    (89, "RTX 4090", Ceiling("NVIDIA GeForce RTX 4090", 1.008e12, 165e12, "datasheet")),
    (120, "RTX 5090", Ceiling("NVIDIA GeForce RTX 5090", 1.792e12, 209.5e12, "datasheet")),
)


def ceiling_for(name: str, cc: int) -> Ceiling | None:
    """The row for a device (its name as the driver reports it, compute capability as 90 for 9.0), or None."""
    for row_cc, needle, ceiling in _TABLE:
        if row_cc == cc and needle in name:
            return ceiling
    return None
