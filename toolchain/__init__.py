"""Ingot's build toolchain: kernel builds, the release arch policy, pack, sign, provenance, rebuild checks,
doctor, and the `ingot` CLI (toolchain/cli/). It is built on the runtime (ingot.runtime) and never the reverse."""
