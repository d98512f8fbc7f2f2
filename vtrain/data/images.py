"""Decoding images we did not make: the pixel count is read from the header and checked before anything is decoded.

An image decoder allocates whatever the header declares (a 1.5 MB PNG declaring 40000 x 40000 pixels decodes to
4.8 GB), unlike PIL, whose `Image.open` refuses images above `PIL.Image.MAX_IMAGE_PIXELS`. So every image
vtrain decodes (image folders, COCO, RecordIO records, `.bin` packs, `hf:` rows, `vtrain predict` inputs) goes
through `decode_rgb` here: PIL reads the size (and frame count) from the header without decoding, the product is
held against `--max-image-pixels` (default: PIL's own limit), and only then does TorchCodec decode (its
`decode_image`, which replaces torchvision's deprecated image decoding since torchvision 0.29). A refused or
unreadable image is a `BadSample` naming it, which `--skip-bad-images` skips in training (docs/input_limits.md §2).
"""

from __future__ import annotations

import io
import struct
import threading
import warnings
from pathlib import Path

import torch
from PIL import Image, UnidentifiedImageError
from torchcodec.decoders import decode_image

from vtrain.config import DEFAULT_MAX_IMAGE_PIXELS
from vtrain.errors import BadSample

# what TorchCodec's decode_image reads (JPEG, PNG, GIF, WebP; AVIF where PIL has it): a header PIL reads as
# anything else (BMP, TIFF, ...) is not what TorchCodec will decode
Image.init()
_FORMATS = tuple(f for f in ("JPEG", "PNG", "GIF", "WEBP", "AVIF") if f in Image.OPEN)
# PIL refuses above 2 x its MAX_IMAGE_PIXELS before telling the size, which would cap --max-image-pixels; our
# check replaces PIL's while a header is read (PIL only reads headers in vtrain; decoding is TorchCodec's)
_PIL_LIMIT = threading.Lock()


def header_size(data: bytes, what: str) -> tuple[int, int, int]:
    """(width, height, frames) from an encoded image's header; nothing is decoded. A header PIL cannot read is a
    BadSample naming `what`."""
    with _PIL_LIMIT:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # PIL's notes on odd but readable headers
                with Image.open(io.BytesIO(data), formats=_FORMATS) as im:
                    # n_frames walks the frame headers of an animated GIF / WebP without decoding them
                    return int(im.width), int(im.height), int(getattr(im, "n_frames", 1))
        except UnidentifiedImageError:  # its message names the in-memory buffer, not the image
            raise BadSample(f"cannot decode image {what}: not a {', '.join(_FORMATS)} image") from None
        except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
            raise BadSample(f"cannot decode image {what}: {' '.join(str(e).split())[:200] or type(e).__name__}") \
                from None
        finally:
            Image.MAX_IMAGE_PIXELS = saved


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
    try:
        # a writable copy: torch.frombuffer shares memory with `raw`; decode_image takes a 1-D uint8 tensor
        img = decode_image(torch.frombuffer(bytearray(raw), dtype=torch.uint8), mode="RGB")
    except Exception as e:
        raise BadSample(f"cannot decode image {what}: {' '.join(str(e).split())[:200]}") from None
    return img[0] if img.ndim == 4 else img  # decode_image returns every frame of an animated GIF / WebP


def image_size(data: str | Path | bytes | tuple[str, bytes], what: str | None = None) -> tuple[int, int]:
    """(width, height) from the header of a file, encoded bytes or (name, encoded bytes); nothing decoded."""
    if isinstance(data, tuple):
        name, data = data
        what = what or name
    what = what or str(data)
    w, h, _ = header_size(read_encoded(data, what), what)
    return w, h
