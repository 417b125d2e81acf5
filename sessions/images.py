"""Whether an image a client adds to a conversation can be read, checked when it is added.

An image no decoder can read would fail every later response whose context holds it, until the
client deleted its item; so a conversation refuses it at ``conversation.item.create`` (and in a
response's own ``input``) with a clear error instead. The check is PIL's ``verify``: it
identifies the format and reads the file's structure (a PNG's chunks and their checksums)
without decoding the pixels, so it costs little on the event loop. The model's prompt builder
decodes the image when a response reads it.
"""

from __future__ import annotations

import io


def image_problem(data: bytes) -> str | None:
    """Why ``data`` is not an image PIL can read (its message), or None when it is."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        return str(exc) or type(exc).__name__
    return None
