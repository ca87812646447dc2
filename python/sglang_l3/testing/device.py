"""Which device the cache stack of the tests and benchmarks runs on.

`cpu` (the default): the device pools are CPU tensors, the CPU switch
(`sglang_l3.cpu`) supplies the host pools' transfer ops, and the integration tests
run on the simulated asynchronous device (`sglang_l3.sim.harness`). `cuda` (asked
for with SGLANG_L3_TEST_DEVICE=cuda, on a machine with a CUDA or ROCm GPU): the
device pools live on the GPU, upstream's load/write streams and events are real,
host pools are pinned as upstream pins them, and there is no simulator (the tests
that drive it are skipped, saying so). Nothing a serving process runs reads this.
"""

from __future__ import annotations

from sglang_l3 import envs

ENV = "SGLANG_L3_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


class DeviceUnavailable(RuntimeError):
    pass


def stack_device() -> str:
    """The device asked for (SGLANG_L3_TEST_DEVICE; `cpu` when unset). Asking for
    `cuda` where torch sees no GPU is an error, not a silent CPU run."""
    name = envs.value(ENV).strip().lower() or "cpu"
    if name not in DEVICES:
        raise ValueError(f"{ENV}={name!r}: one of {', '.join(DEVICES)}")
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"{ENV}=cuda, but torch sees no CUDA/ROCm device")
    return name


def on_gpu() -> bool:
    """The stacks of this process run on a real device (no simulator there)."""
    return stack_device() != "cpu"


SIM_ONLY_REASON = (
    "drives the simulated asynchronous device, which exists on the CPU stack only (SGLANG_L3_TEST_DEVICE=cuda)"
)
