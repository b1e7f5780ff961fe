"""The device the kernel tests run on: "cpu" (the Triton kernels interpreted), or the CUDA device
that STREAMER_KERNEL_TEST_DEVICE names (compiled there). conftest.py, test_triton.py and
test_backend.py read it here."""

import os

VAR = "STREAMER_KERNEL_TEST_DEVICE"
DEVICE = os.environ.get(VAR, "cpu")
