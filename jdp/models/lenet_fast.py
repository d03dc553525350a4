"""The lesson's LeNet, same math and same params as `jdp.models.lenet`, formulated to run fast.

Takes the params pytree of `jdp.models.lenet` (conv kernels OIHW, dense (in, out)) and NCHW images, and
returns the same logits, loss and gradients up to float rounding. What changes is how XLA is
asked to compute them (each choice is timed against its alternative by `jdp bench formulations`;
the figures are in docs/performance.md):

* Only the pixels the network reads are computed. The 2×2 floor pooling after conv2 drops the
  last row/column of its 9×9 input, so only 8×8 conv2 outputs matter; they read a 12×12 corner of
  the first pooling's output, which reads 24×24 conv1 outputs, which read the top-left 26×26 of
  the image. Cropping there first skips work whose results the reference throws away.
* NHWC activations and HWIO kernels (the layout XLA's CPU convolutions are fastest in). The image
  has one channel, so NCHW → NHWC is a free reshape; the kernels are transposed inside `apply`,
  so gradients come back in the lesson's layout.
* conv1 → bias → ReLU → pool as one elementwise loop (`one_channel_conv_relu_pool`): with one
  input channel a convolution is 9 multiply-adds per output, which XLA fuses with the rest when
  written per pooling phase, where XLA's CPU convolution and its 1-channel weight gradient run as
  separate, slower ops. The backward gets conv1's weight and bias gradients from one matmul. The loop
  runs in float32 under `--precision bf16` too: CPUs do no bfloat16 elementwise arithmetic. The layer's
  output is stored behind an optimisation barrier: otherwise XLA also fuses the loop into the
  transpose that conv2's weight gradient reads, and runs it a second time there.
* `phase-matmul` (and its splits below): conv1's layer as one matmul instead, of the image's pixel
  phases by the kernel placed per pooling phase (`phase_matmul_conv_relu_pool`): its backward is a
  select and a matmul where the fused loop's recomputes the phases in XLA's elementwise loops.
* Pooling as a sum of four strided slices, which XLA fuses with the ReLU, instead of
  `reduce_window`.
* conv2's input gradient, below float32, written out as the forward convolution XLA would run
  (`conv_low_precision_input_gradient`): XLA's CPU compiler runs its own in float32 for bfloat16
  operands; written out, it stays bfloat16. float32 takes XLA's own gradients.
* Flattening for the dense layer: NHWC flattens in (h, w, c) order, the reference in (c, h, w);
  W3's rows are permuted to match instead of transposing the activations.

`in_chunks(apply, n)` runs a batch as n independent chunks in one step: the same math, summed in
another order, and independent work XLA's CPU runtime may run on several cores at once. Where it
pays depends on the machine (`--formulation auto`, `jdp.training.formulation`).
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdp.models import lenet
from jdp.models.lenet import Params, add_bias

DIMS = ("NHWC", "HWIO", "NHWC")  # the convolutions' layouts: activations NHWC, kernels HWIO


def valid_conv(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
    """A VALID NHWC/HWIO convolution, differentiated by XLA's own transposes (the building block the others wrap)."""
    return jax.lax.conv_general_dilated(x, w_hwio, (1, 1), "VALID", dimension_numbers=DIMS)


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
        return valid_conv(x, w_hwio)

    def conv_fwd(x, w_hwio):
        return valid_conv(x, w_hwio), (x, w_hwio)

    def conv_bwd(residuals, dy):
        x, w_hwio = residuals
        kh, kw, c, out = w_hwio.shape
        if weight:
            dw = jnp.einsum("nhwk,nhwo->ko", patches(x, kh, kw), dy).reshape(w_hwio.shape)
        else:
            (dw,) = jax.vjp(lambda w: valid_conv(x, w), w_hwio)[1](dy)
        if inputs:
            patches_vjp = jax.vjp(lambda x: patches(x, kh, kw), x)[1]
            (dx,) = patches_vjp(jnp.einsum("nhwo,ko->nhwk", dy, w_hwio.reshape(kh * kw * c, out)))
        else:
            (dx,) = jax.vjp(lambda x: valid_conv(x, w_hwio), x)[1](dy)
        return dx, dw

    conv.defvjp(conv_fwd, conv_bwd)
    return conv


def _input_gradient_as_forward_conv(dy: jax.Array, w_hwio: jax.Array) -> jax.Array:
    """The input gradient of a VALID convolution: a forward convolution of dy padded by kh−1, kw−1, kernel flipped."""
    kh, kw = w_hwio.shape[:2]
    padded = jnp.pad(dy, ((0, 0), (kh - 1, kh - 1), (kw - 1, kw - 1), (0, 0)))
    return valid_conv(padded, jnp.flip(w_hwio, (0, 1)).transpose(0, 1, 3, 2))


def _conv_fwd(x, w_hwio):
    return valid_conv(x, w_hwio), (x, w_hwio)


@jax.custom_vjp
def conv_low_precision_input_gradient(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
    """A VALID NHWC/HWIO convolution whose input gradient, below float32, stays in the input dtype.

    XLA's CPU compiler runs a convolution's input gradient as a forward convolution over the padded
    output gradient, and for bfloat16 operands converts both up and runs it in float32: the costliest
    op of a bf16 LeNet step. Written out here as that forward convolution, it runs in bfloat16, at the
    CPU's bfloat16 convolution speed. In float32 both gradients are XLA's own (the same program as
    without this wrapper); the weight gradient is XLA's in every dtype.
    """
    return valid_conv(x, w_hwio)


def _input_gradient_bwd(residuals, dy):
    x, w_hwio = residuals
    if dy.dtype == jnp.float32:
        return jax.vjp(valid_conv, x, w_hwio)[1](dy)
    (dw,) = jax.vjp(lambda w: valid_conv(x, w), w_hwio)[1](dy)
    return _input_gradient_as_forward_conv(dy, w_hwio), dw


conv_low_precision_input_gradient.defvjp(_conv_fwd, _input_gradient_bwd)


@jax.custom_vjp
def conv_low_precision_forward_gradients(x: jax.Array, w_hwio: jax.Array) -> jax.Array:
    """`conv_low_precision_input_gradient` with the weight gradient, below float32, a forward convolution too.

    The weight gradient as a convolution of x as (C, H, W, N) by dy as (H, W, N, O), accumulated in
    float32. Not jdp's default: it measured slower than XLA's weight gradient (`jdp bench
    formulations`'s bf16-conv2-forward-grads; the runs are in experiments/results/formulations/).
    """
    return valid_conv(x, w_hwio)


def _forward_gradients_bwd(residuals, dy):
    x, w_hwio = residuals
    if dy.dtype == jnp.float32:
        return jax.vjp(valid_conv, x, w_hwio)[1](dy)
    # dw[i, j, c, o] = Σ_n,h,w x[n, h+i, w+j, c] dy[n, h, w, o]: a convolution of x as (C, H, W, N) by dy as (H, W, N, O)
    dw = jax.lax.conv_general_dilated(x.transpose(3, 1, 2, 0), dy.transpose(1, 2, 0, 3), (1, 1), "VALID",
                                      dimension_numbers=DIMS, preferred_element_type=jnp.float32)
    return _input_gradient_as_forward_conv(dy, w_hwio), dw.transpose(1, 2, 0, 3).astype(w_hwio.dtype)


conv_low_precision_forward_gradients.defvjp(_conv_fwd, _forward_gradients_bwd)


def avg_pool(x: jax.Array) -> jax.Array:
    """2×2 average pooling, stride 2, of an NHWC array with even height and width.

    A sum of four strided slices, which XLA fuses with the ReLU before it into one elementwise loop,
    where reshape + mean would become a separate reduction (`jdp bench formulations`'s pool-reshape-mean).
    """
    return 0.25 * (x[:, 0::2, 0::2] + x[:, 0::2, 1::2] + x[:, 1::2, 0::2] + x[:, 1::2, 1::2])


Conv = Callable[[jax.Array, jax.Array], jax.Array]
Layer = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def conv_relu_pool(conv: Conv = valid_conv, bias: Callable[..., jax.Array] = add_bias,
                   pool: Callable[[jax.Array], jax.Array] = avg_pool) -> Layer:
    """A conv → bias → ReLU → 2×2 average pool layer, `layer(x, w_hwio, b)`, from its pieces."""
    return lambda x, w_hwio, b: pool(jax.nn.relu(bias(conv(x, w_hwio), b)))


_PHASES = ((0, 0), (0, 1), (1, 0), (1, 1))  # (row, column) offsets of the 2×2 pooling window


def _pooling_phases(x: jax.Array, kh: int, kw: int) -> list[list[jax.Array]]:
    """phases[r][s] = x[:, r::2, s::2] cut to the pooled size: the pixels each pooling phase's conv reads."""
    oh, ow = (x.shape[1] - kh + 1) // 2, (x.shape[2] - kw + 1) // 2
    return [[x[:, r::2, s::2][:, :oh, :ow] for s in range(kw + 1)] for r in range(kh + 1)]


def _phase_conv(phases: list[list[jax.Array]], w_hwio: jax.Array, b: jax.Array, a: int, c: int) -> jax.Array:
    """Pre-activation of the conv outputs at pooling phase (a, c): rows 2i+a, columns 2j+c."""
    kh, kw = w_hwio.shape[:2]
    return b + sum(phases[a + i][c + j] * w_hwio[i, j, 0] for i in range(kh) for j in range(kw))


def _check_one_channel(x: jax.Array, w_hwio: jax.Array) -> None:
    if x.shape[-1] != 1 or w_hwio.shape[2] != 1:
        raise ValueError(f"conv1's layer needs 1 input channel; got input {x.shape}, kernel {w_hwio.shape}")


def _one_channel_conv_relu_pool(x: jax.Array, w_hwio: jax.Array, b: jax.Array) -> jax.Array:
    _check_one_channel(x, w_hwio)
    phases = _pooling_phases(x, *w_hwio.shape[:2])
    return 0.25 * sum(jax.nn.relu(_phase_conv(phases, w_hwio, b, a, c)) for a, c in _PHASES)


@jax.custom_vjp
def _one_channel_layer(x: jax.Array, w_hwio: jax.Array, b: jax.Array) -> jax.Array:
    return _one_channel_conv_relu_pool(x, w_hwio, b)


def _one_channel_fwd(x, w_hwio, b):
    return _one_channel_conv_relu_pool(x, w_hwio, b), (x, w_hwio, b)


def _one_channel_bwd(residuals, dy):
    x, w_hwio, b = residuals
    kh, kw, _, out = w_hwio.shape
    phases = _pooling_phases(x, kh, kw)
    masked = jnp.stack([jnp.where(_phase_conv(phases, w_hwio, b, a, c) > 0, 0.25 * dy, 0) for a, c in _PHASES])
    rows = [jnp.stack([phases[a + i][c + j] for a, c in _PHASES]).reshape(-1) for i in range(kh) for j in range(kw)]
    patches_t = jnp.stack([*rows, jnp.ones_like(rows[0])])
    dwb = jnp.matmul(patches_t, masked.reshape(-1, out), preferred_element_type=jnp.float32)
    (dx,) = jax.vjp(lambda x: _one_channel_conv_relu_pool(x, w_hwio, b), x)[1](dy)  # dead code unless wanted
    return dx, dwb[:-1].reshape(w_hwio.shape).astype(w_hwio.dtype), dwb[-1].astype(b.dtype)


_one_channel_layer.defvjp(_one_channel_fwd, _one_channel_bwd)


def one_channel_conv_relu_pool(x: jax.Array, w_hwio: jax.Array, b: jax.Array,
                               compute_dtype: jnp.dtype | None = jnp.float32) -> jax.Array:
    """conv → bias → ReLU → 2×2 average pool for a 1-channel NHWC input, as one elementwise loop.

    With one input channel a convolution is kh·kw multiply-adds per output: written out per
    pooling phase, XLA fuses conv, bias, ReLU and pool into one loop that never stores the
    unpooled activations. The backward recomputes the four phases' ReLU masks and gets the weight
    and bias gradients from one matmul: [patches | 1]ᵀ (kh·kw+1 × N·H·W) by the masked output
    gradient (N·H·W × O).

    The loop runs in `compute_dtype` (None: the inputs' dtype) and returns the inputs' dtype. float32
    by default: the layer is elementwise work, which CPUs do not do in bfloat16 (XLA converts each
    operand to float32 and back, which made this layer the costliest part of a bfloat16 step); the
    inputs' bfloat16 values are exact in float32, so only the output's rounding is bfloat16's.
    """
    return _computed_in(compute_dtype, _one_channel_layer, x, w_hwio, b)


def _computed_in(dtype: jnp.dtype | None, layer: Layer, x: jax.Array, w_hwio: jax.Array, b: jax.Array) -> jax.Array:
    """`layer` on its inputs cast to `dtype` (None: the inputs' dtype), its output in the inputs' dtype."""
    dtype = dtype or x.dtype
    return layer(x.astype(dtype), w_hwio.astype(dtype), b.astype(dtype)).astype(x.dtype)


def _phase_pixels(x: jax.Array, kh: int, kw: int) -> jax.Array:
    """(N, H', W', (kh+1)·(kw+1) + 1): the image's pixel phases x[2i+r, 2j+s] that the four pooling
    phases' convolutions read, and a ones column for the bias."""
    columns = [phase[..., 0] for row in _pooling_phases(x, kh, kw) for phase in row]
    return jnp.stack([*columns, jnp.ones_like(columns[0])], axis=-1)


@functools.cache
def _placement(kh: int, kw: int) -> np.ndarray:
    """S[r, q, k] = 1 where pooling phase q's convolution multiplies pixel phase r by tap k (k = kh·kw: the bias,
    by the ones column)."""
    s = np.zeros(((kh + 1) * (kw + 1) + 1, len(_PHASES), kh * kw + 1), np.float32)
    for q, (a, c) in enumerate(_PHASES):
        for i in range(kh):
            for j in range(kw):
                s[(a + i) * (kw + 1) + c + j, q, i * kw + j] = 1
        s[-1, q, -1] = 1
    return s


def _phase_matmul_forward(x: jax.Array, w_hwio: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(the pooled layer, the pixel phases, the four phases' pre-activations (N, H', W', 4, O))."""
    _check_one_channel(x, w_hwio)
    kh, kw, _, out = w_hwio.shape
    pixels = _phase_pixels(x, kh, kw)
    taps = jnp.concatenate([w_hwio.reshape(kh * kw, out), b[None]])
    placed = jnp.einsum("rqk,ko->rqo", _placement(kh, kw), taps).reshape(-1, len(_PHASES) * out)
    z = jnp.matmul(pixels, placed).reshape(*pixels.shape[:3], len(_PHASES), out)
    return 0.25 * jnp.sum(jax.nn.relu(z), axis=3), pixels, z


@jax.custom_vjp
def _phase_matmul_layer(x: jax.Array, w_hwio: jax.Array, b: jax.Array) -> jax.Array:
    return _phase_matmul_forward(x, w_hwio, b)[0]


def _phase_matmul_fwd(x, w_hwio, b):
    y, pixels, z = _phase_matmul_forward(x, w_hwio, b)
    return y, (x, pixels, z, w_hwio, b)


def _phase_matmul_bwd(residuals, dy):
    x, pixels, z, w_hwio, b = residuals
    kh, kw, _, out = w_hwio.shape
    dz = jnp.where(z > 0, 0.25 * dy[:, :, :, None, :], 0).reshape(-1, len(_PHASES) * out)
    # Stored transposed: otherwise XLA transposes the 4·O-wide dz for the matmul instead of the narrow pixels.
    pixels_t = lax.optimization_barrier(pixels.reshape(-1, pixels.shape[-1]).T)
    placed = jnp.matmul(pixels_t, dz, preferred_element_type=jnp.float32).reshape(-1, len(_PHASES), out)
    taps = jnp.einsum("rqk,rqo->ko", _placement(kh, kw), placed)
    (dx,) = jax.vjp(lambda x: _phase_matmul_forward(x, w_hwio, b)[0], x)[1](dy)  # dead code unless wanted
    return dx, taps[:-1].reshape(w_hwio.shape).astype(w_hwio.dtype), taps[-1].astype(b.dtype)


_phase_matmul_layer.defvjp(_phase_matmul_fwd, _phase_matmul_bwd)


def phase_matmul_conv_relu_pool(x: jax.Array, w_hwio: jax.Array, b: jax.Array,
                                compute_dtype: jnp.dtype | None = jnp.float32) -> jax.Array:
    """`one_channel_conv_relu_pool` with the convolution as one matmul: the `phase-matmul` formulations.

    The four pooling phases of a kh×kw convolution read (kh+1)·(kw+1) pixel phases of the image. Their
    pre-activations, for every output channel, are one matmul: the pixel phases and a ones column
    (N·H'·W' × 17 for 3×3) by the kernel and bias placed per phase (17 × 4·O). The forward is that
    matmul and a ReLU-and-sum over the phases; the backward a select of the stored pre-activations
    and one matmul for the weight and bias gradients: contiguous work, where the fused loop's
    backward recomputes the phases in XLA's slower elementwise loops. Where it is faster depends on
    the machine (docs/performance.md); float32 by default, as the fused loop.
    """
    return _computed_in(compute_dtype, _phase_matmul_layer, x, w_hwio, b)


def make_apply(layer1: Layer = one_channel_conv_relu_pool, conv2: Conv = conv_low_precision_input_gradient,
               bias: Callable[..., jax.Array] = add_bias, pool: Callable[[jax.Array], jax.Array] = avg_pool,
               matmul: Conv = jnp.matmul, barrier: bool = True) -> Callable[[Params, jax.Array], jax.Array]:
    """`apply` built from its pieces: the first conv layer, conv2, the bias add, pooling and the dense matmul.

    The defaults are jdp's fast formulation; `jdp bench formulations` swaps pieces to time alternatives.
    With `barrier`, the first layer's output is stored (`lax.optimization_barrier`) rather than fused
    into each of its consumers: the transpose that conv2's weight gradient reads would run the
    fused conv1 loop a second time.
    """
    stored = lax.optimization_barrier if barrier else (lambda h: h)

    def apply(params: Params, images: jax.Array) -> jax.Array:
        """Logits for NCHW images of shape (N, 1, 28, 28); equal to `jdp.models.lenet.apply`."""
        x = images.reshape(images.shape[0], 28, 28, 1)[:, :26, :26, :]  # C = 1: NCHW → NHWC is a reshape
        w1 = params["W1"].transpose(2, 3, 1, 0)  # OIHW → HWIO
        h = stored(layer1(x, w1, params["b1"]))  # (N, 12, 12, 20)
        w2 = params["W2"].transpose(2, 3, 1, 0)
        h = pool(jax.nn.relu(bias(conv2(h, w2), params["b2"])))  # (N, 4, 4, 50)
        w3 = params["W3"].reshape(50, 4, 4, -1).transpose(1, 2, 0, 3).reshape(800, -1)  # rows (c,h,w) → (h,w,c)
        h = jax.nn.relu(bias(matmul(h.reshape(h.shape[0], 800), w3), params["b3"]))
        return bias(matmul(h, params["W4"]), params["b4"])

    return apply


apply = make_apply()
apply_phase_matmul = make_apply(layer1=phase_matmul_conv_relu_pool)


def in_chunks(apply: Callable[[Params, jax.Array], jax.Array], chunks: int) -> Callable[[Params, jax.Array], jax.Array]:
    """`apply` run on the batch cut into `chunks` parts (near-equal; fewer if the batch is smaller), logits joined.

    Each part's forward and backward pass depends on no other part's, so XLA's CPU runtime may run
    them concurrently; the gradient is the sum of the parts' gradients (float32 sums in another order).
    """

    def chunked(params: Params, images: jax.Array) -> jax.Array:
        parts = jnp.array_split(images, min(chunks, images.shape[0]) or 1)
        return jnp.concatenate([apply(params, part) for part in parts])

    return chunked


# The formulations jdp trains (`--formulation`, TrainConfig's `formulation`) -> apply function; all take
# the same params and images and compute the same logits up to float32 rounding.
FORMULATIONS = {"reference": lenet.apply, "fast": apply, "split-2": in_chunks(apply, 2),
                "split-4": in_chunks(apply, 4), "phase-matmul": apply_phase_matmul,
                "phase-matmul-split-2": in_chunks(apply_phase_matmul, 2),
                "phase-matmul-split-4": in_chunks(apply_phase_matmul, 4)}
