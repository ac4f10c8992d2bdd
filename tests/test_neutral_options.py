"""`CutBCEOptions`: one value for every non-tensor choice, and the custom ops that take it.

- `encode` is canonical JSON and `decode` its inverse, for any options (hypothesis); a bad string
  is a ValueError naming it. `resolved` sizes the tile and names the engine, as the JAX engines run it.
- No custom op of the package (`torch_cutbce::*`, and the bridge's `cutbce::*` where torch_xla is
  installed) has more than 10 parameters or names an option in its schema: adding an option
  never widens a signature.
- `torch.library.opcheck` passes on the native ops for a few option values.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cutbce_common.focal import MIN_GAMMA, Focal
from cutbce_common.loss import MIN_LABEL_SMOOTHING, Loss
from cutbce_common.options import CutBCEOptions, decode
from cutbce_common.shapes import BlockSizes
from torch_cutbce.native import ops

# Words that would mean an option leaked into an op's schema (its fields, and the focal ones).
OPTION_WORDS = {field.name for field in dataclasses.fields(CutBCEOptions)} | {
    "gamma", "alpha", "balancing", "apply_class_balancing", "label_smoothing", "smoothing", "mesh", "backend",
    "reduction"}
MAX_PARAMETERS = 10
PLAIN = CutBCEOptions().encode()

_names = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz_-0123456789"), min_size=1, max_size=6)


@st.composite
def options(draw):
    focal = draw(st.none() | st.builds(
        Focal,
        gamma=st.just(0.0) | st.floats(MIN_GAMMA, 8, allow_nan=False, allow_infinity=False),  # Focal's bounds
        alpha=st.floats(0, 1, allow_nan=False, allow_infinity=False),
        apply_class_balancing=st.booleans()))
    mesh = {}
    if draw(st.booleans()):
        axes = draw(st.lists(_names, min_size=1, max_size=3, unique=True))
        shape = draw(st.lists(st.integers(1, 8), min_size=len(axes), max_size=len(axes)))
        vocab = draw(st.sampled_from(axes))
        rest = [a for a in axes if a != vocab]
        data = draw(st.none() | (st.sampled_from(rest) if rest else st.none()))
        as_tuple = draw(st.booleans())
        mesh = dict(mesh_shape=tuple(shape), mesh_axes=tuple(axes), vocab_axis=(vocab,) if as_tuple else vocab,
                    data_axis=data)
    tiles = st.integers(1, 64).map(lambda k: 128 * k)
    block_sizes = st.builds(BlockSizes, tiles, tiles, st.none() | st.integers(1 << 20, 256 << 20))
    return CutBCEOptions(
        block_v=draw(st.none() | st.integers(1, 2**31)),
        compute_metrics=draw(st.booleans()),
        loss=Loss(focal, draw(st.sampled_from([0.0, 0.1, 1.0, MIN_LABEL_SMOOTHING]))),
        impl=draw(st.sampled_from(["auto", "blocked", "pallas"])),
        block_sizes=draw(st.none() | block_sizes),
        cpu_kernel=draw(st.booleans()),
        offset=draw(st.integers(0, 2**31)),
        id_limit=draw(st.none() | st.integers(1, 2**31)),
        **mesh,
    )


def _as_json_data(o: CutBCEOptions) -> dict:
    data = {f.name: getattr(o, f.name) for f in dataclasses.fields(o)}
    data["loss"] = dataclasses.asdict(o.loss)
    data["block_sizes"] = None if o.block_sizes is None else dataclasses.asdict(o.block_sizes)
    return data


@settings(max_examples=200, deadline=None)
@given(options())
def test_encode_is_canonical_json_and_decode_inverts_it(o):
    text = o.encode()
    assert text == json.dumps(_as_json_data(o), sort_keys=True, separators=(",", ":"))
    back = decode(text)
    assert back == o and hash(back) == hash(o)
    assert back.encode() == text
    assert dataclasses.replace(o).encode() == text  # equal options, equal strings (a cache key)


def test_plain_focal_is_stored_as_none():
    # Focal(gamma=0) without balancing is plain BCE: the same options, so the same string.
    assert CutBCEOptions(loss=Loss(Focal(gamma=0.0))).encode() == CutBCEOptions().encode()
    # So the engines see one Loss (one compiled program); with balancing it stays a focal.
    assert Loss(Focal(0.0, 0.9)) == Loss() and hash(Loss(Focal(0.0, 0.9))) == hash(Loss())
    assert Loss(Focal(0.0, 0.9, True)).focal == Focal(0.0, 0.9, True)


@pytest.mark.parametrize("text", [
    "",
    "not json",
    "[1, 2]",
    '{"block_v": 4}',  # fields missing
    PLAIN.replace("}", ',"gamma":2.0}'),  # an unknown field
    PLAIN.replace('"block_v":null', '"block_v":0'),
    PLAIN.replace('"block_v":null', '"block_v":true'),
    PLAIN.replace('"block_v":null', '"block_v":2.5'),
    PLAIN.replace('"compute_metrics":false', '"compute_metrics":1'),
    PLAIN.replace('"impl":"auto"', '"impl":"tpu"'),
    PLAIN.replace('"offset":0', '"offset":-1'),
    PLAIN.replace('"focal":null', '"focal":{"alpha":0.25,"apply_class_balancing":false,"gamma":-1.0}'),
    PLAIN.replace('"focal":null', '"focal":{"gamma":2.0}'),
    PLAIN.replace('"focal":null', '"focal":{"alpha":0.25,"apply_class_balancing":false,"gamma":NaN}'),
    PLAIN.replace('"mesh_shape":[]', '"mesh_shape":[2]'),  # a dimension without a name
    PLAIN.replace('"vocab_axis":null', '"vocab_axis":"model"'),  # an axis without a mesh
    PLAIN.replace('"cpu_kernel":true', '"cpu_kernel":1'),
    PLAIN.replace('"block_sizes":null', '"block_sizes":{"block_n":128,"block_v":100,"vmem_limit_bytes":null}'),
    PLAIN.replace('"block_sizes":null', '"block_sizes":{"block_n":128,"block_v":128}'),  # a field missing
])
def test_decode_names_a_bad_string(text):
    with pytest.raises(ValueError, match="is not a CutBCEOptions.encode\\(\\) string") as error:
        decode(text)
    assert repr(text) in str(error.value)


def test_decode_refuses_what_is_not_a_string():
    with pytest.raises(ValueError, match="options must be a str"):
        decode(b"{}")


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_v=0), "block_v must be an int >= 1, got 0"),
    (dict(block_v=True), "block_v must be an int >= 1, got True"),
    (dict(compute_metrics="yes"), "compute_metrics must be a bool"),
    (dict(impl="mosaic"), "impl must be one of"),
    (dict(mesh_shape=(2, 2), mesh_axes=("data",)), "must name each of the 2 mesh dimensions"),
    (dict(mesh_shape=(2,), mesh_axes=("data",), vocab_axis="model"), "vocab_axis='model' is not an axis of the mesh"),
    (dict(mesh_shape=(2,), mesh_axes=('da"ta',)), "printable ASCII name without quotes"),
    (dict(id_limit=0), "id_limit must be an int >= 1"),
    (dict(block_sizes=(128, 128)), "block_sizes must be a BlockSizes or None"),
    (dict(cpu_kernel=None), "cpu_kernel must be a bool"),
])
def test_bad_fields_are_named(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        CutBCEOptions(**kwargs)


def test_block_sizes_encode_as_an_object_and_resolved_sizes_the_tile():
    o = CutBCEOptions(block_sizes=BlockSizes(128, 256), cpu_kernel=False)
    assert '"block_sizes":{"block_n":128,"block_v":256,"vmem_limit_bytes":null}' in o.encode()
    assert '"cpu_kernel":false' in o.encode()
    # What a JAX engine runs: the default tile for these rows, at most V, and the engine named.
    wide = o.resolved(num_positions=8, num_items=100, impl="pallas")
    assert (wide.block_v, wide.impl, wide.block_sizes) == (100, "pallas", o.block_sizes)
    assert CutBCEOptions(block_v=64).resolved(num_positions=8, num_items=100, impl="blocked").block_v == 64
    with pytest.raises(ValueError, match="resolved impl must be an engine, one of \\('blocked', 'pallas'\\), got 'auto'"):
        o.resolved(num_positions=8, num_items=100, impl="auto")


def _package_ops():
    """`{qualified name: schema}` of every custom op the package registers (the bridge's where
    torch_xla is installed)."""
    import torch_cutbce.native.ops  # noqa: F401  (registers torch_cutbce::*)

    namespaces = ["torch_cutbce"]
    try:
        import torch_xla  # noqa: F401  (before jax)

        import torch_cutbce.jax_bridge.xla  # noqa: F401  (registers cutbce::*)

        namespaces.append("cutbce")
    except ImportError:
        pass
    schemas = {}
    for namespace in namespaces:
        for name in getattr(torch.ops, namespace):
            schemas[f"{namespace}::{name}"] = getattr(getattr(torch.ops, namespace), name).default._schema
    return schemas


def test_no_custom_op_names_an_option_or_takes_more_than_ten_parameters():
    schemas = _package_ops()
    assert {"torch_cutbce::rows", "torch_cutbce::rows_backward", "torch_cutbce::loss"} <= schemas.keys()
    for name, schema in schemas.items():
        parameters = [argument.name for argument in schema.arguments]
        assert len(parameters) <= MAX_PARAMETERS, f"{name} takes {len(parameters)} parameters: {schema}"
        assert not OPTION_WORDS & set(parameters) - {"options"}, f"{name} names an option: {schema}"
        assert parameters[-1] == "options" and str(schema.arguments[-1].type) == "str", str(schema)


def _native_inputs(seed=0, n=6, v=37, d=5, slots=3):
    g = torch.Generator().manual_seed(seed)
    return dict(
        hidden=torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True),
        item_weight=torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True),
        bias=torch.randn(v, generator=g, dtype=torch.float64, requires_grad=True),
        weight=torch.rand(n, generator=g, dtype=torch.float64),
        class_weight=torch.rand(v, generator=g, dtype=torch.float64) + 0.5,
        pos_weight=torch.rand(v, generator=g, dtype=torch.float64) + 0.5,
        targets=torch.randint(-1, v, (n, slots), generator=g),
    )


OPCHECK_OPTIONS = {
    "plain": CutBCEOptions(block_v=8),
    "focal, metrics, default tile": CutBCEOptions(compute_metrics=True, loss=Loss(Focal(2.0, 0.25, True))),
    "label smoothing and focal": CutBCEOptions(loss=Loss(Focal(0.5), label_smoothing=0.2)),
}


def opcheck_chunked_ops(chunked, t: dict, options: str, g_dtype: torch.dtype) -> None:
    """`torch.library.opcheck` of an engine's three custom ops (`chunked_ops.ChunkedOps`) on the tensors
    `t` (`_native_inputs`' keys): schemas, fakes against the real outputs, autograd registration."""
    for hidden_grad in (True, False):  # what the forward saves for the backward depends on it
        rows_args = (t["hidden"], t["item_weight"], t["targets"], t["bias"], t["class_weight"], t["pos_weight"],
                     hidden_grad, options)
        torch.library.opcheck(chunked.rows_op, rows_args)
        _, _, saved, ids = chunked.rows_op(*(x.detach() if isinstance(x, torch.Tensor) else x for x in rows_args))
        g = torch.rand(t["hidden"].shape[0], dtype=g_dtype)
        backward_args = (t["hidden"].detach(), t["item_weight"].detach(), ids, t["bias"].detach(), t["class_weight"],
                         t["pos_weight"], saved, g, [True, True, True], options)
        torch.library.opcheck(chunked.rows_backward_op, backward_args)
    loss_args = (t["hidden"], t["item_weight"], t["targets"], t["bias"], t["class_weight"], t["pos_weight"],
                 t["weight"], torch.tensor(37.0, dtype=torch.float64), [True, True, True], options)
    # Not test_aot_dispatch_dynamic: the one-pass backward scales its saved gradients in place
    # (mul_, once: a second backward raises), which that check's functionalized graph rejects
    # ("Node mul was invalid, but is output"), as before the options; torch.compile of the
    # whole loss is tests/test_torch_toolchain.py's.
    torch.library.opcheck(chunked.loss_op, loss_args, test_utils=("test_schema", "test_autograd_registration",
                                                                 "test_faketensor"))


@pytest.mark.parametrize("name", OPCHECK_OPTIONS)
def test_opcheck_native_ops(name):
    opcheck_chunked_ops(ops.OPS, _native_inputs(), OPCHECK_OPTIONS[name].encode(), torch.float64)
