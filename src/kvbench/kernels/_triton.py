"""Triton, imported once, and ``jit``: kernels decorated at their first launch rather than at import.

Why late decoration: ``triton.jit`` reads ``TRITON_INTERPRET`` when it decorates, and a compiled
(``JITFunction``) kernel cannot run on CPU tensors. Decorating at import would fix the mode for the whole
process at the moment anything first imported :mod:`kvbench.kernels` (for instance the cache, while a test
session is being collected). Here each kernel is decorated per mode the first time it is launched, so
setting ``TRITON_INTERPRET=1`` before a call (a test fixture) runs it in the interpreter on the CPU.

Triton's own standard library (``tl.max``, ``tl.min``, ``tl.sum``, ``tl.cdiv``, ``tl.zeros``) is decorated
when Triton is imported, in the mode of that moment, and torch imports Triton early (``torch._dynamo``), so
in a CPU session those functions are compiled-only and an interpreted kernel cannot call them. The kernels
here therefore use only Triton builtins: the reductions below (``tl.reduce`` with the standard combine
functions, which the interpreter recognises and runs in numpy), integer arithmetic for cdiv, ``tl.full``.

Without Triton (CPU-only or macOS torch wheels ship none) the package still imports and its torch
references run; launching a kernel raises.
"""
import types

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - Linux torch wheels depend on Triton
    triton = None
    # kernel signatures annotate ``tl.constexpr`` at definition time; nothing else of tl is read then
    tl = types.SimpleNamespace(constexpr=object)

HAVE_TRITON = triton is not None


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` is set (read now, with Triton's own parser)."""
    return HAVE_TRITON and bool(triton.knobs.runtime.interpret)


class LazyJit:
    """A Triton function decorated with ``triton.jit`` at first use, once per interpreter mode.

    Device helpers called inside a kernel are ``LazyJit`` objects too; a kernel is decorated with a copy of
    its module globals in which each ``LazyJit`` it calls is replaced by its decoration in the same mode, so
    compiled kernels call compiled helpers and interpreted kernels interpreted ones.
    """

    def __init__(self, fn):
        self.fn = fn
        self._by_mode = {}

    def resolve(self):
        """The ``triton.jit`` decoration of the function for the current ``TRITON_INTERPRET``.

        Raises RuntimeError when Triton is not installed.
        """
        if not HAVE_TRITON:
            raise RuntimeError(f"Triton is not installed: cannot launch {self.fn.__name__} (set KVBENCH_KERNELS=torch)")
        mode = interpreting()
        if mode not in self._by_mode:
            glob = dict(self.fn.__globals__)
            for name in self.fn.__code__.co_names:   # the globals the body reads: its helpers, not its siblings
                if isinstance(glob.get(name), LazyJit):
                    glob[name] = glob[name].resolve()
            fn = types.FunctionType(self.fn.__code__, glob, self.fn.__name__, self.fn.__defaults__, self.fn.__closure__)
            self._by_mode[mode] = triton.jit(fn)
        return self._by_mode[mode]

    def __getitem__(self, grid):
        return self.resolve()[grid]


def jit(fn) -> LazyJit:
    """Decorator: ``@jit`` instead of ``@triton.jit`` (see the module docstring)."""
    return LazyJit(fn)


def unit_stride(t):
    """``t`` with unit stride in its last dim (kernels address rows by stride and columns by offset)."""
    return t if t.numel() == 0 or t.stride(-1) == 1 else t.contiguous()


def nonempty(t):
    """``t``, or a one-element tensor of its dtype when ``t`` is empty: a pointer argument the kernel never
    reads (zero-trip loop or masked load) still has to point somewhere valid for the GPU launcher."""
    return t if t.numel() else t.new_zeros(1)


def next_pow2(n: int, floor: int = 16) -> int:
    """Smallest power of two >= max(n, floor): a block size (``tl.arange`` needs powers of two, ``tl.dot``
    at least 16 on the GPU)."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


@jit
def reduce_max(x, axis: tl.constexpr):
    """``tl.max(x, axis)`` from builtins only (module docstring)."""
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@jit
def reduce_min(x, axis: tl.constexpr):
    """``tl.min(x, axis)`` from builtins only (module docstring)."""
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@jit
def reduce_sum(x, axis: tl.constexpr):
    """``tl.sum(x, axis)`` from builtins only (module docstring)."""
    return tl.reduce(x, axis, tl.standard._sum_combine)
