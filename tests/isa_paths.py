"""Run one kernel script under each instruction-set cap (ATEN_CPU_CAPABILITY also caps the
compiled kernels' -march): what a user's output would be on an AVX2 or a plain x86-64 CPU."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ON_AVX2 = os.path.exists("/proc/cpuinfo") and "avx2" in open("/proc/cpuinfo").read()


def outputs_per_path(tmp_path: Path, script: str) -> dict[str, object]:
    """``script`` (python -c; argv[1]: where to torch.save its output, argv[2]: random inputs made
    here, since torch's own random numbers differ between paths) under the native build, "avx2"
    and "default" (portable): {capability: its output}."""
    inputs = tmp_path / "inputs.pt"
    torch.save((torch.randn(48, 96), torch.randn(9, 96) * 4), inputs)
    outputs = {}
    for capability in ("", "avx2", "default"):
        path = tmp_path / f"out-{capability or 'native'}.pt"
        env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "SPECDEC_CACHE": str(tmp_path / "cache")}
        if not capability:
            env.pop("ATEN_CPU_CAPABILITY")
        subprocess.run([sys.executable, "-c", script, str(path), str(inputs)], env=env, check=True, capture_output=True)
        outputs[capability] = torch.load(path)
    return outputs
