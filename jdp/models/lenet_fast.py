"""The lesson's LeNet, same math and same params as `jdp.models.lenet`, formulated to run fast.

Takes the params pytree of `jdp.models.lenet` (conv kernels OIHW, dense (in, out)) and NCHW images, and
returns the same logits, loss and gradients up to float rounding. What changes is how XLA is
asked to compute them (measured on a 2-core Zen 4 CPU, see the README, "Speed"):

* Only the pixels the network reads are computed. The 2×2 floor pooling after conv2 drops the
  last row/column of its 9×9 input, so only 8×8 conv2 outputs matter; they read a 12×12 corner of
  the first pooling's output, which reads 24×24 conv1 outputs, which read the top-left 26×26 of
  the image. Cropping there first skips work whose results the reference throws away.
* NHWC activations and HWIO kernels (the layout XLA's CPU convolutions are fastest in). The image
  has one channel, so NCHW → NHWC is a free reshape; the kernels are transposed inside `apply`,
  so gradients come back in the lesson's layout.
* Pooling as reshape + mean, which XLA fuses with the ReLU, instead of `reduce_window`.
* conv1's weight gradient as one im2col matmul (9 × N·576 by N·576 × 20) via a custom VJP: XLA's
  CPU convolution for a 1-input-channel weight gradient is several times slower than the matmul.
* Flattening for the dense layer: NHWC flattens in (h, w, c) order, the reference in (c, h, w);
  W3's rows are permuted to match instead of transposing the activations.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jdp.models import lenet
from jdp.models.lenet import Params, add_bias

_DIMS = ("NHWC", "HWIO", "NHWC")


def _conv(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
    return jax.lax.conv_general_dilated(x, w_hwio, (1, 1), "VALID", dimension_numbers=_DIMS)


def patches(x: jax.Array, kh: int, kw: int) -> jax.Array:
    """(N, H, W, C) → (N, H−kh+1, W−kw+1, kh·kw·C): every kh×kw window, in HWIO's (h, w, c) order (im2col)."""
    oh, ow = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    return jnp.concatenate([x[:, i:i + oh, j:j + ow, :] for i in range(kh) for j in range(kw)], axis=-1)


def conv_with_matmul_gradients(weight: bool, inputs: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """A VALID NHWC/HWIO convolution whose weight and/or input gradient is an im2col matmul (custom VJP).

    The input gradient by matmul scatters (kh·kw·C)-wide patch gradients back with col2im; by
    convolution, XLA pads the output gradient by kh−1, kw−1 pixels. Unneeded gradients are dead code.
    """

    @jax.custom_vjp
    def conv(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
        return _conv(x, w_hwio)

    def conv_fwd(x, w_hwio):
        return _conv(x, w_hwio), (x, w_hwio)

    def conv_bwd(residuals, dy):
        x, w_hwio = residuals
        kh, kw, c, out = w_hwio.shape
        if weight:
            dw = jnp.einsum("nhwk,nhwo->ko", patches(x, kh, kw), dy).reshape(w_hwio.shape)
        else:
            (dw,) = jax.vjp(lambda w: _conv(x, w), w_hwio)[1](dy)
        if inputs:
            patches_vjp = jax.vjp(lambda x: patches(x, kh, kw), x)[1]
            (dx,) = patches_vjp(jnp.einsum("nhwo,ko->nhwk", dy, w_hwio.reshape(kh * kw * c, out)))
        else:
            (dx,) = jax.vjp(lambda x: _conv(x, w_hwio), x)[1](dy)
        return dx, dw

    conv.defvjp(conv_fwd, conv_bwd)
    return conv


# conv1: XLA's CPU convolution for a 1-input-channel weight gradient is several times slower than the matmul.
conv_one_channel = conv_with_matmul_gradients(weight=True, inputs=False)


def _avg_pool(x: jax.Array) -> jax.Array:
    """2×2 average pooling, stride 2, of an NHWC array with even height and width."""
    n, h, w, c = x.shape
    return x.reshape(n, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


Conv = Callable[[jax.Array, jax.Array], jax.Array]


def make_apply(conv1: Conv = conv_one_channel, conv2: Conv = _conv, bias: Callable[..., jax.Array] = add_bias,
               matmul: Conv = jnp.matmul) -> Callable[[Params, jax.Array], jax.Array]:
    """`apply` built from its pieces: NHWC/HWIO convolutions, the bias add and the dense matmul.

    The defaults are jdp's fast formulation; `jdp bench formulations` swaps pieces to time alternatives.
    """

    def apply(params: Params, images: jax.Array) -> jax.Array:
        """Logits for NCHW images of shape (N, 1, 28, 28); equal to `jdp.models.lenet.apply`."""
        x = images.reshape(images.shape[0], 28, 28, 1)[:, :26, :26, :]  # C = 1: NCHW → NHWC is a reshape
        w1 = params["W1"].transpose(2, 3, 1, 0)  # OIHW → HWIO
        h = _avg_pool(jax.nn.relu(bias(conv1(x, w1), params["b1"])))  # (N, 12, 12, 20)
        w2 = params["W2"].transpose(2, 3, 1, 0)
        h = _avg_pool(jax.nn.relu(bias(conv2(h, w2), params["b2"])))  # (N, 4, 4, 50)
        w3 = params["W3"].reshape(50, 4, 4, -1).transpose(1, 2, 0, 3).reshape(800, -1)  # rows (c,h,w) → (h,w,c)
        h = jax.nn.relu(bias(matmul(h.reshape(h.shape[0], 800), w3), params["b3"]))
        return bias(matmul(h, params["W4"]), params["b4"])

    return apply


apply = make_apply()


# `--model-impl` name -> apply function; both take the same params and images.
IMPLEMENTATIONS = {"reference": lenet.apply, "fast": apply}
