"""Run attention through ringkv's kernels and check it against the reference."""
import torch

import ringkv
from ringkv.kernels import attention

torch.manual_seed(0)
q = torch.randn(1, 4096, 8, 64)
k, v = torch.randn(1, 4096, 2, 64), torch.randn(1, 4096, 2, 64)
out, lse = attention(q, k, v, causal=True)
ref_out, ref_lse = attention(q, k, v, causal=True, backend="reference")
err = (out - ref_out).abs().max().item()
print(f"ringkv {ringkv.__version__}: causal GQA attention, S=4096 H=8 Hkv=2 D=64: max |out - reference| = {err:.2e}")
assert err < 1e-4
