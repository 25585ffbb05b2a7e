"""Whether Triton runs kernels compiled (CUDA) or through its CPU interpreter in this process.

Triton fixes the mode once, when `triton.language` is first imported: its own library
functions (tl.sum, tl.max, ...) are jitted then, from TRITON_INTERPRET. Setting the variable
afterwards changes nothing, so the interpreter needs TRITON_INTERPRET=1 in the environment
before anything (our kernels, or a library such as transformers) imports triton.
This module never imports triton itself unless triton is already loaded.
"""

from __future__ import annotations

import os
import sys


def interpret_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in {"1", "true", "yes", "on"}


def interpreter_active() -> bool:
    """True when Triton kernels launched in this process will run in the interpreter."""
    if "triton.language" not in sys.modules:
        return interpret_requested()  # the first import will follow the variable
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.sum, InterpretedFunction)
