"""CudaGraphRunner: eager fallback and switches on CPU; capture/replay under marker ``gpu``."""

from __future__ import annotations

import threading

import pytest
import torch
from omnirt.stages import graphs
from omnirt.stages.graphs import CudaGraphRunner, LengthBucketedRunner, batch_size, check_distinct, prewarm

SLOTS = 8


class Accumulator:
    """A slot-pooled toy step: state[:b] += x where exec; out = state * 2 + sin(x)."""

    def __init__(self, device: str) -> None:
        self.state = torch.zeros(SLOTS, 4, device=device)
        self.device = device

    def step(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x, run = inputs["x"], inputs["exec"]
        rows = x.shape[0]
        state = self.state[:rows]
        state.copy_(torch.where(run[:, None], state + x, state))
        return {"y": state * 2 + torch.sin(x), "total": state.sum(-1, keepdim=True)}

    def make_inputs(self, rows: int) -> dict[str, torch.Tensor]:
        return {
            "x": torch.zeros(rows, 4, device=self.device),
            "exec": torch.zeros(rows, dtype=torch.bool, device=self.device),
        }


def _inputs(rows: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(rows, 4, generator=generator).to(device),
        "exec": torch.ones(rows, dtype=torch.bool, device=device),
    }


def test_batch_size_checks_the_leading_dimension():
    assert batch_size({"a": torch.zeros(3, 2), "b": torch.zeros(3)}) == 3
    with pytest.raises(ValueError, match="leading"):
        batch_size({"a": torch.zeros(3, 2), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match="leading"):
        batch_size({"a": torch.zeros(())})
    with pytest.raises(ValueError, match="at least one"):
        batch_size({})


def test_static_inputs_must_not_share_a_buffer():
    """Two inputs on one buffer would both read the last one copied in (the talker's text token
    and text kind once did, and the graph saw the kind as the token)."""
    zeros = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="'a' and 'b' one buffer"):
        check_distinct({"a": zeros, "b": zeros})
    check_distinct({"a": zeros, "b": torch.zeros(4, dtype=torch.long), "c": zeros.bool()})


def test_buckets_must_be_positive():
    toy = Accumulator("cpu")
    with pytest.raises(ValueError, match="buckets"):
        CudaGraphRunner(toy.step, toy.make_inputs, [])
    with pytest.raises(ValueError, match="buckets"):
        CudaGraphRunner(toy.step, toy.make_inputs, [0, 4])


@pytest.mark.parametrize("enabled", [True, False])
def test_cpu_runs_eager_and_captures_nothing(enabled):
    toy, reference = Accumulator("cpu"), Accumulator("cpu")
    runner = CudaGraphRunner(toy.step, toy.make_inputs, [2, 4], enabled=enabled)
    runner.capture()
    assert runner.captured_buckets == []
    assert runner.bucket_for(2) is None
    out = runner(_inputs(3, "cpu"))
    assert runner.last_path == "eager"
    expected = reference.step(_inputs(3, "cpu"))
    assert out.keys() == expected.keys()
    assert all(torch.equal(out[k], expected[k]) for k in out)
    assert torch.equal(toy.state, reference.state)
    with pytest.raises(ValueError, match="leading"):
        runner({"x": torch.zeros(2, 4), "exec": torch.ones(3, dtype=torch.bool)})


class _Calls:
    """Stands in for a runner: ``warm_calls`` that note the thread they ran on (one fails)."""

    def __init__(self, count: int, fail: int | None = None) -> None:
        self.count, self.fail = count, fail
        self.ran: list[tuple[int, str]] = []
        self.barrier = threading.Barrier(2, timeout=10)

    def warm_calls(self):
        def call(i: int) -> None:
            if i < 2:  # the first two wait for each other: they must run side by side
                self.barrier.wait()
            self.ran.append((i, threading.current_thread().name))
            if i == self.fail:
                raise RuntimeError("out of memory, say")

        return [lambda i=i: call(i) for i in range(self.count)]


def test_prewarm_runs_every_call_side_by_side_and_logs_a_failure(caplog):
    first, second = _Calls(3, fail=2), _Calls(2)
    seconds = prewarm([first, second], workers=4)
    assert seconds > 0
    assert sorted(i for i, _ in first.ran) == [0, 1, 2] and sorted(i for i, _ in second.ran) == [0, 1]
    assert all(name.startswith("omnirt-prewarm") for _, name in first.ran + second.ran)
    assert "failed" in caplog.text and "out of memory" in caplog.text


@pytest.mark.parametrize(("cpus", "workers"), [(1, 1), (2, 2), (16, 16), (64, 16)])
def test_default_compile_workers_are_the_usable_cpus_up_to_16(cpus, workers, monkeypatch):
    monkeypatch.setattr(graphs.os, "sched_getaffinity", lambda pid: set(range(cpus)), raising=False)
    assert graphs.default_compile_workers() == workers


def test_prewarm_with_one_worker_or_no_calls_does_nothing():
    calls = _Calls(1)
    assert prewarm([calls], workers=1) == 0.0 and calls.ran == []
    toy = Accumulator("cpu")
    runners = [CudaGraphRunner(toy.step, toy.make_inputs, [2, 4]),
               LengthBucketedRunner(lambda inputs, n: toy.step(inputs), lambda b, n: toy.make_inputs(b),
                                    batch_buckets=[2], length_buckets=[8, 16])]  # fmt: skip
    if not torch.cuda.is_available():  # off CUDA a runner has no warm calls
        assert all(r.warm_calls() == [] for r in runners)
        assert prewarm(runners, workers=4) == 0.0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
def test_replay_equals_eager_bitwise_and_pads_with_idle_rows():
    toy, reference = Accumulator("cuda"), Accumulator("cuda")
    runner = CudaGraphRunner(toy.step, toy.make_inputs, [2, 4])
    runner.capture()
    assert runner.captured_buckets == [2, 4]
    assert torch.count_nonzero(toy.state) == 0  # warm-up and capture with exec=False left state alone
    for seed, rows in enumerate([2, 4, 3, 2]):
        got = runner(_inputs(rows, "cuda", seed))
        assert runner.last_path == "graph"
        bucket = runner.bucket_for(rows)
        padded = {
            k: torch.zeros_like(v[:1]).expand(bucket, *v.shape[1:]).clone()
            for k, v in _inputs(rows, "cuda").items()
        }
        for k, v in _inputs(rows, "cuda", seed).items():
            padded[k][:rows] = v
        expected = {k: v[:rows] for k, v in reference.step(padded).items()}
        assert all(torch.equal(got[k], expected[k]) for k in got)
        assert torch.equal(toy.state, reference.state)
    kept = runner(_inputs(2, "cuda", 7))
    snapshot = {k: v.clone() for k, v in kept.items()}
    runner(_inputs(2, "cuda", 8))
    assert all(torch.equal(kept[k], snapshot[k]) for k in kept)  # callers keep clones


@pytest.mark.gpu
@cuda
def test_uncaptured_shapes_and_disabled_runner_fall_back_to_eager():
    toy = Accumulator("cuda")
    runner = CudaGraphRunner(toy.step, toy.make_inputs, [2])
    runner.capture()
    runner(_inputs(3, "cuda"))
    assert runner.last_path == "eager"
    runner(
        {
            "x": torch.zeros(2, 4, device="cuda", dtype=torch.float64),
            "exec": torch.ones(2, dtype=torch.bool, device="cuda"),
        }
    )
    assert runner.last_path == "eager"
    runner.enabled = False
    runner(_inputs(2, "cuda"))
    assert runner.last_path == "eager"
    runner.enabled = True
    runner(_inputs(2, "cuda"))
    assert runner.last_path == "graph"


@pytest.mark.gpu
@cuda
def test_prewarm_on_the_gpu_changes_no_state_and_the_capture_follows():
    toy = Accumulator("cuda")
    runner = CudaGraphRunner(toy.step, toy.make_inputs, [1, 2, 4])
    assert len(runner.warm_calls()) == 3
    assert prewarm([runner], workers=3) > 0
    assert not toy.state.any()  # the capture inputs run no row
    runner.capture()
    assert runner.captured_buckets == [1, 2, 4] and runner.warm_calls() == []
