"""Decoding images we did not make: the pixel count is read from the header and checked before anything is decoded.

An image decoder allocates whatever the header declares (a 1.5 MB PNG declaring 40000 x 40000 pixels decodes to
4.8 GB), unlike PIL, whose `Image.open` refuses images above `PIL.Image.MAX_IMAGE_PIXELS`. So every image
vtrain decodes (image folders, COCO, RecordIO records, `.bin` packs, `hf:` rows, `vtrain predict` inputs) goes
through `decode_rgb` here: PIL reads the size (and frame count) from the header without decoding, the product is
held against `--max-image-pixels` (default: PIL's own limit), and only then is it decoded: JPEG, GIF and WebP by
TorchCodec (its `decode_image`, which replaces torchvision's deprecated image decoding since torchvision 0.29), PNG
by PIL (torchvision 0.29.1's PNG decoder ended the process with SIGSEGV on a damaged file). A refused or unreadable
image (truncated, damaged, not an image) is a `BadSample` naming it, which `--skip-bad-images` skips in training
(docs/input_limits.md §2). Every depth and mode comes out as 8-bit RGB (docs/input_limits.md §11): palette, grey,
grey + alpha, RGBA and CMYK are converted, and 16 bits per channel keep their top byte (uint16 would be misread as
8-bit values by every consumer, and the drawing in `predict` refuses it).
"""

from __future__ import annotations

import contextlib
import io
import re
import struct
import threading
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import torch
from PIL import Image, UnidentifiedImageError
from torchcodec.decoders import decode_image
from torchvision.transforms.v2.functional import to_dtype

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.errors import BadSample

# what TorchCodec's decode_image reads (JPEG, PNG, GIF, WebP; AVIF where PIL has it): a header PIL reads as
# anything else (BMP, TIFF, ...) is not what TorchCodec will decode
Image.init()
_FORMATS = tuple(f for f in ("JPEG", "PNG", "GIF", "WEBP", "AVIF") if f in Image.OPEN)
# PIL refuses above 2 x its MAX_IMAGE_PIXELS before telling the size, which would cap --max-image-pixels; our
# check replaces PIL's while a header is read (PIL decodes PNGs only, after our check; the rest is TorchCodec's)
_PIL_LIMIT = threading.Lock()
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_SOURCE_LINE = re.compile(r"^[\w:~<>()]+, \S+\.(?:cpp|h|hpp):\d+, ")


@contextlib.contextmanager
def _opened(data: bytes, what: str, formats: tuple[str, ...] = _FORMATS) -> Iterator[Image.Image]:
    """PIL's lazy open of encoded bytes (the header only), with our pixel check in place of PIL's own; any error
    of the file, at open or while it is used, is a BadSample naming `what`."""
    try:
        with _PIL_LIMIT:
            saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # PIL's notes on odd but readable headers
                    im = Image.open(io.BytesIO(data), formats=formats)
            finally:
                Image.MAX_IMAGE_PIXELS = saved
        with im, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield im
    except UnidentifiedImageError:  # its message names the in-memory buffer, not the image
        raise BadSample(f"cannot decode image {what}: not a {', '.join(formats)} image") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, zlib.error) as e:
        raise BadSample(f"cannot decode image {what}: {' '.join(str(e).split())[:200] or type(e).__name__}") \
            from None


def header_size(data: bytes, what: str) -> tuple[int, int, int]:
    """(width, height, frames) from an encoded image's header; nothing is decoded. A header PIL cannot read is a
    BadSample naming `what`."""
    with _opened(data, what) as im:
        # n_frames walks the frame headers of an animated GIF / WebP without decoding them
        return int(im.width), int(im.height), int(getattr(im, "n_frames", 1))


def _decode_png(data: bytes, what: str) -> torch.Tensor:
    """A PNG as uint8 RGB CHW, decoded by PIL: torchvision's decode_png (0.29.1) ends the process with SIGSEGV on
    any error libpng raises while reading the rows (a damaged IDAT: bad CRC, bad zlib data, a bad filter byte, too
    little data), where PIL raises an exception (docs/input_limits.md §11). Grey of 16 bits keeps its top byte, as
    PIL itself reads 16-bit colour PNGs (RGB;16B); alpha is dropped, as torchvision's RGB mode does."""
    with _opened(data, what, ("PNG",)) as im:
        im.load()
        if im.mode in ("I;16", "I;16B", "I;16L", "I"):
            grey = (np.asarray(im).astype(np.uint32) >> 8).astype(np.uint8)
            rgb = np.repeat(grey[None], 3, axis=0)
        else:
            rgb = np.asarray(im.convert("RGB")).transpose(2, 0, 1)
    return torch.from_numpy(np.array(rgb, order="C"))  # a copy: PIL's array is read-only (torch warns of it)


def check_pixels(width: int, height: int, frames: int, what: str, max_pixels: int) -> None:
    """A BadSample when width x height x frames exceeds `max_pixels` (what decoding would allocate, x 3 bytes)."""
    pixels = width * height * frames
    if pixels > max_pixels:
        size = f"{width}x{height}" + (f"x{frames} frames" if frames > 1 else "")
        raise BadSample(f"refusing to decode image {what}: {size} = {pixels} pixels, above the limit of "
                        f"{max_pixels} (--max-image-pixels raises it)")


def read_encoded(data: str | Path | bytes | bytearray | memoryview, what: str) -> bytes:
    """The encoded bytes of a file or buffer; an unreadable file is a BadSample naming it."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return bytes(data)
    try:
        return Path(data).read_bytes()
    except OSError as e:
        raise BadSample(f"cannot read image {what}: {e.strerror or e}") from None


def decode_rgb(data: str | Path | bytes | tuple[str, bytes], what: str | None = None,
               max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> torch.Tensor:
    """Decode a file, encoded bytes (JPEG, PNG, ...) or (name, encoded bytes), e.g. a row of a Hugging Face
    datasets `Image` column, to uint8 RGB CHW, after checking its header's pixel count against `max_pixels`;
    `what` names it in errors (default: the file or the name). An animated image gives its first frame."""
    if isinstance(data, tuple):
        name, data = data
        what = what or name
    what = what or str(data)
    raw = read_encoded(data, what)
    check_pixels(*header_size(raw, what), what, max_pixels)
    if raw[:8] == _PNG_SIGNATURE:
        return _decode_png(raw, what)
    try:
        # a writable copy: torch.frombuffer shares memory with `raw`; decode_image takes a 1-D uint8 tensor
        img = decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode="RGB")
    except Exception as e:
        # a decoder's message may start with the C++ function and source line that raised: the user needs the rest
        text = _SOURCE_LINE.sub("", " ".join(str(e).split()))
        raise BadSample(f"cannot decode image {what}: {text[:200]}") from None
    img = img[0] if img.ndim == 4 else img  # decode_image returns every frame of an animated GIF / WebP
    if img.dtype != torch.uint8:  # more than 8 bits (PNGs no longer come here): the top byte, as for a PNG
        img = to_dtype(img, torch.uint8, scale=True)
    return img


def image_size(data: str | Path | bytes | tuple[str, bytes], what: str | None = None) -> tuple[int, int]:
    """(width, height) from the header of a file, encoded bytes or (name, encoded bytes); nothing decoded."""
    if isinstance(data, tuple):
        name, data = data
        what = what or name
    what = what or str(data)
    w, h, _ = header_size(read_encoded(data, what), what)
    return w, h
