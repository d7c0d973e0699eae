"""A trivial CuTe-DSL kernel that is not FA4's: an engine's own kernel, for the compile monitor
(the DSL reads a jit function's source, so it lives in a file)."""

import cutlass
import cutlass.cute as cute


@cute.jit
def noop(a: cutlass.Int32):
    cute.printf("fa4aot test %d", a)
