"""Code that speaks another framework's protocol, one module per framework (docs/design.md, 'What each
module holds'). Each imports its framework only when used; `import torch_cutbce` imports none of them.

- `torch_cutbce.integrations.replay`: `CutBCE`, RePlay's loss protocol (`SasRec(body, loss=CutBCE())`).
- `torch_cutbce.integrations.rectools`: `CutBCEModule`, RecTools' Lightning module for its SASRec and
  BERT4Rec (`loss="cutbce", lightning_module_type=CutBCEModule`); importing it imports RecTools.
- `torch_cutbce.integrations.recbole`: RecBole's `SASRec` and `BERT4Rec` with `loss_type="CutBCE"`
  (`Config(model=SASRec, ...)`); importing it imports RecBole.
"""
