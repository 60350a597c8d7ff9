"""The one source of benchmark shapes: masked and causal convolution layers of real models.

Shared by the benchmarks (``python -m maskconv_kernels.bench``) and the tests, which check
every shape against float64 at batch 1, so that every shape timed is also checked.

Sources:
* PixelCNN (van den Oord et al., 2016, "Pixel Recurrent Neural Networks"): a 7x7
  type-A first layer (MNIST: 1 input channel; CIFAR-10: 3), then 3x3 type-B residual
  layers with 2h = 256 channels at 32x32 (h = 128 for CIFAR); 28x28 for MNIST and
  64x64 for down-sampled ImageNet.
* PixelCNN++ (Salimans et al., 2017): 160 filters at 32x32; we time its 5x5 type-B
  masked equivalent.
* Gated PixelCNN (van den Oord et al., 2016, "Conditional Image Generation with
  PixelCNN Decoders"): an n x n vertical stack (rows above the centre) and a 1 x n
  horizontal stack, each producing 2p channels for the tanh/sigmoid gate.
* WaveNet (van den Oord et al., 2016): 1-D causal convolutions, kernel 2, dilations
  1, 2, ..., 512 (we time 1, 32 and 512), residual channels 64-256 doubled for the
  gate, 16k samples (about 1 s of 16 kHz audio); plus the masked form used by many
  reimplementations: a 3-tap kernel with its future tap masked and ``SAME`` padding.

``batch`` is chosen to fill an H200 (at least ~10 GFLOP per forward pass, so that one
call runs well past launch overhead); ``small_batch`` is for CPUs and CI. The two
``headline`` shapes (32x32, 256 channels, N=64 in bfloat16 on a GPU: a PixelCNN's 7x7
type-A and 3x3 type-B layers at full width) are where a PixelCNN's training time goes;
the benchmarks measure them first and summarise them last.

Causal convolutions along time (``python -m maskconv_kernels.bench causal_conv``,
:data:`CAUSAL_SHAPES`):
* Video VAE encoders (Wan 2.1, CogVideoX, Cosmos): 3x3x3 causal convolutions at batch 1
  on 9 to 17 frames (Wan's 1 + 4k frames) of 32x32 to 64x64 latents with 128 to 256
  channels, time stride 1, and 2 where a layer downsamples time; before frame 0 zeros
  (Wan) or copies of frame 0 (``"replicate"``: Cosmos, CogVideoX). Streamed in chunks
  of 4 frames, as Wan's encoder takes the frames after the first.
* Neural audio codec encoders (EnCodec, Mimi: SEANet): 1 s at 24 kHz (L = 24,000),
  64 to 512 channels; residual units (kernel 3, C -> C / 2), the first and last layers
  (kernel 7), and the downsampling layers (kernel 2 s, stride s for s = 2, 4, 5, 8).
  Streamed in chunks of 1,920 samples (Mimi's 80 ms frame), a multiple of every stride.
  Every layer is timed on 24,000 input frames (in a codec, later layers see fewer).
``small_batch`` and ``cpu`` choose the CPU preset's layers and batch (the cheaper ones:
it must finish in minutes on two cores); ``batch`` is the GPU preset's.
"""
from __future__ import annotations

import dataclasses

import numpy as np

import maskconv_kernels as mk

__all__ = ["BenchShape", "SHAPES", "HEADLINE_SHAPES", "ROOFLINE_SHAPES", "by_name", "CausalShape", "CAUSAL_SHAPES",
           "causal_by_name"]


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """One masked convolution layer: ``x: (N, *spatial, c_in)``, ``kernel: (*window, c_in, c_out)``."""

    name: str
    family: str  # "pixelcnn", "gated", "wavenet"
    spatial: tuple[int, ...]
    c_in: int
    c_out: int
    mask: np.ndarray  # window-shaped bools
    batch: int  # fills the device
    small_batch: int  # CPU runs and CI
    conv_args: dict = dataclasses.field(default_factory=dict)
    # One of the two headline shapes (see the module's docstring).
    headline: bool = False

    @property
    def window(self) -> tuple[int, ...]:
        return tuple(self.mask.shape)

    def x_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, *self.spatial, self.c_in)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        return (*self.window, self.c_in, self.c_out)

    @property
    def active_taps(self) -> int:
        return int(np.asarray(self.mask, bool).sum())


P = mk.pixelcnn_mask


def _pixelcnn(name, hw, c_in, c_out, window, mask_type, batch, small_batch=2, headline=False, family="pixelcnn"):
    return BenchShape(name, family, (hw, hw), c_in, c_out, P(window, mask_type), batch, small_batch,
                      headline=headline)


SHAPES: tuple[BenchShape, ...] = (
    # PixelCNN first layers (type A: the centre pixel is excluded).
    _pixelcnn("pixelcnn_7x7A_C1-64_28x28", 28, 1, 64, (7, 7), "A", batch=256, small_batch=4),
    _pixelcnn("pixelcnn_7x7A_C3-256_32x32", 32, 3, 256, (7, 7), "A", batch=64),
    _pixelcnn("pixelcnn_7x7A_C256_32x32", 32, 256, 256, (7, 7), "A", batch=64, small_batch=1, headline=True),
    # PixelCNN / PixelCNN++ type-B layers.
    _pixelcnn("pixelcnn_3x3B_C64_28x28", 28, 64, 64, (3, 3), "B", batch=256, small_batch=4),
    _pixelcnn("pixelcnn_3x3B_C128_32x32", 32, 128, 128, (3, 3), "B", batch=128),
    _pixelcnn("pixelcnn_3x3B_C256_32x32", 32, 256, 256, (3, 3), "B", batch=64, headline=True),
    _pixelcnn("pixelcnn_3x3B_C128_64x64", 64, 128, 128, (3, 3), "B", batch=32, small_batch=1),
    _pixelcnn("pixelcnn++_5x5B_C160_32x32", 32, 160, 160, (5, 5), "B", batch=64, small_batch=1),
    _pixelcnn("pixelcnn_5x5B_C64_28x28", 28, 64, 64, (5, 5), "B", batch=256, small_batch=4),
    _pixelcnn("pixelcnn_5x5B_C256_32x32", 32, 256, 256, (5, 5), "B", batch=64, small_batch=1),
    # Gated PixelCNN stacks (2p output channels feed the gate).
    BenchShape(
        "gated_vstack_5x5_C128-256_32x32", "gated", (32, 32), 128, 256, mk.vertical_stack_mask((5, 5)),
        batch=64, small_batch=2,
    ),
    BenchShape(
        "gated_hstack_1x5B_C128-256_32x32", "gated", (32, 32), 128, 256, mk.horizontal_stack_mask((1, 5), "B"),
        batch=64, small_batch=2,
    ),
    # WaveNet dilated causal convolutions, 16k samples.
    BenchShape(
        "wavenet_k2_d1_C64-128_L16k", "wavenet", (16384,), 64, 128, np.ones(2, bool),
        batch=32, small_batch=1, conv_args={"padding": "CAUSAL", "dilation": 1},
    ),
    BenchShape(
        "wavenet_k2_d32_C128-256_L16k", "wavenet", (16384,), 128, 256, np.ones(2, bool),
        batch=32, small_batch=1, conv_args={"padding": "CAUSAL", "dilation": 32},
    ),
    BenchShape(
        "wavenet_k2_d512_C256-512_L16k", "wavenet", (16384,), 256, 512, np.ones(2, bool),
        batch=16, small_batch=1, conv_args={"padding": "CAUSAL", "dilation": 512},
    ),
    BenchShape(
        "wavenet_k3masked_d8_C128-256_L16k", "wavenet", (16384,), 128, 256, mk.causal_mask(3),
        batch=32, small_batch=1, conv_args={"padding": "SAME", "dilation": 8},
    ),
)

HEADLINE_SHAPES = tuple(s for s in SHAPES if s.headline)

# The roofline's shapes (``python -m maskconv_kernels.bench roofline``), at the batch it
# times them: the PixelCNN layers of the leak report's timing table and one WaveNet layer.
ROOFLINE_SHAPES: tuple[BenchShape, ...] = (
    _pixelcnn("pixelcnn_7x7A_C64_32x32", 32, 64, 64, (7, 7), "A", batch=16, small_batch=1),
    _pixelcnn("pixelcnn_5x5B_C64_32x32", 32, 64, 64, (5, 5), "B", batch=16, small_batch=1),
    _pixelcnn("pixelcnn_3x3B_C128_32x32_N16", 32, 128, 128, (3, 3), "B", batch=16, small_batch=1),
    BenchShape(
        "wavenet_k2_d4_C128_L2048", "wavenet", (2048,), 128, 128, np.ones(2, bool),
        batch=16, small_batch=1, conv_args={"padding": "CAUSAL", "dilation": 4},
    ),
)


def by_name(name: str) -> BenchShape:
    for s in SHAPES:
        if s.name == name:
            return s
    raise KeyError(f"no benchmark shape named {name!r}; known: {[s.name for s in SHAPES]}")


@dataclasses.dataclass(frozen=True)
class CausalShape:
    """One causal convolution along time: ``x: (N, frames, *spatial, c_in)``, ``kernel: (*window, c_in, c_out)``.

    ``window[0]`` and ``stride`` are time's; the other axes have stride 1 and ``"SAME"``
    padding. A stream feeds ``chunk`` frames at a time (a multiple of ``stride``).
    """

    name: str
    family: str  # "video", "audio"
    frames: int
    spatial: tuple[int, ...]  # after time: (H, W) for video, () for audio
    c_in: int
    c_out: int
    window: tuple[int, ...]  # (k_T, *k_spatial)
    stride: int
    padding_mode: str  # "zeros" or "replicate"
    chunk: int
    batch: int  # the gpu preset's
    small_batch: int  # the cpu preset's
    cpu: bool  # in the cpu preset

    def x_shape(self, batch: int) -> tuple[int, ...]:
        return (batch, self.frames, *self.spatial, self.c_in)

    @property
    def kernel_shape(self) -> tuple[int, ...]:
        return (*self.window, self.c_in, self.c_out)

    @property
    def strides(self) -> tuple[int, ...]:
        return (self.stride, *(1 for _ in self.spatial))

    @property
    def out_frames(self) -> int:
        return (self.frames - 1) // self.stride + 1

    def flops(self, batch: int) -> int:
        """Multiply-adds of the forward pass, times 2."""
        return 2 * batch * self.out_frames * int(np.prod(self.spatial, dtype=np.int64)) * int(np.prod(self.window)) \
            * self.c_in * self.c_out


def _video(c_in, c_out, frames, hw, stride=1, padding_mode="zeros", cpu=False):
    s = f"_s{stride}" if stride > 1 else ""
    channels = f"C{c_in}" if c_in == c_out else f"C{c_in}-{c_out}"
    pad = "_replicate" if padding_mode == "replicate" else ""
    return CausalShape(f"video_3x3x3{s}_{channels}_T{frames}_{hw}x{hw}{pad}", "video", frames, (hw, hw), c_in, c_out,
                       (3, 3, 3), stride, padding_mode, chunk=4, batch=1, small_batch=1, cpu=cpu)


def _audio(c_in, c_out, k, stride=1, padding_mode="zeros", cpu=False):
    s = f"_s{stride}" if stride > 1 else ""
    channels = f"C{c_in}" if c_in == c_out else f"C{c_in}-{c_out}"
    pad = "_replicate" if padding_mode == "replicate" else ""
    return CausalShape(f"audio_k{k}{s}_{channels}_L24000{pad}", "audio", 24000, (), c_in, c_out, (k,), stride,
                       padding_mode, chunk=1920, batch=16, small_batch=1, cpu=cpu)


CAUSAL_SHAPES: tuple[CausalShape, ...] = (
    # Video VAE encoder layers, batch 1.
    _video(128, 128, 17, 32, cpu=True),
    _video(128, 128, 17, 32, padding_mode="replicate", cpu=True),
    _video(128, 128, 17, 32, stride=2, padding_mode="replicate", cpu=True),
    _video(128, 128, 17, 64),
    _video(256, 256, 17, 32),
    _video(256, 256, 9, 64),
    _video(256, 256, 17, 64, stride=2, padding_mode="replicate"),
    # Audio codec encoder layers, 1 s at 24 kHz.
    _audio(64, 32, 3, cpu=True),  # a residual unit's kernel-3 convolution
    _audio(64, 64, 7, padding_mode="replicate", cpu=True),
    _audio(64, 128, 4, stride=2, cpu=True),  # the downsampling layers: kernel 2 s, stride s
    _audio(128, 256, 8, stride=4, cpu=True),
    _audio(256, 512, 16, stride=8, cpu=True),
    _audio(256, 512, 10, stride=5),
    _audio(512, 256, 3),
    _audio(512, 128, 7),  # the last layer, to the latent
)


def causal_by_name(name: str) -> CausalShape:
    for s in CAUSAL_SHAPES:
        if s.name == name:
            return s
    raise KeyError(f"no causal benchmark shape named {name!r}; known: {[s.name for s in CAUSAL_SHAPES]}")
