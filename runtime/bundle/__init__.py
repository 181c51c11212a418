"""Bundles as a target machine reads them: the container (tar), the manifest and root digest, signatures,
streaming verification, the verified-stamp cache, and `open_bundle` (verify, then hand over the model's
byte range and the verified fatbins). Writing bundles is the toolchain's (pack, sign) through container.py.

    manifest.py   the manifest format, canonical JSON, digests, the root digest
    container.py  the tar: reading the index and members, and the deterministic writer
    signature.py  the signature format (Sigstore bundle of a DSSE/in-toto statement; P-256, Ed25519) and its check
    stamps.py     the verified-stamp cache
    verify.py     `ingot verify`: every digest, streaming
    open.py       `open_bundle`, what `ingot run/serve BUNDLE` call
"""
