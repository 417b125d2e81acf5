// Reply playback on the audio thread: a small jitter buffer, short fades, and an exact count of
// the samples of each item that were actually rendered.
//
// The context runs at the stream's rate (24 kHz), so a sample in is a sample out.
// In:  {type: "push", itemId, responseId, pcm: Float32Array}   audio of an item, in order
//      {type: "end", itemId}                                    no more audio for that item
//      {type: "stop"}                                           fade out now and drop everything
// Out: {type: "started", itemId, responseId}                    first sample of an item rendered
//      {type: "progress", items: [{itemId, responseId, played}]} about every 100 ms while playing
//      {type: "finished", itemId, responseId, played}           an ended item played to its end
//      {type: "stopped", current, items: [...]}                 after a stop: what each item played
//      {type: "state", playing}                                 output started / went quiet
// Playback starts once `prebufferMs` is queued (or the queued item has ended); when the buffer
// runs low before an item's end it fades out, and it fades in again when audio resumes.

class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { prebufferMs = 80, fadeMs = 5 } = options.processorOptions || {};
    this.prebuffer = Math.round((sampleRate * prebufferMs) / 1000);
    this.fade = Math.max(1, Math.round((sampleRate * fadeMs) / 1000));
    this.queue = []; // {itemId, samples, offset}
    this.items = new Map(); // itemId -> {responseId, played, queued, ended, started}
    this.stopped = new Set(); // items cut by a stop: later audio of theirs is dropped
    this.buffered = 0;
    this.playing = false;
    this.sinceStart = 0;
    this.stopLeft = -1; // >= 0 while a stop fades out
    this.current = null;
    this.reportEvery = Math.round(sampleRate * 0.1);
    this.sinceReport = 0;
    this.port.onmessage = (event) => this.onMessage(event.data);
  }

  item(itemId, responseId) {
    let item = this.items.get(itemId);
    if (!item) {
      item = { itemId, responseId, played: 0, queued: 0, ended: false, started: false };
      this.items.set(itemId, item);
    }
    return item;
  }

  onMessage(msg) {
    if (msg.type === "push") {
      if (this.stopped.has(msg.itemId)) return;
      const item = this.item(msg.itemId, msg.responseId);
      if (item.ended || msg.pcm.length === 0) return;
      this.queue.push({ itemId: msg.itemId, samples: msg.pcm, offset: 0 });
      item.queued += msg.pcm.length;
      this.buffered += msg.pcm.length;
    } else if (msg.type === "end") {
      if (this.stopped.has(msg.itemId)) return;
      const item = this.item(msg.itemId, msg.responseId);
      item.ended = true;
      if (item.played === item.queued) this.finish(item);
    } else if (msg.type === "stop") {
      if (this.playing && this.queue.length) this.stopLeft = this.fade;
      else this.dropAll();
    }
  }

  finish(item) {
    this.port.postMessage({ type: "finished", itemId: item.itemId, responseId: item.responseId, played: item.played });
    this.items.delete(item.itemId);
  }

  report(type, extra = {}) {
    const items = [];
    for (const item of this.items.values()) {
      if (item.played > 0 || type === "stopped") items.push({ itemId: item.itemId, responseId: item.responseId, played: item.played });
    }
    this.port.postMessage({ type, items, ...extra });
  }

  dropAll() {
    this.report("stopped", { current: this.current });
    for (const id of this.items.keys()) this.stopped.add(id);
    this.items.clear();
    this.queue = [];
    this.buffered = 0;
    this.stopLeft = -1;
    this.current = null;
    this.setPlaying(false);
  }

  setPlaying(playing) {
    if (playing === this.playing) return;
    this.playing = playing;
    this.sinceStart = 0;
    this.port.postMessage({ type: "state", playing });
  }

  canStart() {
    if (!this.queue.length) return false;
    if (this.buffered >= this.prebuffer) return true;
    const last = this.items.get(this.queue[this.queue.length - 1].itemId);
    return Boolean(last && last.ended);
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    for (let i = 0; i < out.length; i++) {
      if (!this.playing) {
        if (!this.canStart()) {
          out[i] = 0;
          continue;
        }
        this.setPlaying(true);
      }
      const seg = this.queue[0];
      if (this.stopLeft === 0 || (!seg && this.stopLeft > 0)) {
        out[i] = 0;
        this.dropAll();
        continue;
      }
      if (!seg) {
        out[i] = 0;
        this.setPlaying(false); // underrun: wait for the buffer to fill again
        continue;
      }
      const item = this.items.get(seg.itemId);
      let gain = Math.min(1, (this.sinceStart + 1) / this.fade);
      if (this.stopLeft > 0) {
        gain *= this.stopLeft / (this.fade + 1);
        this.stopLeft -= 1;
      } else if (!item.ended) {
        gain *= Math.min(1, this.buffered / this.fade);
      }
      out[i] = seg.samples[seg.offset++] * gain;
      this.sinceStart += 1;
      this.buffered -= 1;
      item.played += 1;
      this.current = item.itemId;
      if (!item.started) {
        item.started = true;
        this.port.postMessage({ type: "started", itemId: item.itemId, responseId: item.responseId });
      }
      if (seg.offset === seg.samples.length) {
        this.queue.shift();
        if (item.ended && item.played === item.queued && this.stopLeft < 0) this.finish(item);
      }
    }
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    if (this.playing) {
      this.sinceReport += out.length;
      if (this.sinceReport >= this.reportEvery) {
        this.sinceReport = 0;
        this.report("progress");
      }
    }
    return true;
  }
}

registerProcessor("playback-processor", PlaybackProcessor);
