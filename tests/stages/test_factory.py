"""``build_pipelines``: each ``--model`` goes to the builder of its family, decided by its layout
(fake builders stand in for the real loaders), and the result serves through the real app."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from omnirt.realtime.app import create_app
from omnirt.realtime.config import ServerConfig
from omnirt.stages.engine import Engine, EngineClient
from omnirt.stages.factory import Builders, build_pipelines, model_family

from tests.diffusion_fakes import FakeImagePipeline, FakeVideoPipeline
from tests.fakes import EchoPipeline
from tests.server import serve


def diffusers_folder(root: Path, name: str, pipeline_class: str) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "model_index.json").write_text(
        json.dumps({"_class_name": pipeline_class, "vae": ["diffusers", "X"]})
    )
    return folder


def speech_folder(root: Path, model_type: str = "qwen3_omni_moe") -> Path:
    folder = root / "speech"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


class Recorder:
    """Fake builders: what each was called with, and fake pipelines back."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, dict[str, Any]]] = []

    def speech(self, model: str | None, **options: Any) -> EchoPipeline:
        self.calls.append(("speech", model, options))
        return EchoPipeline()

    def diffusion(self, path: Path, **options: Any) -> FakeImagePipeline | FakeVideoPipeline:
        self.calls.append(("diffusion", path, options))
        kind = json.loads((path / "model_index.json").read_text())["_class_name"]
        return FakeVideoPipeline(path.name) if kind == "WanPipeline" else FakeImagePipeline(path.name)

    def embedded(self, **options: Any) -> list[Any]:
        self.calls.append(("embedded", None, options))
        return [FakeImagePipeline("embedded-image"), FakeVideoPipeline("embedded-video")]

    def duplex(self, model: str, **options: Any) -> Any:
        self.calls.append(("duplex", model, options))
        return FakeDuplex()

    @property
    def builders(self) -> Builders:
        return Builders(
            speech=self.speech, diffusion=self.diffusion, embedded_diffusion=self.embedded, duplex=self.duplex
        )


class FakeDuplex:
    kind = "duplex"


def test_layouts_decide_the_family(tmp_path: Path) -> None:
    image = diffusers_folder(tmp_path, "zimage", "ZImagePipeline")
    assert model_family(str(image)) == "diffusion"
    assert model_family(str(speech_folder(tmp_path))) == "speech"
    config = tmp_path / "qwen.json"
    config.write_text('{"model_type": "qwen3_omni_moe"}')
    assert model_family(str(config)) == "speech"  # a config alone (--load-format dummy)
    components = tmp_path / "z.components.json"
    components.write_text('{"transformer": {"_class_name": "ZImageTransformer2DModel"}}')
    assert model_family(str(components)) == "diffusion"
    assert model_family(str(image / "model_index.json")) == "diffusion"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda root: root / "missing", "no such file or folder"),
        (lambda root: root, "neither model_index.json"),
        (lambda root: speech_folder(root, "llama"), "holds a 'llama' model"),
        (lambda root: (root / "x.json").write_text("[1]") and root / "x.json", "does not hold a JSON object"),
        (lambda root: (root / "x.json").write_text("{nope") and root / "x.json", "not readable JSON"),
    ],
)
def test_unknown_layouts_say_why(tmp_path: Path, setup: Any, message: str) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match=message):
        build_pipelines([str(setup(tmp_path))], device="cpu", builders=recorder.builders)
    assert recorder.calls == []


def test_no_model_is_the_embedded_default() -> None:
    for models in ([], ["demo"]):
        recorder = Recorder()
        pipelines = build_pipelines(models, device="cpu", max_slots=3, builders=recorder.builders)
        assert [p.kind for p in pipelines] == ["speech", "image", "video", "duplex"]
        assert [c[0] for c in recorder.calls] == ["speech", "embedded", "duplex"]
        assert recorder.calls[0][1] in (None, "demo") and recorder.calls[0][2]["max_slots"] == 3
        assert recorder.calls[1][2] == {"device": "cpu", "quantization": "none", "cuda_graphs": True}
        assert recorder.calls[2][1] == "demo" and recorder.calls[2][2]["max_slots"] == 3


def test_the_duplex_model_is_chosen_by_duplex_model(tmp_path: Path) -> None:
    speech = str(speech_folder(tmp_path))
    cases = [([speech], None, None), ([speech], "demo", "demo"), ([], "none", None), ([speech], "/m", "/m")]
    for models, duplex_model, built in cases:
        recorder = Recorder()
        pipelines = build_pipelines(
            models, device="cpu", duplex_model=duplex_model, builders=recorder.builders
        )
        duplex = [c[1] for c in recorder.calls if c[0] == "duplex"]
        assert duplex == ([] if built is None else [built])
        assert ("duplex" in [p.kind for p in pipelines]) == (built is not None)


def test_the_duplex_kv_options_reach_the_duplex_builder() -> None:
    recorder = Recorder()
    build_pipelines(
        [],
        device="cpu",
        duplex_model="demo",
        duplex_kv_dtype="fp8",
        duplex_max_frames=750,
        builders=recorder.builders,
    )
    options = next(c[2] for c in recorder.calls if c[0] == "duplex")
    assert (options["kv_dtype"], options["max_frames"]) == ("fp8", 750)


def test_no_cuda_graphs_reaches_every_builder_and_the_denoisers_block_graphs(monkeypatch: Any) -> None:
    recorder = Recorder()
    build_pipelines([], device="cpu", cuda_graphs=False, builders=recorder.builders)
    assert [c[2]["cuda_graphs"] for c in recorder.calls] == [False, False, False]  # speech, embedded, duplex
    from omnirt.stages.diffusion import block_graphs

    monkeypatch.setattr(block_graphs, "BLOCK_GRAPHS", True)  # as once a GPU run turns them on
    real = Builders(speech=recorder.speech, duplex=recorder.duplex)  # the embedded diffusion builder
    for graphs in (True, False):
        pipelines = build_pipelines([], device="cpu", cuda_graphs=graphs, builders=real)[1:3]
        assert [p.denoiser.block_graphs.enabled for p in pipelines] == [graphs, graphs]


def test_speech_and_diffusion_folders_in_one_process(tmp_path: Path) -> None:
    speech = speech_folder(tmp_path)
    image = diffusers_folder(tmp_path, "zimage", "ZImagePipeline")
    video = diffusers_folder(tmp_path, "wan", "WanPipeline")
    recorder = Recorder()
    # Speech comes first whatever the order given: the engine's first pipeline describes the server.
    pipelines = build_pipelines(
        [str(image), str(video), str(speech)], device="cpu", load_format="dummy", builders=recorder.builders
    )
    assert [(p.kind, p.info.id) for p in pipelines] == [
        ("speech", "echo-test"),
        ("image", "zimage"),
        ("video", "wan"),
    ]
    assert recorder.calls[0] == (
        "speech",
        str(speech),
        {
            "device": "cpu", "max_slots": 32, "cuda_graphs": True, "prefill_chunk": 512, "prefix_cache": True,
            "load_format": "dummy", "max_context": None,
        },
    )
    dummy = {"device": "cpu", "load_format": "dummy", "quantization": "none", "cuda_graphs": True}
    assert recorder.calls[1:] == [("diffusion", image, dummy), ("diffusion", video, dummy)]
    # Diffusion alone: no speech model, no embedded pipelines.
    only = Recorder()
    assert [p.kind for p in build_pipelines([str(image)], device="cpu", builders=only.builders)] == ["image"]
    # The demo speech model beside a real diffusion folder.
    mixed = Recorder()
    kinds = [p.kind for p in build_pipelines(["demo", str(video)], device="cpu", builders=mixed.builders)]
    assert kinds == ["speech", "video"] and [c[0] for c in mixed.calls] == ["speech", "diffusion"]

    engine = Engine(pipelines)
    app = create_app(EngineClient(engine), ServerConfig(vad_preload=False))
    import httpx

    with serve(app) as url, httpx.Client(base_url=url, timeout=20) as http:
        listed = [(m["id"], m["kind"]) for m in http.get("/v1/models").json()["data"]]
        image_reply = http.post("/v1/images/generations", json={"prompt": "x", "model": "zimage"})
    assert listed == [("echo-test", "speech"), ("zimage", "image"), ("wan", "video")]
    assert image_reply.status_code == 200 and len(image_reply.json()["data"]) == 1


def test_two_models_of_one_diffusion_kind_are_refused_before_any_loads(tmp_path: Path) -> None:
    recorder = Recorder()
    first = diffusers_folder(tmp_path, "zimage-a", "ZImagePipeline")
    second = diffusers_folder(tmp_path, "zimage-b", "ZImagePipeline")
    with pytest.raises(ValueError, match="one image model per server, got two: .*zimage-a and .*zimage-b"):
        build_pipelines(["demo", str(first), str(second)], device="cpu", builders=recorder.builders)
    assert recorder.calls == []  # nothing was loaded


def test_two_speech_models_are_refused(tmp_path: Path) -> None:
    recorder = Recorder()
    with pytest.raises(ValueError, match="one speech model per server, got 2"):
        build_pipelines(["demo", str(speech_folder(tmp_path))], device="cpu", builders=recorder.builders)
    assert recorder.calls == []


def test_without_a_diffusion_runtime_the_default_is_speech_only_and_folders_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real diffusion builders when ``omnirt.stages.diffusion.factory`` cannot be imported."""
    monkeypatch.setitem(sys.modules, "omnirt.stages.diffusion.factory", None)  # import fails
    recorder = Recorder()
    builders = Builders(speech=recorder.speech)
    kinds = [p.kind for p in build_pipelines([], device="cpu", duplex_model="none", builders=builders)]
    assert kinds == ["speech"]
    image = diffusers_folder(tmp_path, "zimage", "ZImagePipeline")
    with pytest.raises(ValueError, match="this build has no diffusion runtime"):
        build_pipelines([str(image)], device="cpu", builders=builders)
