"""Standard-library-only helpers that every layer may import.

It sits below `kernels` and imports nothing from Fleet, so the engine and the control
plane (which may not import each other's layers) can share it; see docs/architecture.md.
"""
