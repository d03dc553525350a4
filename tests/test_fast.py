"""The fast LeNet equals the lesson's reference: logits, loss and gradients, to float tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdp.models import lenet, lenet_fast, summed_cross_entropy


@pytest.fixture(scope="module")
def problem():
    images = jax.random.uniform(jax.random.key(1), (16, 1, 28, 28))
    labels = jax.random.randint(jax.random.key(2), (16,), 0, 10)
    params = jax.tree.map(lambda w: w * 30, lenet.init(jax.random.key(0)))  # big weights: logits far from 0
    params = {k: v + 0.1 * (k.startswith("b")) for k, v in params.items()}  # nonzero biases
    return params, images, labels


def assert_close(got, want, rtol=2e-5):
    """Max error relative to the largest reference value (float32 sums in another order)."""
    for name in want:
        scale = float(jnp.abs(want[name]).max())
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=rtol * scale, err_msg=name)


def test_logits_equal_the_reference(problem):
    params, images, _ = problem
    want = lenet.apply(params, images)
    assert float(jnp.abs(want).std()) > 1.0  # the check is not vacuous
    assert_close({"logits": lenet_fast.apply(params, images)}, {"logits": want})


def test_loss_and_gradients_equal_the_reference(problem):
    params, images, labels = problem
    want_loss, want = jax.value_and_grad(summed_cross_entropy(lenet.apply))(params, images, labels)
    got_loss, got = jax.jit(jax.value_and_grad(summed_cross_entropy(lenet_fast.apply)))(params, images, labels)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    assert jax.tree.map(jnp.shape, got) == jax.tree.map(jnp.shape, want)  # gradients in the lesson's layout
    assert_close(got, want)


def test_input_gradient_of_the_custom_vjp_is_the_convolutions():
    x = jax.random.normal(jax.random.key(3), (2, 7, 6, 1))
    w = jax.random.normal(jax.random.key(4), (3, 3, 1, 5))
    plain = lambda x, w: jnp.sum(jnp.sin(lenet_fast._conv(x, w)))
    custom = lambda x, w: jnp.sum(jnp.sin(lenet_fast.conv_one_channel(x, w)))
    for got, want in zip(jax.grad(custom, (0, 1))(x, w), jax.grad(plain, (0, 1))(x, w)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("row", "col", "read"), [(25, 25, True), (26, 0, False), (0, 26, False), (27, 27, False)])
def test_crop_keeps_exactly_the_pixels_the_reference_reads(problem, row, col, read):
    """The floor poolings never read image rows/columns 26 and 27; row/column 25 they do."""
    params, images, _ = problem
    bumped = images.at[:, 0, row, col].add(5.0)
    for apply in (lenet.apply, lenet_fast.apply):
        changed = bool(jnp.any(jnp.abs(apply(params, bumped) - apply(params, images)) > 1e-3))
        assert changed == read, (apply.__module__, row, col)


def test_implementations_are_named_for_the_cli():
    assert lenet_fast.IMPLEMENTATIONS == {"reference": lenet.apply, "fast": lenet_fast.apply}
