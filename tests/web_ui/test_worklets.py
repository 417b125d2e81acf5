"""The two AudioWorklet processors, rendered offline in Chromium (faster than real time).

Capture: device rate -> 24 kHz keeps a 1 kHz tone's pitch and level and removes a tone above
the new Nyquist frequency. Playback: every sample pushed comes out (with short fades), and the
played counter equals the samples actually rendered, also when playback is stopped midway.
"""

from __future__ import annotations

import numpy as np
import pytest

from .browser import requires_browser

pytestmark = requires_browser

CAPTURE = """
async ([rate, freq, seconds]) => {
  const ctx = new OfflineAudioContext(1, Math.round(rate * seconds), rate);
  await ctx.audioWorklet.addModule("/worklets/capture-processor.js");
  const node = new AudioWorkletNode(ctx, "capture-processor", {
    processorOptions: {targetRate: 24000, chunkMs: 100},
  });
  const chunks = [];
  node.port.onmessage = (e) => {
    if (e.data.type === "chunk") chunks.push(Array.from(new Int16Array(e.data.pcm)));
  };
  const osc = new OscillatorNode(ctx, {frequency: freq});
  const gain = new GainNode(ctx, {gain: 0.5});
  osc.connect(gain).connect(node);
  node.connect(ctx.destination);
  osc.start();
  await ctx.startRendering();
  await new Promise((r) => setTimeout(r, 200));  // the last port messages
  return chunks;
}
"""

PLAYBACK_RIG = """
  const ctx = new OfflineAudioContext(1, 24000, 24000);
  await ctx.audioWorklet.addModule("/worklets/playback-processor.js");
  const node = new AudioWorkletNode(ctx, "playback-processor", {numberOfInputs: 0, outputChannelCount: [1]});
  const messages = [];
  node.port.onmessage = (e) => messages.push(e.data);
  node.connect(ctx.destination);
  const at = (seconds, post) => ctx.suspend(seconds).then(() => {
    post();
    setTimeout(() => ctx.resume(), 50);
  });
"""


def playback_script(params: str, body: str) -> str:
    """A page function that renders ``playback-processor`` offline for one second at 24 kHz.

    ``body`` schedules port messages with ``at(seconds, post)``: port messages reach the audio
    thread asynchronously, so they are posted while rendering is suspended. The function
    returns the rendered samples and the messages the processor posted back."""
    return (
        f"async ({params}) => {{"
        + PLAYBACK_RIG
        + body
        + """  const rendered = await ctx.startRendering();
  await new Promise((r) => setTimeout(r, 200));
  return {out: Array.from(rendered.getChannelData(0)), messages};
}
"""
    )


PLAYBACK = playback_script(
    "[stopAt]",
    """  at(128 / 24000, () => {
    for (let i = 0; i < 4; i++) {
      const pcm = new Float32Array(2400).fill(0.5);
      node.port.postMessage({type: "push", itemId: "item_a", responseId: "resp_a", pcm});
    }
    if (stopAt === null) node.port.postMessage({type: "end", itemId: "item_a"});
  });
  if (stopAt !== null) at(stopAt, () => node.port.postMessage({type: "stop"}));
""",
)


@pytest.fixture
def origin_page(page, web):
    page.goto(web.base_url + "/")
    return page


@pytest.mark.parametrize("device_rate", [44100, 48000])
def test_capture_resamples_to_24k_pcm16(origin_page, device_rate):
    chunks = origin_page.evaluate(CAPTURE, [device_rate, 1000, 1.0])
    assert all(len(c) == 2400 for c in chunks)  # 100 ms chunks of 24 kHz
    pcm = np.concatenate(chunks).astype(float) / 32768
    assert abs(len(pcm) - 24000) <= 2400  # one second of input -> 24000 samples (last chunk pending)
    steady = pcm[200:]
    spectrum = np.abs(np.fft.rfft(steady * np.hanning(len(steady))))
    peak_hz = np.argmax(spectrum) * 24000 / len(steady)
    assert abs(peak_hz - 1000) < 5, peak_hz
    rms = np.sqrt(np.mean(steady**2))
    assert abs(rms - 0.5 / np.sqrt(2)) < 0.02, rms  # the level is kept

    # 20 kHz does not fit in 24 kHz: it must be filtered out, not aliased to 4 kHz.
    high = np.concatenate(origin_page.evaluate(CAPTURE, [device_rate, 20000, 0.5])).astype(float) / 32768
    assert np.sqrt(np.mean(high[200:] ** 2)) < 0.01


def test_playback_plays_every_sample_and_counts_it(origin_page):
    result = origin_page.evaluate(PLAYBACK, [None])
    out = np.array(result["out"])
    finished = [m for m in result["messages"] if m["type"] == "finished"]
    assert finished == [{"type": "finished", "itemId": "item_a", "responseId": "resp_a", "played": 9600}]
    assert np.count_nonzero(out) == 9600
    start = int(np.flatnonzero(out)[0])
    assert out[start] < 0.2  # a short fade-in,
    assert np.allclose(out[start + 200 : start + 9600], 0.5)  # then the audio as it came
    assert np.all(out[start + 9600 :] == 0)


def test_playback_stop_counts_exactly_what_was_rendered(origin_page):
    result = origin_page.evaluate(PLAYBACK, [0.2])
    out = np.array(result["out"])
    stopped = [m for m in result["messages"] if m["type"] == "stopped"]
    assert len(stopped) == 1
    (item,) = stopped[0]["items"]
    played = item["played"]
    assert 4000 <= played < 9600  # stopped about 200 ms in, before the end
    assert np.count_nonzero(out) == played  # the counter is what came out, fade-out included
    end = int(np.flatnonzero(out)[-1])
    assert out[end] < 0.1  # it faded out instead of clicking
    assert not [m for m in result["messages"] if m["type"] == "finished"]


# 40 ms queued (under the 80 ms prebuffer, item not ended): silence. At 0.2 s 100 ms more
# arrive: playback starts. At 0.5 s the item ends after an underrun: the rest plays.
JITTER = playback_script(
    "",
    """  const push = (n) => node.port.postMessage({
    type: "push", itemId: "item_j", responseId: "resp_j", pcm: new Float32Array(n).fill(0.5),
  });
  at(128 / 24000, () => push(960));
  at(0.2, () => push(2400));
  at(0.5, () => node.port.postMessage({type: "end", itemId: "item_j"}));
""",
)


def test_playback_waits_for_its_jitter_buffer(origin_page):
    result = origin_page.evaluate(JITTER)
    out = np.array(result["out"])
    nonzero = np.flatnonzero(out)
    assert nonzero[0] >= int(0.2 * 24000), "played before 80 ms were buffered"
    assert np.count_nonzero(out) == 3360  # all of it, once the buffer was full
    assert out[nonzero[-1]] < 0.1  # faded out at the underrun (the item had not ended)
    finished = [m for m in result["messages"] if m["type"] == "finished"]
    assert [m["played"] for m in finished] == [3360]  # the end came after the last sample played
