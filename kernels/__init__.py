"""Attention, norm and rotary kernels for the engine: PyTorch references and Triton kernels.

Call them through `kernels.ops`, the single dispatch point (see docs/engine.md, "Kernel contract").
"""
