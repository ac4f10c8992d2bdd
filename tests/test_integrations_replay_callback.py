"""The RePlay `CutBCE` (torch_cutbce/integrations/replay.py) before a model set its `logits_callback`:
the error says so and what to do. No RePlay needed: the module imports nothing from it (the rest of
the integration runs in RePlay's own environment: tests/test_integrations_replay.py, ci/replay.sh)."""

from __future__ import annotations

import pytest
import torch

from torch_cutbce.integrations.replay import CutBCE

WHAT_TO_DO = r"CutBCE.logits_callback is not set yet.*set logits_callback yourself, or pass CutBCE\(item_embedding=...\)"


def test_the_loss_called_before_a_model_set_its_callback_says_so():
    """Issue 46: "'CutBCE' object has no attribute 'logits_callback'" (nn.Module's message hid the cause)."""
    embeddings, labels = torch.randn(2, 3, 4), torch.randint(1, 9, (2, 3))
    with pytest.raises(AttributeError, match=WHAT_TO_DO):
        CutBCE()(embeddings, None, labels, None, None, torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(AttributeError, match=WHAT_TO_DO):
        CutBCE().logits_callback  # noqa: B018
    assert not hasattr(CutBCE(), "logits_callback")  # still an AttributeError: RePlay's protocol


def test_other_missing_attributes_keep_torchs_message():
    with pytest.raises(AttributeError, match="'CutBCE' object has no attribute 'nothing_here'"):
        CutBCE().nothing_here  # noqa: B018
