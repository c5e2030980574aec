"""One way to replace a transformers sub-module's ``forward`` in place (the fused norms, the
tiled MLPs): a function bound to the module as an instance-level method.

Bound (``types.MethodType``) rather than a closure over the module: ``copy.deepcopy`` of
the model rebinds a bound method to the copy, so a reference or EMA copy of a patched model
runs on its own weights. A module that already has someone else's instance-level
``forward`` (accelerate's hooks, a user's wrapper) is refused rather than silently unwrapped.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence

from torch import nn

__all__ = ["ForwardHandle", "install_forward", "check_forward"]


class ForwardHandle:
    """Undoes one module's installed forward and its attributes (``remove()``, as a hook
    handle); a forward installed by anything else since is left alone."""

    def __init__(self, module: nn.Module, func: Callable, attrs: tuple[str, ...] = ()):
        self.module, self.func, self.attrs = module, func, attrs

    def remove(self) -> None:
        forward = self.module.__dict__.get("forward")
        if getattr(forward, "__func__", None) is self.func:
            del self.module.__dict__["forward"]
            for name in self.attrs:
                self.module.__dict__.pop(name, None)


def check_forward(modules: Sequence[nn.Module], func: Callable | tuple[Callable, ...],
                  what: str) -> None:
    """ValueError naming ``what`` (the option that asks for ``func``) when a module already has
    an instance-level ``forward`` other than ``func`` (or one of a tuple) bound to it."""
    funcs = func if isinstance(func, tuple) else (func,)
    for m in modules:
        own = m.__dict__.get("forward")
        if own is not None and getattr(own, "__func__", None) not in funcs:
            raise ValueError(f"{what}: {type(m).__name__} already has its own forward wrapper "
                             f"({own!r}), which this would discard: remove it first, or leave "
                             f"{what} off")


def install_forward(modules: Sequence[nn.Module], func: Callable, what: str,
                    **attrs) -> list[ForwardHandle]:
    """Make ``func`` (``func(module, *args)``) each module's ``forward``, after setting
    ``attrs`` on it; installing the same ``func`` again replaces it (and its attributes).

    Returns: one handle per module.

    Raises: ValueError as :func:`check_forward`; then no module is changed.
    """
    check_forward(modules, func, what)
    for m in modules:
        for name, value in attrs.items():
            setattr(m, name, value)
        m.forward = types.MethodType(func, m)
    return [ForwardHandle(m, func, tuple(attrs)) for m in modules]
