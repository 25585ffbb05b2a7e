"""Kernel tests run Triton on CPU through its interpreter, which must be chosen before triton loads."""

from __future__ import annotations

import os
import sys

# Triton reads TRITON_INTERPRET once, when triton.language is first imported (see
# kernels/triton_mode.py). Collection reaches this file before any test runs, so unless a test
# module imported triton at collection time, every later import (ours, or transformers') is
# interpreted. test_triton_interpret.py re-runs itself in a fresh process otherwise.
if "triton.language" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"
