"""Named test cases shared by the suites: awkward shapes on purpose."""
from __future__ import annotations

import dataclasses

import numpy as np

import maskconv_kernels as mk


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    x_shape: tuple
    kernel_shape: tuple
    mask: np.ndarray
    conv_args: dict = dataclasses.field(default_factory=dict)
    small: bool = True  # cheap enough for interpret-mode kernel backends

    @property
    def groups(self):
        return self.conv_args.get("feature_group_count", 1)

    def reduction(self) -> int:
        """Longest sum an output is made of: active entries per output channel."""
        bits = np.asarray(self.mask, bool)
        if bits.ndim == len(self.kernel_shape):
            return int(bits.sum(axis=tuple(range(bits.ndim - 1))).max())
        return int(bits.sum()) * self.kernel_shape[-2]


def _c(name, x_shape, window, c_out, mask, small=True, **conv_args):
    groups = conv_args.get("feature_group_count", 1)
    kernel_shape = (*window, x_shape[-1] // groups, c_out)
    return Case(name, x_shape, kernel_shape, np.asarray(mask), conv_args, small)


A, B = "A", "B"
P = mk.pixelcnn_mask

CASES = [
    # 1-D (WaveNet-style)
    _c("1d_N2_L17_C3_k3_causal_SAME", (2, 17, 3), (3,), 4, mk.causal_mask(3)),
    _c("1d_N1_L31_C1_k2_CAUSAL_d3", (1, 31, 1), (2,), 2, np.ones(2), padding="CAUSAL", dilation=3),
    _c("1d_N2_L16_C5_k3_CAUSAL_s2", (2, 16, 5), (3,), 3, np.ones(3), padding="CAUSAL", strides=2),
    _c("1d_N2_L13_C4_k5_excl_VALID", (2, 13, 4), (5,), 4, mk.causal_mask(5, False), padding="VALID"),
    _c("1d_N1_L11_C2_k3_explicit", (1, 11, 2), (3,), 3, mk.causal_mask(3), padding=((2, 0),)),
    # 2-D (PixelCNN and friends)
    _c("2d_N2_H5_W5_C4_k3_lastrow", (2, 5, 5, 4), (3, 3), 4, np.array([[1, 1, 1], [1, 1, 1], [0, 0, 0]])),
    _c("2d_N2_H7_W9_C3_k1", (2, 7, 9, 3), (1, 1), 5, np.ones((1, 1))),
    _c("2d_N1_H8_W8_C1_k7A", (1, 8, 8, 1), (7, 7), 4, P((7, 7), A)),
    _c("2d_N2_H17_W13_C3_k5A", (2, 17, 13, 3), (5, 5), 6, P((5, 5), A)),
    _c("2d_N2_H11_W7_C5_k3B", (2, 11, 7, 5), (3, 3), 7, P((3, 3), B)),
    _c("2d_N1_H13_W11_C4_k5B_s2", (1, 13, 11, 4), (5, 5), 4, P((5, 5), B), strides=2),
    _c("2d_N1_H12_W9_C3_k3B_s21_d2", (1, 12, 9, 3), (3, 3), 4, P((3, 3), B), strides=(2, 1), dilation=2),
    _c("2d_N1_H9_W10_C4_k3B_VALID_d12", (1, 9, 10, 4), (3, 3), 3, P((3, 3), B), padding="VALID", dilation=(1, 2)),
    _c("2d_N1_H9_W8_C2_k3A_pad_neg", (1, 9, 8, 2), (3, 3), 3, P((3, 3), A), padding=((2, -1), (3, 0))),
    _c("2d_N1_H6_W7_C3_k1x3_vstack", (1, 6, 7, 3), (3, 3), 4, mk.vertical_stack_mask((3, 3))),
    _c("2d_N1_H6_W7_C3_k1x5_hstackA", (1, 6, 7, 3), (1, 5), 4, mk.horizontal_stack_mask((1, 5), A)),
    # One tap, a lone box whose convolution has padding (1, -1): jaxlib 0.10's CPU
    # transpose of that was garbage (found by the causality audit); and a tap that reads
    # padding only, for every output of a 2x2 input.
    _c("2d_N1_H7_W6_C1_k1x3_hstackA_onetap", (1, 7, 6, 1), (1, 3), 8, mk.horizontal_stack_mask((1, 3), A)),
    _c("2d_N1_H2_W2_C2_k1x7_padding_only_tap", (1, 2, 2, 2), (1, 7), 3, np.eye(7, dtype=bool)[6:]),
    _c("2d_N2_H8_W8_C4_k3B_groups2", (2, 8, 8, 4), (3, 3), 6, P((3, 3), B), feature_group_count=2),
    _c("2d_N1_H7_W7_C6_k3_rgbA_full", (1, 7, 7, 6), (3, 3), 6, mk.channel_grouped_mask((3, 3), 6, 6, A)),
    _c("2d_N1_H7_W7_C6_k5_rgbB_full", (1, 7, 7, 6), (5, 5), 9, mk.channel_grouped_mask((5, 5), 6, 9, B)),
    _c(
        "2d_N1_H6_W6_C4_k3_rgbB_full_groups2", (1, 6, 6, 4), (3, 3), 6,
        mk.channel_grouped_mask((3, 3), 2, 6, B, groups=2), feature_group_count=2,
    ),
    _c("2d_N1_H5_W5_C2_k3_allmasked", (1, 5, 5, 2), (3, 3), 2, np.zeros((3, 3))),
    _c("2d_N1_H5_W5_C130_k3A", (1, 5, 5, 130), (3, 3), 3, P((3, 3), A), small=False),
    # 3-D (causal video)
    _c("3d_N1_D5_H6_W5_C2_k3A", (1, 5, 6, 5, 2), (3, 3, 3), 3, P((3, 3, 3), A)),
    _c("3d_N1_D4_H5_W5_C3_k3B_s2", (1, 4, 5, 5, 3), (3, 3, 3), 2, P((3, 3, 3), B), strides=(1, 2, 2)),
]

CASE_IDS = [c.name for c in CASES]
