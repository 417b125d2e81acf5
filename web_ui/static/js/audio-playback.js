// Reply audio out: a 24 kHz AudioContext with the playback worklet. Keeps, per item, how many
// samples were rendered (`played`) and how many were received, and re-emits the worklet's
// "started", "progress", "finished", "stopped" and "state" messages as events.

import { RATE, base64ToFloat32 } from "./pcm.js";

export class Player extends EventTarget {
  constructor({ prebufferMs = 80, fadeMs = 5 } = {}) {
    super();
    this.options = { prebufferMs, fadeMs };
    this.context = null;
    this.node = null;
    this.played = new Map(); // itemId -> samples rendered
    this.received = new Map(); // itemId -> samples received
    this.playing = false;
  }

  async start() {
    this.context = new AudioContext({ sampleRate: RATE, latencyHint: "interactive" });
    await this.context.audioWorklet.addModule(new URL("../worklets/playback-processor.js", import.meta.url));
    this.node = new AudioWorkletNode(this.context, "playback-processor", {
      numberOfInputs: 0,
      outputChannelCount: [1],
      processorOptions: this.options,
    });
    this.node.port.onmessage = (event) => this.onMessage(event.data);
    this.node.connect(this.context.destination);
    await this.context.resume();
  }

  onMessage(msg) {
    if (msg.type === "progress" || msg.type === "stopped") {
      for (const item of msg.items) this.played.set(item.itemId, item.played);
    } else if (msg.type === "finished") {
      this.played.set(msg.itemId, msg.played);
    } else if (msg.type === "state") {
      this.playing = msg.playing;
    }
    this.dispatchEvent(new CustomEvent(msg.type, { detail: msg }));
  }

  push(itemId, responseId, base64) {
    if (!this.node) return;
    const pcm = base64ToFloat32(base64);
    this.received.set(itemId, (this.received.get(itemId) || 0) + pcm.length);
    this.node.port.postMessage({ type: "push", itemId, responseId, pcm }, [pcm.buffer]);
  }

  end(itemId, responseId) {
    if (this.node) this.node.port.postMessage({ type: "end", itemId, responseId });
  }

  /** Stops at once (a 5 ms fade); the "stopped" event then says what each item played. */
  stop() {
    if (this.node) this.node.port.postMessage({ type: "stop" });
  }

  close() {
    if (this.context) this.context.close();
    this.context = null;
    this.node = null;
    this.playing = false;
  }
}
