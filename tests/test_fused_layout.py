"""The head-aligned layout of the fused projections (layers.fused_dense) computes what BFL's flat layout
did: the blocks below run on flat-layout params through a reference written as the blocks were before
the change (flat (dim, parts * dim) kernels, split after the GEMM), and on the same params reshaped."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import delayed_meta

from flux_jax import layers, math
from flux_jax.fp8_dot import FP8_COLLECTION, Fp8DotGeneral, Fp8Spec, fp8_matmul

DIM, HEADS, B, L_IMG, L_TXT = 32, 2, 2, 8, 4


def _dense(params, x, dg=None, dot_general=math.compute_dtype_dot):
    """The flat (in, out) dense of the blocks before the change: a matrix layers.dense."""
    kernel = params["kernel"]
    layer = layers.dense(kernel.shape[1], (None, None), "d", x.dtype, dg, dot_general=dot_general)
    variables = {"params": {k: params[k] for k in ("kernel", "bias")}}
    if dg is None:
        return layer.apply(variables, x)
    y, state = layer.apply({**variables, FP8_COLLECTION: params[FP8_COLLECTION]}, x, mutable=FP8_COLLECTION)
    record, path = params["record"]
    record[path] = state[FP8_COLLECTION]
    return y


def _split_heads(x, parts):
    """'B L (K H D) -> K x (B L H D)', the flat qkv order."""
    b, length, width = x.shape
    x = x.reshape(b, length, parts, HEADS, width // (parts * HEADS))
    return [x[:, :, i] for i in range(parts)]


def _norm(x):
    return layers.layer_norm("n", x.dtype).apply({}, x)


def _mod(params, vec, n, dg):
    out = _dense(params, nn.silu(vec), dg, math.float32_kernel_dot)  # as layers.Modulation
    return jnp.split(out[:, None, :], n, axis=-1)


def _qk_norm(params, q, k, v, pe):
    return layers.QKNorm().apply({"params": params}, q, k, v, pe)


def flat_double(p, img, txt, vec, pe, dg=None):
    x, mods, qkv = {"img": img, "txt": txt}, {}, {}
    stream_pe = {"txt": pe[:, : txt.shape[1]], "img": pe[:, txt.shape[1] :]}
    for s in ("img", "txt"):
        mods[s] = _mod(p[f"{s}_mod"]["lin"], vec, 6, None)
        shift, scale = mods[s][0], mods[s][1]
        h = _dense(p[f"{s}_attn"]["qkv"], layers.modulate(_norm(x[s]), shift, scale), dg)
        q, k, v = _split_heads(h, 3)
        q, k = _qk_norm(p[f"{s}_attn"]["norm"], q, k, v, stream_pe[s])
        qkv[s] = (q, k, v)
    q, k, v = (jnp.concatenate([qkv["txt"][i], qkv["img"][i]], axis=1) for i in range(3))
    attn = math.attention(q, k, v, None)
    out = {"txt": attn[:, : txt.shape[1]], "img": attn[:, txt.shape[1] :]}
    for s in ("img", "txt"):
        _, _, gate1, shift2, scale2, gate2 = mods[s]
        h = x[s] + gate1 * _dense(p[f"{s}_attn"]["proj"], out[s], dg)
        mlp = layers.gelu(_dense(p[f"{s}_mlp_0"], layers.modulate(_norm(h), shift2, scale2), dg))
        x[s] = h + gate2 * _dense(p[f"{s}_mlp_2"], mlp, dg)
    return x["img"], x["txt"]


def flat_single(p, x, vec, pe, dg=None):
    shift, scale, gate = _mod(p["modulation"]["lin"], vec, 3, None)
    h = _dense(p["linear1"], layers.modulate(_norm(x), shift, scale), dg)
    q, k, v = _split_heads(h[..., : 3 * DIM], 3)
    q, k = _qk_norm(p["norm"], q, k, v, pe)
    attn = math.attention(q, k, v, None)
    mlp = layers.gelu(h[..., 3 * DIM :])
    return x + gate * _dense(p["linear2"], jnp.concatenate([attn, mlp], -1), dg)


def _flat(tree):
    """Head-aligned params (and their gradients) -> the flat layout: each Dense's kernel as the (in, out)
    matrix, its bias flat. A row-major reshape both ways."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: _flat(v) for k, v in tree.items()}
    if "kernel" in tree:
        k, b = tree["kernel"], tree["bias"]
        n_in = k.ndim - b.ndim
        tree = {**tree, "kernel": k.reshape(int(np.prod(k.shape[:n_in])), -1), "bias": b.reshape(-1)}
    return tree


def _random(tree, seed):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return treedef.unflatten([0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])


def _inputs(kind, dtype):
    rng = np.random.default_rng(0)
    img = jnp.asarray(rng.standard_normal((B, L_IMG, DIM)), dtype)
    txt = jnp.asarray(rng.standard_normal((B, L_TXT, DIM)), dtype)
    vec = jnp.asarray(rng.standard_normal((B, DIM)), dtype)
    ids = jnp.asarray(rng.integers(0, 4, (B, L_TXT + L_IMG, 3)), jnp.float32)
    pe = math.embed_nd(ids, (4, 6, 6), 10_000)
    xs = (img, txt) if kind == "double" else (jnp.concatenate([txt, img], axis=1),)
    return xs, vec, pe


def _block(kind, dtype, dg=None):
    cls = layers.DoubleStreamBlock if kind == "double" else layers.SingleStreamBlock
    return cls(DIM, HEADS, 4.0, dtype=dtype, dot_general_cls=dg)


@pytest.mark.parametrize("kind", ["double", "single"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_aligned_blocks_compute_the_flat_layout(kind, dtype):
    xs, vec, pe = _inputs(kind, dtype)
    block = _block(kind, dtype)
    params = _random(nn.unbox(block.init(jax.random.key(0), *xs, vec, pe))["params"], 1)
    assert params["linear1" if kind == "single" else "img_attn"]  # the tree has BFL's names
    shapes = jax.tree.map(jnp.shape, params)
    if kind == "double":
        assert shapes["img_attn"]["qkv"] == {"kernel": (DIM, 3, DIM), "bias": (3, DIM)}
        assert shapes["img_mod"]["lin"] == {"kernel": (DIM, 6, DIM), "bias": (6, DIM)}
    else:
        assert shapes["linear1"] == {"kernel": (DIM, 7, DIM), "bias": (7, DIM)}
        assert shapes["linear2"] == {"kernel": (5, DIM, DIM), "bias": (DIM,)}
    ref = flat_double if kind == "double" else flat_single

    def loss(fn, p, *xs):
        out = fn(p, *xs)
        return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in (out if isinstance(out, tuple) else (out,)))

    new = functools.partial(lambda p, *xs: block.apply({"params": p}, *xs, vec, pe))
    old = functools.partial(lambda p, *xs: ref(p, *xs, vec, pe))
    argnums = tuple(range(1 + len(xs)))
    got, got_grads = jax.jit(jax.value_and_grad(functools.partial(loss, new), argnums))(params, *xs)
    want, want_grads = jax.jit(jax.value_and_grad(functools.partial(loss, old), argnums))(_flat(params), *xs)
    out_new, out_old = jax.jit(new)(params, *xs), jax.jit(old)(_flat(params), *xs)
    for a, b in zip(jax.tree.leaves(out_new), jax.tree.leaves(out_old)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_array_equal(got, want)
    got_grads = (_flat(got_grads[0]), *got_grads[1:])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if dtype == jnp.bfloat16 and "lin" in jax.tree_util.keystr(path):
            # The modulation's kernel gradient leaves its GEMM in bf16 (math.float32_kernel_dot). XLA's
            # CPU folds that rounding into the float32 convert for the flat (K, n * dim) product and not
            # for the (K, n, dim) one: within one bf16 rounding.
            np.testing.assert_allclose(a, b, rtol=2.0**-8, atol=2.0**-8 * np.abs(b).max())
        elif dtype == jnp.bfloat16:
            np.testing.assert_array_equal(a, b)
        else:
            # The backward GEMMs of a (dim, parts, dim) kernel contract over two axes where the flat one
            # contracts over one; XLA's CPU GEMMs then sum in another order: float32 rounding only.
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * np.abs(b).max())


@pytest.mark.parametrize("kind", ["double", "single"])
def test_fp8_dots_of_head_aligned_kernels_compute_the_flat_layout(kind):
    """The FP8 dot quantizes a fused kernel with the same scale and amax as its flat form and runs the
    same products: outputs and the new FP8 state equal the flat layout's, bit for bit."""
    dtype = jnp.bfloat16
    dg = functools.partial(Fp8DotGeneral, spec=Fp8Spec(amax_history_len=4))
    xs, vec, pe = _inputs(kind, dtype)
    block = _block(kind, dtype, dg)
    variables = nn.unbox(block.init(jax.random.key(0), *xs, vec, pe))
    params = _random(variables["params"], 1)
    meta = jax.tree.map(lambda h: h + 1.0 if h.ndim else h * 0.05, variables[FP8_COLLECTION])
    got, state = block.apply({"params": params, FP8_COLLECTION: meta}, *xs, vec, pe, mutable=FP8_COLLECTION)

    record = {}

    def with_meta(p, m, path=()):
        if "kernel" in p:
            return {**p, FP8_COLLECTION: m, "record": (record, "/".join(path))}
        return {k: with_meta(v, m.get(k, {}), (*path, k)) if isinstance(v, dict) else v for k, v in p.items()}

    ref = flat_double if kind == "double" else flat_single
    want = ref(with_meta(_flat(params), meta), *xs, vec, pe, dg)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # Each FP8 dot's new forward state (amax histories and scales of its input and kernel): the same
    # from the fused kernel as from the flat one. The modulation runs BF16 in both (no FP8 state).
    assert set(record) == {"/".join(k) for k in _dense_paths(state[FP8_COLLECTION])}
    assert len(record) == (8 if kind == "double" else 2)
    for path, new in record.items():
        got_state = state[FP8_COLLECTION]
        for key in path.split("/"):
            got_state = got_state[key]
        for name, value in new["Fp8DotGeneral_0"].items():
            if name.startswith(("input", "kernel")):
                np.testing.assert_array_equal(got_state["Fp8DotGeneral_0"][name], value)


def _dense_paths(tree, path=()):
    if "Fp8DotGeneral_0" in tree:
        return [path]
    return [p for k, v in tree.items() for p in _dense_paths(v, (*path, k))]


@pytest.mark.parametrize("recipe", ["delayed", "rowwise"])
def test_16_bit_weight_gradient_of_a_two_axis_kernel_is_the_flat_kernels(recipe):
    """``fp8_wgrad=False``: the weight gradient leaves FP8 for a 16-bit GEMM over M, also for a kernel
    contracted over two axes (linear2's (parts, dim, dim)): the flat (parts * dim, dim) kernel's, reshaped."""
    spec = Fp8Spec(recipe=recipe, amax_history_len=4, wgrad=False)
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(16, 5, DIM)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(5, DIM, DIM)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.normal(size=(16, DIM)), jnp.bfloat16)
    meta = delayed_meta()

    def run(x, w):
        y, vjp = jax.vjp(lambda x, w: fp8_matmul(x, w, meta, None, spec, jnp.bfloat16), x, w)
        return (y, *vjp(g)[:2])

    y, dx, dw = jax.jit(run)(x, w)
    flat = jax.jit(run)(x.reshape(16, 5 * DIM), w.reshape(5 * DIM, DIM))
    assert dw.shape == w.shape
    for a, b in zip((y, dx, dw), (flat[0], flat[1].reshape(dx.shape), flat[2].reshape(w.shape))):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2.0**-7, atol=1e-3
        )
