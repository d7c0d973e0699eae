"""The FA4 layer: the only package that imports `cutlass` / `flash_attn` (lazily, on first use).

`driver` runs FA4's entry points with no GPU; `export` writes a variant's kernels; `forwards`
and `kernels` are fa4aot's forms of FA4's forward and its own CuTe-DSL kernels; `keys` reads
FA4's compile keys; `dropin` serves `flash_attn.cute` from the store (`fa4aot.install`).
"""
