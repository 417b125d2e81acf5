// Microphone capture on the audio thread: device rate -> 24 kHz PCM16 chunks, plus a level.
//
// The input runs through a windowed-sinc low-pass (when downsampling) and is then resampled by
// linear interpolation, one stream with state kept across render quanta. Every `chunkMs` of
// output the processor posts {type: "chunk", pcm: ArrayBuffer} (PCM16 little-endian mono);
// {type: "flush"} from the main thread posts what is pending at once, marked flush: true.
// About every 50 ms it posts {type: "level", rms, peak} of the raw input.

const TAPS = 63;

function lowpass(cutoff) {
  // cutoff in cycles per input sample (0 < cutoff < 0.5); Blackman-windowed sinc, unit DC gain.
  const h = new Float32Array(TAPS);
  const mid = (TAPS - 1) / 2;
  let sum = 0;
  for (let i = 0; i < TAPS; i++) {
    const n = i - mid;
    const sinc = n === 0 ? 2 * cutoff : Math.sin(2 * Math.PI * cutoff * n) / (Math.PI * n);
    const w = 0.42 - 0.5 * Math.cos((2 * Math.PI * i) / (TAPS - 1)) + 0.08 * Math.cos((4 * Math.PI * i) / (TAPS - 1));
    h[i] = sinc * w;
    sum += h[i];
  }
  for (let i = 0; i < TAPS; i++) h[i] /= sum;
  return h;
}

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetRate = 24000, chunkMs = 100 } = options.processorOptions || {};
    this.step = sampleRate / targetRate; // input samples per output sample
    this.fir = this.step > 1 ? lowpass((0.5 / this.step) * 0.9) : null;
    this.history = new Float32Array(TAPS);
    this.head = 0;
    this.prev = 0;
    this.t = 1; // position of the next output sample, in input samples after `prev`
    this.chunk = new Int16Array(Math.round((targetRate * chunkMs) / 1000));
    this.filled = 0;
    this.levelEvery = Math.round(sampleRate * 0.05);
    this.levelCount = 0;
    this.sumSquares = 0;
    this.peak = 0;
    this.port.onmessage = (event) => {
      if (event.data.type === "flush") this.post(true);
    };
  }

  post(flush) {
    const pcm = this.chunk.slice(0, this.filled).buffer;
    this.port.postMessage({ type: "chunk", pcm, flush }, [pcm]);
    this.filled = 0;
  }

  filter(x) {
    if (!this.fir) return x;
    const h = this.history;
    h[this.head] = x;
    let y = 0;
    let j = this.head;
    for (let i = 0; i < TAPS; i++) {
      y += this.fir[i] * h[j];
      j = j === 0 ? TAPS - 1 : j - 1;
    }
    this.head = (this.head + 1) % TAPS;
    return y;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (!channel) return true;
    for (let i = 0; i < channel.length; i++) {
      const raw = channel[i];
      this.sumSquares += raw * raw;
      this.peak = Math.max(this.peak, Math.abs(raw));
      const x = this.filter(raw);
      while (this.t <= 1) {
        const y = this.prev + (x - this.prev) * this.t;
        const s = Math.max(-1, Math.min(1, y));
        this.chunk[this.filled++] = s < 0 ? s * 0x8000 : s * 0x7fff;
        if (this.filled === this.chunk.length) this.post(false);
        this.t += this.step;
      }
      this.t -= 1;
      this.prev = x;
    }
    this.levelCount += channel.length;
    if (this.levelCount >= this.levelEvery) {
      this.port.postMessage({ type: "level", rms: Math.sqrt(this.sumSquares / this.levelCount), peak: this.peak });
      this.levelCount = 0;
      this.sumSquares = 0;
      this.peak = 0;
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
