"""Running as on a CPU with fewer instructions than this one, to test the probe-decided kernels there.

Which kernels run, and whether their rows are independent of their company, is decided on each
machine by probes (``kernels``, ``aoti_kernels``, ``aoti_layers``, ``aoti_attention``); the code
paths behind them differ by instruction set: AMX tiles on a recent Xeon, AVX-512 on an EPYC Zen 4,
AVX2 on older EPYCs. A machine can run the paths of the instruction sets below its own, so the
suite's exactness tests can run there as on those CPUs (``tests/test_as_<set>.py``):

- PyTorch's own kernels follow ``ATEN_CPU_CAPABILITY``, oneDNN's ``DNNL_MAX_CPU_ISA``;
- inductor (the AOTInductor kernels' C++) follows ``ATEN_CPU_CAPABILITY`` but picks AMX whenever
  the CPU has it, so for an AVX-512 CPU without AMX ``apply`` hides AMX from it.

``DFLASH_EMULATE_ISA`` names the emulated set in a process (``apply`` reads it; the suite's
conftest calls it). What is not emulated: the CPU's caches and memory, so timings mean nothing.
"""

from __future__ import annotations

import argparse
import os

VARIABLE = "DFLASH_EMULATE_ISA"
# name -> the environment a process needs from its start (PyTorch and oneDNN read it once).
ISAS: dict[str, dict[str, str]] = {
    # An AVX-512 CPU with AVX512-BF16 but no AMX (an EPYC Zen 4, a Cooper Lake Xeon).
    "avx512-no-amx": {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"},
    # An AVX2-only CPU (EPYC Zen 2 / 3).
    "avx2": {"DNNL_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def has_amx() -> bool:
    import torch

    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe is not None and probe())


def emulable() -> list[str]:
    """The instruction sets this CPU can run as, below its own (none on an AVX2-only CPU)."""
    import torch

    if VARIABLE in os.environ:  # already emulating: the real CPU is hidden
        return []
    capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return ["avx512-no-amx", "avx2"] if has_amx() else ["avx2"]
    return []


def environment(isa: str) -> dict[str, str]:
    """What a process must start with to run as a CPU with ``isa``."""
    if isa not in ISAS:
        raise ValueError(f"unknown instruction set {isa!r}; known: {', '.join(ISAS)}")
    return {**ISAS[isa], VARIABLE: isa}


def apply() -> str | None:
    """In a process started with ``environment(isa)``: hide AMX from inductor where ``isa`` lacks
    it, and check that PyTorch and inductor run as that CPU (raises otherwise, so that a test
    under emulation cannot pass on the real CPU's paths). Returns the emulated set, or None."""
    isa = os.environ.get(VARIABLE)
    if not isa:
        return None
    environment(isa)  # a known name
    import torch
    import torch._inductor.cpu_vec_isa as vec_isa  # seconds to import: only when emulating

    real = vec_isa.valid_vec_isa_list
    if not getattr(real, "emulating", False):
        def without_amx() -> list:
            return [i for i in real() if not isinstance(i, vec_isa.VecAMX)]

        without_amx.emulating = True
        vec_isa.valid_vec_isa_list = without_amx
    picked = vec_isa.pick_vec_isa()
    capability = torch.backends.cpu.get_cpu_capability()
    if isa == "avx2":
        right = isinstance(picked, vec_isa.VecAVX2) and not isinstance(picked, vec_isa.VecAVX512)
    else:  # AVX-512 with its VNNI extension where the CPU has it, as an EPYC Zen 4's
        right = isinstance(picked, vec_isa.VecAVX512) and not isinstance(picked, vec_isa.VecAMX)
    if capability != ISAS[isa]["ATEN_CPU_CAPABILITY"].upper() or not right:
        raise RuntimeError(f"emulating {isa}: PyTorch runs {capability}, inductor picks {type(picked).__name__}")
    return isa


if __name__ == "__main__":  # `env $(python -m dflash_core.isa_emulation avx2) python -m dflash_core bench ...`
    parser = argparse.ArgumentParser(description="The environment that runs a process as a CPU with fewer instructions.")
    parser.add_argument("isa", choices=list(ISAS))
    print(" ".join(f"{name}={value}" for name, value in environment(parser.parse_args().isa).items()))
