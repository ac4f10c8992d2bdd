"""Code that speaks another framework's protocol, one module per framework (docs/design.md, 'What each
module holds'). Each imports its framework only when used; `import torch_cutbce` imports none of them.

- `torch_cutbce.integrations.replay`: `CutBCE`, RePlay's loss protocol (`SasRec(body, loss=CutBCE())`).
"""
