"""The Triton kernels run on the CPU under Triton's interpreter in these tests, or compiled on a
CUDA GPU when STREAMER_KERNEL_TEST_DEVICE names one (`STREAMER_KERNEL_TEST_DEVICE=cuda python -m
pytest tests/kernels`): then nothing is interpreted, and the Triton tests build their caches,
queries and models on that device.

`triton.jit` decides at decoration time whether a kernel is interpreted, so the variable must
be set before `streamer.kernels.triton_attention` is first imported; pytest loads this file
while collecting, before any test module of this folder (or any test) imports it.
"""

import os

import pytest
from testdevice import DEVICE, VAR

if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
else:
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError(f"{VAR}={DEVICE}: this torch sees no CUDA device")
    os.environ.pop("TRITON_INTERPRET", None)


@pytest.fixture()
def kernel_device():
    """The device the Triton tests run on; torch's default device while the test runs, so the
    tensors a test makes without naming a device land there."""
    import torch

    torch.set_default_device(DEVICE)
    yield DEVICE
    torch.set_default_device("cpu")
