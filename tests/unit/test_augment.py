"""The CIFAR-10 recipe's input distortions, batch-wise, against per-image references."""

import math

import pytest
import torch

from paratrain.data.augment import CifarCentralCrop, CifarDistortions, Rescale, crop, per_image_standardization


def _images(n=6, seed=0):
    return torch.randint(0, 256, (n, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_per_image_standardization_is_tensorflows():
    x = _images().float()
    out = per_image_standardization(x)
    for image, result in zip(x, out):
        expected = (image - image.mean()) / max(image.std(unbiased=False).item(), 1 / math.sqrt(image.numel()))
        assert torch.allclose(result, expected, atol=1e-5)
    flat = per_image_standardization(torch.full((1, 3, 4, 4), 7.0))
    assert torch.equal(flat, torch.zeros_like(flat))  # the stddev floor: no division by zero


def test_crop_and_flip_take_each_images_own_window():
    x = _images()
    top, left = torch.tensor([0, 8, 3, 5, 1, 8]), torch.tensor([8, 0, 4, 2, 7, 8])
    flip = torch.tensor([False, True, False, True, True, False])
    out = crop(x, top, left, (24, 24), flip)
    for i in range(len(x)):
        window = x[i, :, top[i] : top[i] + 24, left[i] : left[i] + 24]
        assert torch.equal(out[i], window.flip(-1) if flip[i] else window)


def test_central_crop_is_the_middle_24x24_standardized():
    x = _images()
    out = CifarCentralCrop()(x)
    assert out.shape == (6, 3, 24, 24)
    assert torch.allclose(out, per_image_standardization(x[:, :, 4:28, 4:28].float()))


def test_distortions_are_a_crop_of_the_image_with_brightness_and_contrast():
    x = _images(4)
    # Without brightness and contrast, each output is the standardized crop at some
    # offset, maybe mirrored: find it among all 9 x 9 x 2 candidates.
    plain = CifarDistortions(max_brightness=0.0, contrast=(1.0, 1.0))(x, torch.Generator().manual_seed(0))
    for image, result in zip(x.float(), plain):
        candidates = [
            per_image_standardization(w[None])[0]
            for t in range(9)
            for l in range(9)
            for w in (image[:, t : t + 24, l : l + 24], image[:, t : t + 24, l : l + 24].flip(-1))
        ]
        assert any(torch.allclose(result, c, atol=1e-5) for c in candidates)
    full = CifarDistortions()(x, torch.Generator().manual_seed(0))
    assert full.shape == (4, 3, 24, 24)
    assert torch.allclose(full.mean(dim=(1, 2, 3)), torch.zeros(4), atol=1e-5)
    assert torch.allclose(full.std(dim=(1, 2, 3), unbiased=False), torch.ones(4), atol=1e-4)


def test_distortions_depend_only_on_the_generator():
    x = _images(8)
    a = CifarDistortions()(x, torch.Generator().manual_seed(5))
    b = CifarDistortions()(x, torch.Generator().manual_seed(5))
    c = CifarDistortions()(x, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_contrast_scales_about_each_channels_mean():
    # A two-level image: contrast 1.8 about the channel mean, then standardization,
    # differs from contrast 1.0 only through the channels' relative means.
    x = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    x[:, 0, :, 16:] = 200
    x[:, 1] = 100
    low = CifarDistortions(max_brightness=0.0, contrast=(1.0, 1.0))(x, torch.Generator().manual_seed(0))
    high = CifarDistortions(max_brightness=0.0, contrast=(1.8, 1.8))(x, torch.Generator().manual_seed(0))
    assert not torch.allclose(low, high)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float64])
def test_rescale(dtype):
    x = torch.tensor([0, 51, 255], dtype=dtype)
    out = Rescale(255.0)(x, None)
    assert out.dtype == torch.float32
    assert torch.allclose(out, torch.tensor([0.0, 0.2, 1.0]))
