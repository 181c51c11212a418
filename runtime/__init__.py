"""Ingot's runtime: GGUF models, the CPU reference engine, the cuda-python GPU engine, the server."""
