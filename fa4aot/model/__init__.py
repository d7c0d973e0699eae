"""Vocabulary, pure and importable in milliseconds: what FA4 can run (`constraints`), specs,
variants and FA4's compile-key model (`compile_keys`), what a spec needs, the FP8 contract."""
