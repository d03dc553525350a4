"""The lesson's LeNet variant as pure functions over a flat params dict.

Layout follows the lesson (PyTorch): images NCHW, conv kernels OIHW, dense weights (in, out).
This is the reference formulation that faster ones are tested against.
"""

from functools import partial

import jax
import jax.numpy as jnp

Params = dict[str, jax.Array]

# name -> shape, in the lesson's order: conv(20,1,3,3), conv(50,20,5,5), dense(800,128), dense(128,10).
SHAPES: dict[str, tuple[int, ...]] = {
    "W1": (20, 1, 3, 3), "b1": (20,),
    "W2": (50, 20, 5, 5), "b2": (50,),
    "W3": (800, 128), "b3": (128,),
    "W4": (128, 10), "b4": (10,),
}


def init(key: jax.Array, scale: float = 0.01) -> Params:
    """Weights ~ N(0, scale²), biases 0, as the lesson's `get_params` draws them."""
    keys = jax.random.split(key, len(SHAPES))
    return {
        name: (scale * jax.random.normal(k, shape) if name.startswith("W") else jnp.zeros(shape))
        for k, (name, shape) in zip(keys, SHAPES.items())
    }


def add_bias(y: jax.Array, b: jax.Array, axis: int = -1) -> jax.Array:
    """`y + b` with `b` along `axis`. In float32 exactly that; in a lower precision (`--precision bf16`)
    b's gradient is summed in float32: XLA's CPU reduction would add its ~10⁵ terms in bfloat16."""
    axis %= y.ndim
    return _add(y, b, axis) if b.dtype == jnp.float32 else _add_bias_low(y, b, axis)


def _other_axes(ndim: int, axis: int) -> list[int]:
    return [d for d in range(ndim) if d != axis]


def _add(y: jax.Array, b: jax.Array, axis: int) -> jax.Array:
    return y + jnp.expand_dims(b, _other_axes(y.ndim, axis))


_add_bias_low = partial(jax.custom_vjp, nondiff_argnums=(2,))(_add)


def _add_bias_low_fwd(y, b, axis):
    return _add(y, b, axis), None


def _add_bias_low_bwd(axis, _, dy):
    summed = jnp.sum(dy, axis=_other_axes(dy.ndim, axis), dtype=jnp.float32)
    return dy, summed.astype(dy.dtype)


_add_bias_low.defvjp(_add_bias_low_fwd, _add_bias_low_bwd)


def _conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, w, (1, 1), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return add_bias(y, b, axis=1)


def _avg_pool(x: jax.Array) -> jax.Array:
    """2×2 average pooling, stride 2, floor on odd sizes (PyTorch's `avg_pool2d` default)."""
    summed = jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    return summed / 4.0


def apply(params: Params, images: jax.Array) -> jax.Array:
    """Logits for a batch of images of shape (N, 1, 28, 28)."""
    h = _avg_pool(jax.nn.relu(_conv(images, params["W1"], params["b1"])))
    h = _avg_pool(jax.nn.relu(_conv(h, params["W2"], params["b2"])))
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(add_bias(h @ params["W3"], params["b3"]))
    return add_bias(h @ params["W4"], params["b4"])

