"""Offline sm_90 compiles on a machine without a GPU, shared by ``bench_quantize.py --offline-sm90`` and
``sm90_sass_check.py``: Triton's driver faked to report an sm_90 target, every ``kernel[grid](...)`` launch
turned into a compile of the same arguments and constexprs, and the compiled kernel's ptxas report and SASS
from the tools Triton ships (``triton/backends/nvidia/bin``).
"""

from __future__ import annotations

import os
import subprocess
import tempfile

import triton
import triton.runtime.jit as _jit
from triton.backends.compiler import GPUTarget


class FakeDriver:
    """Just enough of Triton's active driver for the JIT to compile for sm_90 without a GPU."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


def install_compile_only() -> list:
    """Fake the driver and make every launch a compile-only warmup; returns the list the compiled kernels
    are appended to, one per launch."""
    triton.runtime.driver.set_active(FakeDriver())
    compiled = []
    run = _jit.JITFunction.run

    def run_compile_only(self, *args, grid, warmup, **kwargs):
        compiled.append(run(self, *args, grid=grid, warmup=True, **kwargs))
        return compiled[-1]

    _jit.JITFunction.run = run_compile_only
    return compiled


def ptxas_and_sass(k) -> tuple[str, str]:
    """(``ptxas -arch=sm_90a -v`` output, ``cuobjdump -sass`` of the kernel's cubin) of a compiled kernel ``k``."""
    bins = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        open(ptx, "w").write(k.asm["ptx"])
        log = subprocess.run([os.path.join(bins, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
                             capture_output=True, text=True)
        log = log.stdout + log.stderr
        open(cubin, "wb").write(k.asm["cubin"])
        sass = subprocess.run([os.path.join(bins, "cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True).stdout
    return log, sass
