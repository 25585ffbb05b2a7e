"""A stand-in for `--weights auto`'s kernel timing, so plan choices can be tested on chosen
figures."""

from __future__ import annotations

FP16_SMALL_FP32_LARGE = {"fp32": {1: 2.0, 64: 1.0}, "fp16": {1: 1.0, 64: 2.0}}


class AutoTimer:
    """Stands in for `weights_choice.time_kernels`: records each call's formats and sizes, and
    answers `result` for the formats asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], tuple[int, ...]]] = []
        self.result: dict[str, dict[int, float]] = FP16_SMALL_FP32_LARGE

    def __call__(self, kernels, sizes, rounds=1):
        self.calls.append((tuple(kernels), tuple(sizes)))
        return {f: self.result[f] for f in kernels}
