"""The native kernels as registered operators, ``torch.ops.apg.<name>``.

Each kernel is declared once, as a :class:`KernelOp`: a ``torch.library.custom_op`` whose
default implementation (every device) is its PyTorch twin and whose CPU kernel calls the
compiled C function (the twin where the library is not built, is switched off, or the
arguments are outside what the C function handles), with a fake implementation for shapes
(so a compiled graph can hold the op) and, where the kernel has a backward, its autograd
registered once, the backward being an operator of its own (``<name>_backward``).
``tests/apg/kernels/test_ops.py`` runs ``torch.library.opcheck`` on every one.

Calling a :class:`KernelOp` is what the math modules do, and the only way they reach a C
function (nothing outside ``apg/kernels/`` calls ``native_function``). In eager mode the
call does not go through the dispatcher: the dispatcher and the custom op's autograd
wrapper cost tens of microseconds a call, against a few for this path, and a GMM training
step makes about 40 kernel calls in 12 to 17 ms; through the dispatcher the step took 36-45%
longer (docs/kernels.md has the measurements). Eagerly, a call runs

- the C function, under an ``autograd.Function`` whose forward and backward are the
  registered op's own CPU implementations and autograd formula, where it applies;
- the twin itself otherwise, with its own autograd (plain PyTorch, or the twin's own
  ``autograd.Function``), exactly as the module computed before it had ops; so does an op
  without a backward whose inputs ask for a gradient (HMC differentiates the GMM's log
  joint in the latents).

Inside ``torch.compile`` a call traces the twin too, so inductor fuses it on a GPU and the
compiled path's numbers are what they were; a graph that should run the C function calls
``torch.ops.apg.<name>`` (its fake implementation gives the shapes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from apg.kernels import native_function

# every op, by name, for the opcheck test and the docs
REGISTRY: dict[str, KernelOp] = {}
# The ops' namespace: the package's own name, so that a renamed copy of the package loaded
# beside it (bench/ab_step.py's ``apg_old``) registers its ops apart.
NAMESPACE = __name__.split(".")[0]


def _tensors(args: Sequence[Any]) -> list[Tensor]:
    return [a for a in args if isinstance(a, Tensor)]


class KernelOp:
    """One C kernel as the operator ``apg::<name>``.

    - ``twin``: the PyTorch implementation, a plain function with type hints (they give
      the op's schema); it runs on every device and where the C function does not apply.
      It must return new tensors (no views of its inputs).
    - ``kernel`` and ``native(fn, *args)``: the C function's name in the library and the
      call of the resolved function ``fn`` (``apg.kernels.call``) on the op's arguments,
      returning what ``twin`` returns. Where ``kernel`` is a tuple of names, ``fn`` is the
      tuple of their functions.
    - ``applies(*args)``: whether the C function handles these arguments (shapes, sizes;
      dtypes and devices are ``native_function``'s business); default always.
    - ``checked(*args)``: the tensors whose dtype and device select the C function;
      default every tensor argument.
    - ``fake(*args)``: empty outputs of the right shapes, dtypes and strides.
    - ``backward``: the op of the backward (its arguments what ``setup_context`` saved and
      the output gradients); with it ``setup_context(ctx, inputs, output)`` and
      ``gradients(ctx, grads, run, wants)``, which returns one gradient per input from
      ``run``, the backward op (or, eagerly, its implementation) applied to whatever it
      needs; ``wants[i]``: whether input ``i`` needs its gradient.
    - ``eager_twin``: what runs eagerly where the C function does not apply (default
      ``twin``): the twin with its own autograd, where ``twin`` alone has none.
    """

    def __init__(
        self,
        name: str,
        twin: Callable[..., Any],
        *,
        kernel: str | tuple[str, ...],
        native: Callable[..., Any],
        fake: Callable[..., Any],
        applies: Callable[..., bool] | None = None,
        checked: Callable[..., Sequence[Tensor]] | None = None,
        backward: KernelOp | None = None,
        setup_context: Callable[[Any, tuple[Any, ...], Any], None] | None = None,
        gradients: Callable[..., tuple[Tensor | None, ...]] | None = None,
        eager_twin: Callable[..., Any] | None = None,
    ):
        if name in REGISTRY:
            raise ValueError(f"apg::{name} is already registered")
        if (backward is None) != (gradients is None) or (backward is None) != (setup_context is None):
            raise ValueError(f"apg::{name}: give backward, setup_context and gradients together")
        self.name, self.twin, self.kernel, self.native = name, twin, kernel, native
        self.applies, self.checked = applies, checked
        self.backward, self.setup_context, self.gradients = backward, setup_context, gradients
        self.eager_twin = eager_twin or twin
        self.op = torch.library.custom_op(f"{NAMESPACE}::{name}", twin, mutates_args=())
        self.op.register_kernel("cpu", self.cpu)
        self.op.register_fake(fake)
        if backward is not None:
            self.op.register_autograd(self._registered_backward, setup_context=setup_context)
        REGISTRY[name] = self

    def function(self, *args: Any):
        """The compiled function for these arguments (a tuple of them where ``kernel`` names
        several), or ``None`` where the twin must run."""
        if self.applies is not None and not self.applies(*args):
            return None
        return self.resolve(*(self.checked(*args) if self.checked is not None else _tensors(args)))

    def resolve(self, *checked: Tensor):
        """The compiled function(s) for tensors of ``checked``'s dtype and device, or ``None``."""
        if isinstance(self.kernel, str):
            return native_function(self.kernel, *checked)
        fns = tuple(native_function(name, *checked) for name in self.kernel)
        return None if fns[0] is None else fns

    def cpu(self, *args: Any) -> Any:
        """The op's CPU kernel: the C function where it applies, else the twin."""
        fn = self.function(*args)
        return self.twin(*args) if fn is None else self.native(fn, *args)

    def _registered_backward(self, ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:
        assert self.backward is not None and self.gradients is not None
        return self.gradients(ctx, grads, self.backward.op, ctx.needs_input_grad)

    def __call__(self, *args: Any) -> Any:
        if torch.compiler.is_compiling():
            return self.eager_twin(*args)
        fn = self.function(*args)
        if fn is None:
            return self.eager_twin(*args)
        if torch.is_grad_enabled():
            for a in args:
                if isinstance(a, Tensor) and a.requires_grad:
                    if self.backward is None:  # the C function would drop the gradient: the twin keeps it
                        return self.eager_twin(*args)
                    return _Eager.apply(self, fn, *args)
        return self.native(fn, *args)


class _Eager(torch.autograd.Function):
    """A :class:`KernelOp`'s native path with its registered autograd formula, outside the
    dispatcher (see the module's docstring). The op's ``setup_context`` runs inside
    ``forward``: an ``autograd.Function`` with a separate ``setup_context`` binds its
    arguments with ``inspect`` at every call, ~25 us."""

    @staticmethod
    def forward(ctx: Any, op: KernelOp, fn: Any, *args: Any) -> Any:  # type: ignore[override]
        output = op.native(fn, *args)
        ctx.kernel_op = op
        # the backward's C function, for the forward's dtype (where the forward's applies,
        # so does its backward)
        checked = op.checked(*args) if op.checked is not None else _tensors(args)
        ctx.backward_fn = op.backward.resolve(checked[0])  # type: ignore[union-attr]
        op.setup_context(ctx, args, output)  # type: ignore[misc]
        return output

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        op, fn = ctx.kernel_op, ctx.backward_fn
        backward = op.backward

        def run(*args: Any) -> Any:
            return backward.cpu(*args) if fn is None else backward.native(fn, *args)

        return None, None, *op.gradients(ctx, grads, run, ctx.needs_input_grad[2:])
