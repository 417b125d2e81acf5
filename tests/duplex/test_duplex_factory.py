"""Building the duplex pipeline: the embedded demo and a checkpoint folder with its tokenizer."""

from __future__ import annotations

import pytest
import torch
from omnirt.stages.duplex.demo import demo_duplex
from omnirt.stages.duplex.loader import load_duplex
from omnirt.stages.duplex.pipeline import DuplexPipeline
from omnirt.stages.factory import build_duplex_pipeline
from omnirt.stages.speech.detok import IncrementalDetokenizer

from .reference import save_reference


def test_the_demo_builds_with_a_transformers_tokenizer():
    pipeline = build_duplex_pipeline("demo", device="cpu", max_slots=2, cuda_graphs=False)
    assert isinstance(pipeline, DuplexPipeline)
    assert pipeline.info.id == "demo-moshi" and pipeline.info.random_weights
    assert pipeline.lm.dtype == torch.float32 and pipeline.max_slots == 2
    tokenizer = pipeline.tokenizer
    ids = tokenizer.encode("hello there", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)  # the transformers API: len(), decode(..., clean_up...)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == "hello there"


def test_a_checkpoint_folder_loads_with_its_tokenizer(tmp_path):
    save_reference(tmp_path)
    with pytest.raises(ValueError, match="no tokenizer in"):
        load_duplex(tmp_path, max_slots=2, device="cpu", graphs=False)
    with pytest.raises(ValueError, match="no tokenizer in"):
        build_duplex_pipeline(str(tmp_path), device="cpu", max_slots=2, cuda_graphs=False)
    demo_duplex(1, "cpu", graphs=False)[2].save_pretrained(str(tmp_path))
    lm, mimi, tokenizer = load_duplex(tmp_path, max_slots=2, device="cpu", graphs=False)
    assert lm.dtype == torch.float32  # on CPU; bfloat16 on CUDA
    assert mimi.num_quantizers == lm.num_codebooks
    assert tokenizer.decode(tokenizer.encode("ok", add_special_tokens=False)) == "ok"
    pipeline = build_duplex_pipeline(str(tmp_path), device="cpu", max_slots=2, cuda_graphs=False)
    assert pipeline.info.id == tmp_path.name and not pipeline.info.random_weights
    with pytest.raises(ValueError, match="no such file or folder"):
        build_duplex_pipeline(str(tmp_path / "nope"), device="cpu", max_slots=2, cuda_graphs=False)
