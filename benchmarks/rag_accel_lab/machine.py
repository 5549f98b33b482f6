"""What a timed run's page says of the CPU it ran on: bfloat16 speed depends on matrix units a CPU may lack."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_description(cpuinfo: str | None = None) -> str:
    """The CPU's model name and its bfloat16 support, from ``/proc/cpuinfo`` (Linux; elsewhere the platform's name).

    Example:
        >>> cpu_description("model name\\t: AMD EPYC\\nflags\\t\\t: fpu avx avx2 fma\\n")
        'AMD EPYC (AVX2, no bfloat16 instructions)'
        >>> cpu_description("model name\\t: Xeon\\nflags\\t\\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\\n")
        'Xeon (AVX-512, AVX-512 BF16, AMX)'
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.exists():
            return platform.processor() or platform.machine()
        cpuinfo = path.read_text()
    fields = dict(line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}  # one CPU's lines: its cores are alike
    if "flags" not in fields:  # not an x86 CPU (aarch64 names its "Features"): no x86 units to report
        return fields.get("model name") or platform.processor() or platform.machine()
    flags = set(fields["flags"].split())
    units = [name for flag, name in (("avx512f", "AVX-512"), ("avx512_bf16", "AVX-512 BF16"), ("amx_bf16", "AMX"))
             if flag in flags]
    if not units:
        units = ["AVX2" if "avx2" in flags else "no AVX2", "no bfloat16 instructions"]
    return f"{fields.get('model name', platform.machine())} ({', '.join(units)})"
