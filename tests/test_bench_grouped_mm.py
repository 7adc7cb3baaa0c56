"""tools/bench_grouped_mm.py: the forms it times compute the same products and gradients (CPU, fp32)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import bench_grouped_mm  # noqa: E402


@pytest.mark.skipif(bench_grouped_mm.GROUPED_MM is None, reason="this torch has no grouped GEMM")
def test_every_form_gives_torchs_outputs_and_gradients():
    torch.manual_seed(0)
    offs_E = torch.tensor([10, 10, 25, 40], dtype=torch.int32)  # an empty expert among them
    x0, w0, dy = torch.randn(40, 16), torch.randn(4, 16, 24), torch.randn(40, 24)
    results = {}
    for form in ("torch", "nt", "nk", "nk+nt"):
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        y = bench_grouped_mm.form_mm(form, x, w, offs_E)
        y.backward(dy)
        results[form] = (y.detach(), x.grad, w.grad)
    for form, got in results.items():
        for a, b in zip(got, results["torch"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=form)
    assert results["torch"][2][1].abs().sum() == 0  # the empty expert gets no gradient
