"""What a model folder's weights must be before a loader hands them to ``from_pretrained``.

transformers and diffusers load what they find: a weight the files lack is initialised at
random (a report is printed, the model serves noise), integers are cast to floats, and a file cut
short or a shard index naming a missing file fails deep in the library with a traceback. The
loaders of every pipeline (speech, Z-Image, Wan) load through :func:`from_pretrained_checked`,
which refuses those cases with a :class:`CheckpointError` naming the file or the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """The folder is not a loadable checkpoint (the message says why)."""


#: safetensors dtypes of floating-point tensors (``F8_E4M3``, ``F16``, ``BF16``, ``F32``, ...): a
#: checkpoint that stores a weight in any other (integers, booleans) is not one of this config's,
#: unless the config says it is quantized.
FLOAT_DTYPE_PREFIXES = ("F", "BF")
#: What reading a broken checkpoint raises from the libraries (a file missing, unreadable or cut
#: short): reported as the checkpoint's error, not a traceback.
READ_ERRORS = (OSError, RuntimeError)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _shard_files(folder: Path) -> list[Path]:
    """The ``*.safetensors`` files of ``folder`` and those its ``*.safetensors.index.json`` names
    (each must be there); :class:`CheckpointError` naming what is missing or unreadable."""
    files = set(folder.glob("*.safetensors"))
    for index in folder.glob("*.safetensors.index.json"):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index} is not a readable shard index ({first_line(exc)})") from None
        missing = sorted(n for n in names if not (folder / n).is_file())
        if missing:
            raise CheckpointError(f"{index} names shards that are not there: {', '.join(missing[:3])}")
        files.update(folder / n for n in names)
    return sorted(files)


def check_weight_files(folder: Path, *, quantized: bool = False) -> None:
    """The ``*.safetensors`` weights of ``folder`` as a loader will read them: every shard its
    index names is there, every file is readable and whole (its header parses and covers the
    file), and, unless ``quantized``, every ``weight`` and ``bias`` is stored as floating point:
    else a :class:`CheckpointError` naming the file. Reads the headers only."""
    from safetensors import SafetensorError, safe_open

    for file in _shard_files(folder):
        try:
            with safe_open(str(file), "pt") as tensors:
                dtypes = {key: tensors.get_slice(key).get_dtype() for key in tensors.keys()}
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file ({first_line(exc)})") from None
        wrong = [
            f"{key} ({dtype})"
            for key, dtype in sorted(dtypes.items())
            if key.endswith((".weight", ".bias")) and not dtype.startswith(FLOAT_DTYPE_PREFIXES)
        ]
        if wrong and not quantized:
            listed = ", ".join(wrong[:3])
            raise CheckpointError(f"{file} stores weights that are not floating point: {listed}")


def from_pretrained_checked(cls: Any, folder: Path, what: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(folder, **kwargs)`` (a transformers or diffusers model class), refused
    with a :class:`CheckpointError` naming ``what`` when the files are broken
    (:func:`check_weight_files`) or leave weights of the model out, or of another shape, where
    the library would initialize them at random and serve noise."""
    check_weight_files(folder, quantized="quantization_config" in _config_of(folder))
    try:
        model, info = cls.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    except (*READ_ERRORS, ValueError) as exc:
        raise CheckpointError(f"{folder}: the {what} does not load ({first_line(exc)})") from None
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        listed = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"{folder}: the {what}'s checkpoint lacks {listed}")
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        key, stored, wanted = mismatched[0]
        raise CheckpointError(
            f"{folder}: the {what}'s {key} is stored as {list(stored)}, its config makes {list(wanted)}"
        )
    return model


def _config_of(folder: Path) -> dict:
    """``folder/config.json`` as a dict (empty where there is none or it is not one)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}
