"""A pipeline whose failures carry what clients must not see: the path of its model folder and
PIL's reprs with heap addresses (issue 16, exposure)."""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from omnirt.stages.pipeline import RequestRejected
from omnirt.stages.types import GenerationRequest, ImagePart
from PIL import Image, UnidentifiedImageError

from tests.fakes import EchoPipeline

SECRET_DIR = "/home/alice/private-models/tiny-omni"


class LeakyPipeline(EchoPipeline):
    """EchoPipeline loaded from a private folder that decodes images with PIL as the speech
    prompt does (``stages.speech.prompt``), passing PIL's message on: a repr with a heap address."""

    def __init__(self) -> None:
        super().__init__()
        self.info = dataclasses.replace(self.info, source=SECRET_DIR)

    def prepare(self, request: GenerationRequest) -> Any:
        for message in request.messages:
            for part in message.parts:
                if isinstance(part, ImagePart):
                    try:
                        Image.open(io.BytesIO(part.data)).load()
                    except (UnidentifiedImageError, OSError, ValueError) as exc:
                        raise RequestRejected(
                            f"image 1 of {SECRET_DIR} could not be decoded: {exc}"
                        ) from None
        return super().prepare(request)


def assert_nothing_internal(text: str) -> None:
    assert "/home/alice" not in text and "private-models" not in text, text
    assert "0x" not in text and " object at " not in text, text
