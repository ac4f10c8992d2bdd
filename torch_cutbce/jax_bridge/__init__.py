"""The torch half of the bridges to the JAX engines: `ops` holds what both share (each custom op's
fake and autograd rule), `xla` registers them through torch_xla's `call_jax` (backend 'xla',
'xla_blocked', 'xla_pallas'), `tpu` through TorchTPU's `torch.tpu.pallas.jax_op` ('torch_tpu').
What each op computes is the JAX half, `jax_kernels/bridge.py`.

The only modules of torch_cutbce that import jax, torch_xla or torch_tpu, and only when the registry
(`torch_cutbce/engines.py`) first needs a bridge: importing this package imports none of them.
"""
