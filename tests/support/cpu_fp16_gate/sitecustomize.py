"""Run by Python at start-up in a test process that trains fp16 with DeepSpeed on a CPU whose
oneDNN has no fp16 (tests/support/hardware.py puts this directory on PYTHONPATH only there).

DeepSpeed's CPU accelerator refuses fp16 there ("Type fp16 is not supported on your device":
``CPU_Accelerator.is_fp16_supported`` asks oneDNN), although PyTorch computes fp16 on any CPU
with its reference kernels. When DeepSpeed loads that module, its answer becomes yes, so the
test runs DeepSpeed's real fp16 optimizers, loss scaler and fp32 sums. Nothing else changes:
PyTorch picks its kernels in C++."""

import importlib.abc
import importlib.util
import sys

ACCELERATOR = "deepspeed.accelerator.cpu_accelerator"


class LiftFp16Gate(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != ACCELERATOR:
            return None
        sys.meta_path.remove(self)  # find the real module, once
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.CPU_Accelerator.is_fp16_supported = lambda self: True

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, LiftFp16Gate())
