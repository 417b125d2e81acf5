// The microphone: getUserMedia at the device rate -> capture worklet -> 24 kHz PCM16 chunks.
// Emits "chunk" ({pcm: ArrayBuffer, flush}) and "level" ({rms, peak}) events.

import { RATE } from "./pcm.js";

/** A sentence a person can act on, for a getUserMedia failure. */
export function microphoneErrorMessage(error) {
  if (error && (error.name === "NotAllowedError" || error.name === "SecurityError")) {
    return "Microphone access was denied. Allow the microphone for this site (the icon in the address bar) and connect again.";
  }
  if (error && (error.name === "NotFoundError" || error.name === "OverconstrainedError")) {
    return "No microphone was found. Plug one in and connect again.";
  }
  if (error && error.name === "NotReadableError") {
    return "The microphone is in use by another application.";
  }
  if (!navigator.mediaDevices) {
    return "This page needs a secure origin (https, or http://localhost) to use the microphone.";
  }
  return `The microphone could not be opened: ${error && error.message ? error.message : error}`;
}

export class Microphone extends EventTarget {
  constructor({ chunkMs = 100, echoCancellation = true } = {}) {
    super();
    this.chunkMs = chunkMs;
    this.echoCancellation = echoCancellation;
    this.context = null;
    this.stream = null;
    this.node = null;
    this.pendingFlush = null;
  }

  async start() {
    if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
      throw Object.assign(new Error("getUserMedia is not available"), { name: "SecurityError" });
    }
    this.stream = await navigator.mediaDevices.getUserMedia({
      audio: {
        channelCount: 1,
        echoCancellation: this.echoCancellation,
        noiseSuppression: true,
        autoGainControl: true,
      },
    });
    this.context = new AudioContext({ latencyHint: "interactive" }); // the device's rate
    await this.context.audioWorklet.addModule(new URL("../worklets/capture-processor.js", import.meta.url));
    const source = this.context.createMediaStreamSource(this.stream);
    this.node = new AudioWorkletNode(this.context, "capture-processor", {
      processorOptions: { targetRate: RATE, chunkMs: this.chunkMs },
    });
    this.node.port.onmessage = (event) => {
      const msg = event.data;
      if (msg.type === "level") {
        this.dispatchEvent(new CustomEvent("level", { detail: msg }));
      } else if (msg.type === "chunk") {
        this.dispatchEvent(new CustomEvent("chunk", { detail: msg }));
        if (msg.flush && this.pendingFlush) {
          this.pendingFlush();
          this.pendingFlush = null;
        }
      }
    };
    source.connect(this.node);
    this.node.connect(this.context.destination); // the node writes silence; this keeps it pulled
    await this.context.resume();
    return this.context.sampleRate;
  }

  get deviceRate() {
    return this.context ? this.context.sampleRate : null;
  }

  /** Emits what the worklet holds now as a (short) chunk; resolves once it has been emitted. */
  flush() {
    if (!this.node) return Promise.resolve();
    return new Promise((resolve) => {
      this.pendingFlush = resolve;
      this.node.port.postMessage({ type: "flush" });
    });
  }

  stop() {
    // Nothing the worklet posted before it stopped is heard after: a late "level" would show the
    // user speaking (and the meter up) once the session has let go of the microphone.
    if (this.node) {
      this.node.port.onmessage = null;
      this.node.port.close();
    }
    if (this.pendingFlush) {
      this.pendingFlush();
      this.pendingFlush = null;
    }
    if (this.stream) this.stream.getTracks().forEach((track) => track.stop());
    if (this.context) this.context.close();
    this.stream = null;
    this.context = null;
    this.node = null;
  }
}
