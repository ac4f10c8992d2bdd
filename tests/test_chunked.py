"""The chunked engine's own promises (its conformance: test_conformance_chunked.py), in Triton's
interpreter (`TRITON_INTERPRET=1`, `ci/test.sh`): the chunk budget, the same bits on every run, one
chunk or many giving the same loss, and a chunk buffer that does not grow with V."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton's interpreter: run with TRITON_INTERPRET=1 (ci/test.sh does)", allow_module_level=True)
pytest.importorskip("triton")

from torch_cutbce import cut_bce_with_logits  # noqa: E402
from torch_cutbce.chunked import passes  # noqa: E402


def test_chunk_width_follows_the_budget():
    assert passes.chunk_width(None, 32_768, 2**20) == passes.CHUNK_BYTES // (32_768 * 4) == 4096
    assert passes.chunk_width(None, 10**9, 2**20) == passes.CHUNK_ALIGN  # never below one multiple
    assert passes.chunk_width(None, 16, 300) == 300  # at most V
    assert passes.chunk_width(64, 16, 300) == 64  # the call's block_v


def _step(dtype, block_v=None, num_items=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(9, 16, generator=g) * 2).to(dtype).requires_grad_()
    w = torch.randn(num_items, 16, generator=g).to(dtype).requires_grad_()
    b = torch.randn(num_items, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(-1, num_items, (9, 3), generator=g)
    loss = cut_bce_with_logits(h, w, targets, b, backend="chunked", block_v=block_v, label_smoothing=0.1)
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_same_bits_on_every_run_and_one_chunk_or_many_agree(dtype):
    first, again = _step(dtype, block_v=64), _step(dtype, block_v=64)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    whole = _step(dtype)  # one chunk
    assert torch.allclose(first[0], whole[0], rtol=1e-6, atol=0)


def test_the_chunk_buffer_does_not_grow_with_the_vocabulary(monkeypatch):
    """The one `[N, C]` float32 buffer the chunks reuse is the same size at 8x the items (the rest is
    O(N L), or the `[V, D]` inputs and gradients themselves)."""
    sizes = []
    init = passes._Chunks.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        sizes.append(self.buffer.numel())

    monkeypatch.setattr(passes._Chunks, "__init__", recording)
    _step(torch.float32, block_v=128, num_items=256)
    _step(torch.float32, block_v=128, num_items=2048)
    assert sizes == [9 * 128, 9 * 128]
