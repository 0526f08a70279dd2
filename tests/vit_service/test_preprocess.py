"""Decoding uploads: what the model sees is the picture as a person would see it."""

import io

import numpy as np
from PIL import Image

from vit_service.preprocess import decode_image


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_a_16_bit_grayscale_image_is_scaled_not_clipped_and_can_be_reduced() -> None:
    ramp = np.linspace(0, 65535, 400 * 400).reshape(400, 400).astype(np.uint16)  # (H, W)
    data = _png(Image.fromarray(ramp))
    assert Image.open(io.BytesIO(data)).mode.startswith("I;16")
    for min_side in (None, 32):  # 32: scaled to 8 bits, then reduced, as the server decodes
        got = np.asarray(decode_image(data, min_side=min_side))
        assert got.shape[2] == 3 and got.shape[0] >= (min_side or 400)
        # the ramp survives: dark at the top, light at the bottom, mid-grey in the middle
        # (Pillow's own conversion clips at 255 and gives a white image, mean ~254.5)
        assert got[0].mean() < 10 and got[-1].mean() > 245
        assert 100 < got.mean() < 155


def test_training_reads_a_16_bit_image_as_the_server_does() -> None:
    from vit_service.data.images import decode_image as train_decode

    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)  # (H, W)
    data = _png(Image.fromarray(ramp))
    trained = train_decode(data, 64)  # (64, 64, 3): the size the model reads, no resize
    served = np.asarray(decode_image(data))
    np.testing.assert_array_equal(trained, served)
    assert trained[0].mean() < 10 and trained[-1].mean() > 245


def test_the_exif_orientation_is_applied() -> None:
    wide = np.zeros((20, 60, 3), np.uint8)  # (H, W, 3): landscape as stored
    wide[:, :10] = 255  # a white band at the left edge
    img = Image.fromarray(wide)
    exif = img.getexif()
    exif[0x0112] = 6  # "rotate 90 clockwise to display", what a phone writes held upright
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif, quality=95)
    got = np.asarray(decode_image(buf.getvalue()))
    assert got.shape[:2] == (60, 20)  # shown as a portrait
    assert got[:10].mean() > 200 and got[-10:].mean() < 50  # the band is now at the top


def test_training_and_serving_turn_an_exif_oriented_jpeg_alike() -> None:
    """A phone photo in an uploaded set: both training decoders (torchvision's batch path for a
    JPEG of the model's size, Pillow's for others) and the server see it upright."""
    from vit_service.data.images import ImageDecoder
    from vit_service.data.images import decode_image as train_decode

    square = np.zeros((32, 32, 3), np.uint8)  # (H, W, 3)
    square[:, :8] = 255  # a white band at the left edge, as stored
    img = Image.fromarray(square)
    exif = img.getexif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    img.save(buf, "JPEG", exif=exif, quality=95)
    data = buf.getvalue()
    served = np.asarray(decode_image(data))
    assert served[:8].mean() > 200 and served[-8:].mean() < 50  # the band on top
    dec = ImageDecoder(32)
    dec.add("fast", data)  # 32x32x3 JPEG: the batch path when torchvision is there
    [(_, trained)] = dec.finish()
    for got in (trained, train_decode(data, 32), train_decode(data, 16)):
        top = got[: got.shape[0] // 4]
        assert top.mean() > 200, got.mean(axis=(1, 2))
    np.testing.assert_allclose(trained.astype(int), served.astype(int), atol=8)
