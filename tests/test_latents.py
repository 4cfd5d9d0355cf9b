import jax.numpy as jnp
import numpy as np
import pytest

from flux_jax import latents


def test_pack_matches_bfl_rearrange_and_ids():
    z = np.arange(2 * 4 * 6, dtype=np.float32).reshape(2, 4, 6)
    packed = latents.pack(z)
    assert packed.shape == (6, 8)
    for h in range(2):
        for w in range(3):
            expected = [z[c, 2 * h + ph, 2 * w + pw] for c in range(2) for ph in range(2) for pw in range(2)]
            np.testing.assert_array_equal(packed[h * 3 + w], expected)
    ids = latents.image_ids(4, 6)
    np.testing.assert_array_equal(ids[4], [0.0, 1.0, 1.0])
    assert ids.shape == (6, 3) and np.all(ids[:, 0] == 0)


def test_batched_pack_unpack_roundtrip_and_layout():
    x = np.random.default_rng(0).standard_normal((2, 16, 8, 6)).astype(np.float32)
    packed = latents.pack(x)
    assert packed.shape == (2, 12, 64)
    # Token (row 1, col 2), feature (channel 3, ph 1, pw 0) is latent pixel (3, 3, 4).
    np.testing.assert_array_equal(packed[0, 1 * 3 + 2, 3 * 4 + 1 * 2 + 0], x[0, 3, 3, 4])
    np.testing.assert_array_equal(latents.unpack(packed, 8, 6), x)
    np.testing.assert_array_equal(packed[1], latents.pack(x[1]))  # batched = per example


def test_unpack_takes_jax_arrays_and_names_a_wrong_size():
    lat = np.random.default_rng(3).standard_normal((2, 16, 6, 10)).astype(np.float32)
    packed = jnp.asarray(latents.pack(lat))
    assert packed.shape == (2, 15, 64)
    np.testing.assert_array_equal(np.asarray(latents.unpack(packed, 6, 10)), lat)
    with pytest.raises(ValueError, match="cannot unpack .* 6x6"):
        latents.unpack(packed, 6, 6)
