"""What the forward benchmarks share: timing eager against prepared, and a CPU's fair answer to
transformers' CUDA-capture probe. Imported by scripts run as ``python benchmarks/<script>.py``
(their folder is first on ``sys.path``)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def answer_cuda_capture_probe() -> None:
    """On a machine without a CUDA driver, answer ``torch.cuda.is_current_stream_capturing()`` False.

    transformers' eager forward asks it once per call; without a driver the call raises inside and
    is caught (~100 us on this 2-core CPU), a cost a GPU machine does not pay, which made CPU
    prepared/eager ratios ~2% kinder to fxprep than fxprep's own cost. On a machine with CUDA it is
    left alone."""
    if not torch.cuda.is_available():
        torch.cuda.is_current_stream_capturing = lambda: False


def alternating(eager: Callable[[], Any], prepared: Callable[[], Any], cuda: bool,
                repeat: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """Median (wall, host) seconds of ``eager()`` and of ``prepared()``, under ``torch.no_grad``,
    called in turn ``repeat`` times each.

    Alternating call by call: timed one block after the other, a shared CPU's drift decided the
    ratio (1.04x to 1.16x over three runs of gpu_check's launch-bound row where alternating calls
    gave 1.006x to 1.028x). Host time ends when the call returns, before the device is
    synchronised: where it is close to the wall time, the forward waits on Python, and the
    difference between the two is the device's."""
    walls: tuple[list[float], list[float]] = ([], [])
    hosts: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeat):
        for i, fn in enumerate((eager, prepared)):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                fn()
            hosts[i].append(time.perf_counter() - start)
            if cuda:
                torch.cuda.synchronize()
            walls[i].append(time.perf_counter() - start)
    return ((statistics.median(walls[0]), statistics.median(hosts[0])),
            (statistics.median(walls[1]), statistics.median(hosts[1])))
