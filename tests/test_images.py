"""Image preprocessing: parity with the HF image processor, patch order, and bad images.

Tolerance for pixel_values vs HF: both sides run Pillow's bicubic ``Image.resize`` on the same uint8
RGB image and the same float steps (float64 rescale by 1/255, float32 normalise), so the values are
expected bit-identical; we allow 1e-6 where no resampling happens. Where resampling happens a different
Pillow build may round a resampled pixel to the neighbouring 8-bit level, which is 2/255 after
normalisation; that case allows one such level per value and a mean difference below 1e-3.
"""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.errors import ImageError
from engine.arch.qwen3vl.preprocess import patchify, prepare_image, smart_resize
from engine.vision.images import open_image, read_source, to_rgb

FIX = Path(__file__).parent / "fixtures" / "vision"
LEVEL = 2.0 / 255.0


@pytest.fixture(scope="module")
def gold():
    return dict(np.load(FIX / "golden.npz"))


@pytest.mark.parametrize("case, resampled", [("rgb64", False), ("rgba50x70", True), ("rgb75x100", True),
                                             ("down100x140", True)])
def test_pixel_values_match_hf_processor(gold, case, resampled):
    lo, hi = (int(x) for x in gold[f"prep_{case}_bounds"])
    prep = prepare_image(Image.fromarray(gold[f"prep_{case}_image"]), min_pixels=lo, max_pixels=hi)
    ref = gold[f"prep_{case}_pixel_values"]
    assert prep.grid == tuple(int(x) for x in gold[f"prep_{case}_grid"][1:])
    assert prep.pixel_values.shape == ref.shape and prep.pixel_values.dtype == np.float32
    diff = np.abs(prep.pixel_values - ref)
    if resampled:
        assert diff.max() <= LEVEL + 1e-6 and diff.mean() < 1e-3
    else:
        assert diff.max() <= 1e-6


def test_smart_resize_rounding_and_bounds():
    assert smart_resize(80, 80, min_pixels=1024) == (64, 64)          # 2.5 -> 2: Python rounds half to even
    assert smart_resize(112, 112, min_pixels=1024) == (128, 128)      # 3.5 -> 4
    assert smart_resize(64, 64) == (256, 256)                         # upscaled to min_pixels
    assert smart_resize(3000, 4000) == (3008, 4000)
    assert smart_resize(3000, 4000, max_pixels=1024 * 1024) == (864, 1152)
    assert smart_resize(1, 1, min_pixels=1024) == (32, 32)
    with pytest.raises(ImageError, match="aspect ratio"):
        smart_resize(1, 300)
    with pytest.raises(ValueError):
        smart_resize(64, 64, min_pixels=2048, max_pixels=1024)


def test_patch_order_is_merge_window_with_temporal_copy():
    """Each 16x16 patch is filled with its raster index; rows must come in 2x2 window order."""
    gh, gw = 4, 6
    idx = np.arange(gh * gw).reshape(gh, gw)
    img = np.repeat(np.repeat(idx, 16, 0), 16, 1)[..., None].repeat(3, -1).astype(np.uint8)
    pv = patchify(img, 16, 2, 2, (0.0, 0.0, 0.0), (1 / 255, 1 / 255, 1 / 255))
    order = [int(round(v)) for v in pv[:, 0]]
    assert order[:8] == [0, 1, 6, 7, 2, 3, 8, 9]
    per = pv.reshape(gh * gw, 3, 2, 16, 16)
    assert np.array_equal(per[:, :, 0], per[:, :, 1])


def test_size_used_is_reported(tmp_path):
    p = tmp_path / "wide.png"
    Image.new("RGB", (1000, 700), (10, 20, 30)).save(p)
    prep = prepare_image(p, max_pixels=200_000)
    assert prep.original_size == (700, 1000)
    assert prep.size == (352, 512) and prep.grid == (22, 32)


def test_digest_is_content_based(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    Image.new("RGB", (40, 40), (1, 2, 3)).save(a)
    b.write_bytes(a.read_bytes())
    assert read_source(a).digest == read_source(b).digest == read_source(a.read_bytes()).digest
    im = Image.new("RGB", (40, 40), (1, 2, 3))
    assert read_source(im).digest == read_source(im.copy()).digest
    assert read_source(im).digest != read_source(Image.new("RGB", (40, 40), (1, 2, 4))).digest


# ----------------------------------------------------------------------------------------- bad images

def _bytes(im: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def test_cmyk_jpeg(tmp_path):
    p = tmp_path / "cmyk.jpg"
    p.write_bytes(_bytes(Image.new("CMYK", (64, 64), (255, 0, 0, 0)), "JPEG", quality=95))
    rgb, _ = open_image(p)
    assert rgb.mode == "RGB"
    r, g, b = rgb.getpixel((32, 32))
    assert r < 30 and g > 225 and b > 225                             # pure cyan


def test_16bit_png_is_scaled_not_clipped(tmp_path):
    p = tmp_path / "gray16.png"
    ramp = np.linspace(0, 65535, 64 * 64).reshape(64, 64).astype(np.uint16)
    Image.fromarray(ramp).save(p)
    assert Image.open(p).mode.startswith("I")
    rgb, _ = open_image(p)
    a = np.asarray(rgb)
    assert a[0, 0, 0] == 0 and a[-1, -1, 0] == 255 and 120 <= a[32, 0, 0] <= 135
    assert prepare_image(p, min_pixels=1024).grid == (4, 4)


def test_palette_with_transparency_composited_on_white(tmp_path):
    p = tmp_path / "pal.png"
    im = Image.new("P", (32, 32), 0)
    im.putpalette([255, 0, 0] + [0, 0, 255] + [0] * 762)
    im.paste(1, (16, 0, 32, 32))
    im.save(p, transparency=0)
    rgb, _ = open_image(p)
    assert rgb.getpixel((0, 0)) == (255, 255, 255) and rgb.getpixel((31, 0)) == (0, 0, 255)


@pytest.mark.parametrize("mode, color", [("LA", (0, 0)), ("RGBA", (0, 0, 0, 0)), ("PA", (0, 0)), ("La", (0, 0))])
def test_alpha_modes_composited_on_white(mode, color):
    rgb = to_rgb(Image.new(mode, (8, 8), color))
    assert rgb.mode == "RGB" and rgb.getpixel((0, 0)) == (255, 255, 255)


@pytest.mark.parametrize("mode", ["1", "L", "I", "F", "YCbCr", "HSV", "LAB", "P"])
def test_other_modes_convert(mode):
    assert to_rgb(Image.new(mode, (8, 8))).mode == "RGB"


def test_exif_rotated_photo(tmp_path):
    p = tmp_path / "rot.jpg"
    im = Image.new("RGB", (64, 32), (255, 0, 0))
    im.paste((0, 0, 255), (32, 0, 64, 32))                            # left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6                                                  # "rotate 90 CW to display"
    p.write_bytes(_bytes(im, "JPEG", exif=exif.tobytes(), quality=95))
    rgb, _ = open_image(p)
    assert rgb.size == (32, 64)
    top, bottom = rgb.getpixel((16, 8)), rgb.getpixel((16, 56))
    assert top[0] > 200 and top[2] < 60 and bottom[2] > 200 and bottom[0] < 60
    assert prepare_image(p, min_pixels=1024).original_size == (64, 32)


def test_one_pixel_image(tmp_path):
    p = tmp_path / "dot.png"
    Image.new("RGB", (1, 1), (200, 100, 50)).save(p)
    prep = prepare_image(p)
    assert prep.size == (256, 256) and prep.pixel_values.shape == (256, 1536)
    assert prepare_image(p, min_pixels=1024).grid == (2, 2)


def _png_header_only(width: int, height: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def test_decompression_bomb_refused_from_header(tmp_path, monkeypatch):
    from PIL import ImageFile

    def load(self):
        raise AssertionError("the pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)       # refused from the header: never decoded
    p = tmp_path / "bomb.png"
    p.write_bytes(_png_header_only(30000, 30000))
    with pytest.raises(ImageError, match="exceeds the limit of .* pixels.*900000000") as e:
        prepare_image(p)
    assert "bomb.png" in str(e.value)


def test_pixel_limit_is_settable(tmp_path):
    p = tmp_path / "ok.png"
    Image.new("RGB", (100, 100)).save(p)
    with pytest.raises(ImageError, match="100x100 = 10,000 pixels exceeds the limit of 5,000 pixels"):
        prepare_image(p, max_input_pixels=5000)
    big = tmp_path / "big.png"
    big.write_bytes(_png_header_only(12000, 9000))
    with pytest.raises(ImageError, match="12000x9000 = 108,000,000 pixels exceeds the limit of 89,478,485"):
        prepare_image(big)


def test_truncated_jpeg(tmp_path):
    p = tmp_path / "cut.jpg"
    rng = np.random.default_rng(0)
    data = _bytes(Image.fromarray(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)), "JPEG")
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(ImageError, match="truncated or corrupt JPEG") as e:
        prepare_image(p)
    assert "cut.jpg" in str(e.value)


def test_animated_gif_uses_first_frame(tmp_path):
    p = tmp_path / "anim.gif"
    frames = [Image.new("RGB", (32, 32), c) for c in [(255, 0, 0), (0, 255, 0), (0, 0, 255)]]
    frames[0].save(p, save_all=True, append_images=frames[1:], duration=50, loop=0)
    assert Image.open(p).n_frames == 3
    rgb, _ = open_image(p)
    r, g, b = rgb.getpixel((16, 16))
    assert r > 200 and g < 50 and b < 50


def test_text_file_named_png(tmp_path):
    p = tmp_path / "notes.png"
    p.write_text("this is not a picture\n")
    with pytest.raises(ImageError, match=r"notes\.png: not an image .*'\.png'.*expected PNG, JPEG"):
        prepare_image(p)


@pytest.mark.parametrize("content", [b"", b"\x89PNG\r\n\x1a\n\0\0"])
def test_empty_or_header_only_file(tmp_path, content):
    p = tmp_path / "x.png"
    p.write_bytes(content)
    with pytest.raises(ImageError, match="x.png"):
        prepare_image(p)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="cannot read the file"):
        prepare_image(tmp_path / "nope.jpg")


def test_too_elongated_image_named(tmp_path):
    p = tmp_path / "strip.png"
    Image.new("RGB", (3000, 10)).save(p)
    with pytest.raises(ImageError, match=r"strip\.png: .*aspect ratio 300:1"):
        prepare_image(p)


@pytest.mark.parametrize("bounds", [(65536, 65536), (1024, 65536), (4096, 200_000), (1024, 1024), (65536, 1 << 20)])
def test_max_resized_pixels_bounds_smart_resize_and_is_reached(bounds):
    """No input gives more than the bound (a thin side raised to the factor, or the scale-up, can pass
    max_pixels), and some input reaches it."""
    import random

    from engine.arch.qwen3vl.preprocess import max_resized_pixels
    from engine.vision.images import MAX_ASPECT

    lo, hi = bounds
    bound = max_resized_pixels(32, lo, hi)
    rng = random.Random(0)
    seen = 0
    for h in list(range(1, 40)) + [rng.randint(1, 20000) for _ in range(150)]:
        for r in [1, 2, 10, 100, 199, 199.5, 199.9, MAX_ASPECT] + [rng.uniform(1, MAX_ASPECT) for _ in range(15)]:
            w = int(h * r)
            if w / h <= MAX_ASPECT:
                y, x = smart_resize(h, w, 32, lo, hi)
                seen = max(seen, y * x)
    assert seen == bound
    assert max_resized_pixels(32, 1024, 256 * 256) // 256 == 452  # e.g. 10000 x 50 pixels: 452 patches, not 256
