"""The Triton kernels run on the CPU under Triton's interpreter in these tests.

`triton.jit` decides at decoration time whether a kernel is interpreted, so the variable must
be set before `streamer.kernels.triton_attention` is first imported; pytest loads this file
while collecting, before any test module of this folder (or any test) imports it.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"
