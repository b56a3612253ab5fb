"""Triton kernels, one op per module, each beside its torch reference (`*_ref.py`)."""

import torch

# Activation dtypes every launcher accepts.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
