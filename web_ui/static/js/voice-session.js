// One conversation: the socket, the microphone, the player and the rules of the chosen profile.
// No DOM here: the page listens to the events this object emits.
//
// Events: "status" {state, detail}, "level" {rms, peak}, "speaking" {user, assistant, waiting},
// "transcript" {itemId, role, text | delta, final, interrupted, playedMs}, "latency" {responseId, itemId, ms},
// "error" {code, message, param}, "notice" {message}, "unavailable" {profile, message}, "closed" {code}.

import { Microphone, microphoneErrorMessage } from "./audio-capture.js";
import { Player } from "./audio-playback.js";
import { bytesToBase64, RATE, samplesToMs } from "./pcm.js";
import { PROFILES } from "./profiles.js";
import { RealtimeClient, realtimeUrl } from "./realtime-client.js";

const MIN_COMMIT_MS = 100;

export class VoiceSession extends EventTarget {
  constructor({ profile, apiKey = "", model = "", echoCancellation = true, chunkMs = 100 }) {
    super();
    this.profile = PROFILES[profile];
    this.apiKey = apiKey;
    this.model = model;
    this.player = new Player();
    this.mic = new Microphone({ chunkMs, echoCancellation });
    this.client = null;
    this.state = "idle";
    this.stopped = false; // stop() was called: whatever start() is still waiting for is let go
    this.activeResponse = null; // id of the response between response.created and response.done
    this.pendingItems = new Map(); // assistant itemId -> {responseId} with audio still to play
    this.discarded = new Set(); // items and responses cut by an interruption: later audio is dropped
    this.awaitingReply = false; // manual / push-to-talk: a turn was sent, its reply not yet played
    this.turnEndAt = null; // performance.now() at the commit, or at the end of speech (VAD)
    this.latencyOpen = new Set(); // responses still waiting for their first audio
    this.appendedMs = 0; // audio sent since the last commit or clear
    this.sessionAudioMs = 0; // all audio sent: the server's "session audio time"
    this.sentAudio = []; // [sessionAudioMs at the end of a chunk, performance.now() when sent]
    this.spokenMs = 0; // length of the turn being committed, for the transcript
    this.speechStartMs = 0;
    this.talking = false; // push-to-talk button held
    this.cancelNext = false; // push-to-talk: pressed before the reply it interrupts was created
    this.userSpeaking = false;
    this.acksSupported = null; // null: unknown yet; false once the server refused playback.ack
    this.ackIds = new Set();
    this.log = { sent: [], acks: [], truncates: [], errors: [], latencies: [] }; // for tests
    this.imageSource = null; // () => Promise<dataURL|null>, set by the camera
  }

  emit(type, detail = {}) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  setState(state, detail = "") {
    this.state = state;
    this.emit("status", { state, detail });
  }

  // -- connecting ------------------------------------------------------------------------------
  async start() {
    this.setState("connecting");
    try {
      await this.player.start(); // first: an AudioContext wants the click's user activation
    } catch (error) {
      if (this.stopped) return this.abandon();
      // The playback worklet is fetched from the server: AbortError when the server is not answering.
      this.fail(
        error.name === "AbortError"
          ? "Could not connect: the server did not answer (is it running?)"
          : `Audio output could not start: ${error.message}`,
      );
      return false;
    }
    if (this.stopped) return this.abandon();
    this.wirePlayer();
    const profile = this.profile;
    this.client = new RealtimeClient({
      url: realtimeUrl({ model: this.model, duplex: profile.duplex, extra: profile.query }),
      apiKey: this.apiKey,
    });
    this.client.addEventListener("server-event", (e) => this.onServerEvent(e.detail));
    this.client.addEventListener("client-event", (e) => {
      const { type, event_id: eventId } = e.detail;
      this.log.sent.push(type === "input_audio_buffer.append" ? { type, event_id: eventId } : e.detail);
    });
    this.client.addEventListener("close", (e) => this.onClose(e.detail));
    try {
      await this.client.connect();
    } catch (error) {
      if (this.stopped) return this.abandon();
      const serverError = error.serverError; // already shown, as every server error is
      if (serverError && serverError.code === "unsupported") {
        this.emit("unavailable", { profile: profile.id, message: serverError.message });
      }
      if (serverError) this.fail(`refused by the server (close ${error.closeCode})`, false);
      else this.fail(`Could not connect: ${error.message}`);
      return false;
    }
    if (profile.turnDetection !== undefined) {
      this.send({
        type: "session.update",
        session: { type: "realtime", audio: { input: { turn_detection: profile.turnDetection } } },
      });
    }
    try {
      await this.mic.start();
    } catch (error) {
      if (this.stopped || !this.client.open) return this.abandon();
      this.emit("error", { code: "microphone", message: microphoneErrorMessage(error) });
      this.setState("connected", "no microphone");
      return true;
    }
    // Disconnected (or the socket closed) while the microphone was being allowed: let it go.
    if (this.stopped || !this.client.open) return this.abandon();
    this.mic.addEventListener("chunk", (e) => this.onChunk(e.detail));
    this.mic.addEventListener("level", (e) => this.onLevel(e.detail));
    this.setState("connected", `microphone at ${this.mic.deviceRate} Hz`);
    return true;
  }

  wirePlayer() {
    this.player.addEventListener("state", () => this.emitSpeaking());
    this.player.addEventListener("finished", (e) => this.onPlayed(e.detail, false));
    this.player.addEventListener("stopped", (e) => {
      for (const item of e.detail.items) this.onPlayed(item, true);
      for (const itemId of [...this.pendingItems.keys()]) {
        if (this.discarded.has(itemId)) this.pendingItems.delete(itemId); // nothing of it reached the player
      }
      this.settleReply();
    });
  }

  fail(message, show = true) {
    if (show) this.emit("error", { code: "connection", message });
    this.stop();
    this.setState("failed", message);
  }

  stop() {
    this.stopped = true;
    this.release();
    if (this.client) this.client.close();
  }

  /** start() was overtaken by stop() or a close: release what it opened, end in "closed". */
  abandon() {
    this.release();
    if (this.state !== "closed" && this.state !== "failed") this.setState("closed", "disconnected");
    return false;
  }

  /** Microphone and playback off, and nobody shown speaking any more. */
  release() {
    this.mic.stop();
    this.player.close();
    this.talking = false;
    this.userSpeaking = false;
    this.awaitingReply = false;
    this.emit("level", { rms: 0, peak: 0 });
    this.emitSpeaking();
  }

  onClose({ code, reason }) {
    // Closed by the server (restart, network) after it had accepted the session.
    const lost = !this.stopped && this.state !== "failed" && Boolean(this.client && this.client.session);
    this.release();
    if (lost) {
      this.emit("error", {
        code: "connection",
        message: `The connection to the server closed (code ${code}${reason ? `: ${reason}` : ""}); connect again to go on.`,
      });
    }
    if (this.state !== "failed") this.setState("closed", `code ${code}${reason ? `: ${reason}` : ""}`);
    this.emit("closed", { code });
  }

  send(event) {
    return this.client ? this.client.send(event) : null;
  }

  // -- microphone ------------------------------------------------------------------------------
  micOpen() {
    switch (this.profile.mic) {
      case "always":
        return true;
      case "held":
        return this.talking;
      default:
        return !this.awaitingReply && !this.player.playing;
    }
  }

  onChunk({ pcm }) {
    if (!this.client || !this.client.open || pcm.byteLength === 0 || !this.micOpen()) return;
    this.send({ type: "input_audio_buffer.append", audio: bytesToBase64(pcm) });
    const ms = (pcm.byteLength / 2 / RATE) * 1000;
    this.appendedMs += ms;
    this.sessionAudioMs += ms;
    this.sentAudio.push([this.sessionAudioMs, performance.now()]);
    if (this.sentAudio.length > 600) this.sentAudio.shift();
  }

  /** performance.now() when the audio at `audioMs` (session audio time) was sent, or now. */
  timeOfAudio(audioMs) {
    const entry = this.sentAudio.find(([endMs]) => endMs >= audioMs);
    return entry ? entry[1] - (entry[0] - audioMs) : performance.now();
  }

  onLevel(level) {
    this.emit("level", level);
    if (this.profile.mic === "held" || this.profile.turnDetection) return; // the button or the server says
    const speaking = this.micOpen() && level.rms > 0.02;
    if (speaking !== this.userSpeaking) {
      this.userSpeaking = speaking;
      this.emitSpeaking();
    }
  }

  /** Manual turns: send what was said and ask for a reply. */
  async sendTurn() {
    if (!this.client || !this.client.open || this.awaitingReply) return;
    await this.mic.flush();
    if (this.appendedMs < MIN_COMMIT_MS) {
      this.emit("notice", { message: "Nothing to send yet: speak first (at least 0.1 s of audio)." });
      return;
    }
    await this.commitTurn();
  }

  async commitTurn() {
    await this.sendCameraFrame();
    this.awaitingReply = true;
    this.turnEndAt = performance.now();
    this.spokenMs = this.appendedMs;
    this.appendedMs = 0;
    this.send({ type: "input_audio_buffer.commit" });
    this.send({ type: "response.create" });
    this.emitSpeaking();
  }

  /** Push-to-talk: the button went down. A reply in progress is cut where the user is. */
  async pressTalk() {
    if (!this.client || !this.client.open || this.talking) return;
    // A reply asked for but not yet created is cancelled as soon as it is.
    this.cancelNext = this.awaitingReply && !this.activeResponse;
    this.interruptReply(true);
    this.awaitingReply = false;
    this.send({ type: "input_audio_buffer.clear" });
    this.appendedMs = 0;
    this.talking = true;
    this.emitSpeaking();
  }

  async releaseTalk() {
    if (!this.talking) return;
    await this.mic.flush(); // the tail of what was said, sent while still talking
    this.talking = false;
    this.emitSpeaking();
    if (!this.client || !this.client.open) return;
    if (this.appendedMs < MIN_COMMIT_MS) {
      this.emit("notice", { message: "Too short: hold the Talk button while you speak." });
      this.send({ type: "input_audio_buffer.clear" });
      return;
    }
    await this.commitTurn();
  }

  /** Stops playback at once; with `cancel`, also cancels the response still generating. */
  interruptReply(cancel) {
    if (this.activeResponse) {
      this.discarded.add(this.activeResponse);
      if (cancel) this.send({ type: "response.cancel", response_id: this.activeResponse });
    }
    for (const itemId of this.pendingItems.keys()) this.discarded.add(itemId);
    if (this.player.playing || this.pendingItems.size) this.player.stop();
  }

  // -- playback accounting ---------------------------------------------------------------------
  onPlayed({ itemId, responseId, played }, interrupted) {
    if (!this.pendingItems.has(itemId)) return;
    this.pendingItems.delete(itemId);
    const playedMs = samplesToMs(played);
    if (interrupted) {
      this.discarded.add(itemId);
      const truncate = { type: "conversation.item.truncate", item_id: itemId, content_index: 0, audio_end_ms: playedMs };
      this.log.truncates.push({ ...truncate, played });
      this.send(truncate);
      this.emit("transcript", { itemId, role: "assistant", interrupted: true, playedMs });
    }
    this.sendAck(responseId, itemId, played);
    this.settleReply();
  }

  sendAck(responseId, itemId, played) {
    const ack = { type: "playback.ack", response_id: responseId, item_id: itemId, played_ms: samplesToMs(played) };
    this.log.acks.push({ ...ack, played });
    if (this.acksSupported === false) return;
    const id = this.send(ack);
    if (id) this.ackIds.add(id);
  }

  settleReply() {
    if (this.activeResponse || this.pendingItems.size) return;
    this.awaitingReply = false;
    this.emitSpeaking();
  }

  emitSpeaking() {
    this.emit("speaking", {
      user: this.userSpeaking || this.talking,
      assistant: this.player.playing,
      waiting: this.awaitingReply && !this.player.playing,
    });
  }

  // -- camera ----------------------------------------------------------------------------------
  async sendCameraFrame() {
    if (!this.imageSource) return;
    const url = await this.imageSource();
    if (!url) return;
    this.send({
      type: "conversation.item.create",
      item: { type: "message", role: "user", content: [{ type: "input_image", image_url: url }] },
    });
  }

  // -- server events ---------------------------------------------------------------------------
  onServerEvent(event) {
    const handler = HANDLERS[event.type];
    if (handler) handler.call(this, event);
  }
}

const HANDLERS = {
  error(event) {
    const error = event.error || {};
    this.log.errors.push(error);
    if (error.event_id && this.ackIds.has(error.event_id) && this.acksSupported !== true) {
      this.acksSupported = false;
      this.emit("notice", {
        message: `This server does not take playback.ack (${error.message}); interruptions are still reported with conversation.item.truncate.`,
      });
      return;
    }
    this.emit("error", { code: error.code, message: error.message, param: error.param });
  },
  "playback.acknowledged"() {
    this.acksSupported = true;
  },
  "input_audio_buffer.speech_started"(event) {
    this.userSpeaking = true;
    this.speechStartMs = event.audio_start_ms;
    this.interruptReply(false); // the server cancels the response itself (interrupt_response)
    this.sendCameraFrame();
    this.emitSpeaking();
  },
  "input_audio_buffer.speech_stopped"(event) {
    this.userSpeaking = false;
    this.spokenMs = event.audio_end_ms - this.speechStartMs;
    this.turnEndAt = this.timeOfAudio(event.audio_end_ms); // the end of speech, not the decision
    this.emitSpeaking();
  },
  "input_audio_buffer.committed"(event) {
    this.appendedMs = 0;
    const seconds = this.spokenMs ? `, ${(this.spokenMs / 1000).toFixed(1)} s` : "";
    this.emit("transcript", { itemId: event.item_id, role: "user", text: `(spoken audio${seconds})` });
    this.spokenMs = 0;
  },
  "conversation.item.done"(event) {
    const item = event.item || {};
    if (item.role !== "user") return;
    for (const part of item.content || []) {
      if (part.type === "input_audio") {
        this.emit("transcript", { itemId: item.id, role: "user", text: part.transcript || "", final: true });
      }
    }
  },
  "response.created"(event) {
    this.activeResponse = event.response.id;
    if (this.cancelNext) {
      this.cancelNext = false;
      this.interruptReply(true);
      return;
    }
    this.latencyOpen.add(event.response.id);
    if (this.profile.mic !== "held") this.awaitingReply = this.profile.mic === "between-replies";
    this.emitSpeaking();
  },
  "response.output_item.added"(event) {
    if (event.item && event.item.type === "message") {
      this.emit("transcript", { itemId: event.item.id, role: "assistant", text: "", final: false });
    }
  },
  "response.output_audio.delta"(event) {
    if (this.discarded.has(event.item_id) || this.discarded.has(event.response_id)) return;
    if (this.latencyOpen.delete(event.response_id) && this.turnEndAt !== null) {
      const ms = Math.round(performance.now() - this.turnEndAt);
      this.log.latencies.push(ms);
      this.emit("latency", { responseId: event.response_id, itemId: event.item_id, ms });
      this.turnEndAt = null;
    }
    this.pendingItems.set(event.item_id, { responseId: event.response_id });
    this.player.push(event.item_id, event.response_id, event.delta);
  },
  "response.output_audio.done"(event) {
    if (this.discarded.has(event.item_id) || this.discarded.has(event.response_id)) return;
    this.player.end(event.item_id, event.response_id);
  },
  "response.output_audio_transcript.delta"(event) {
    this.emit("transcript", { itemId: event.item_id, role: "assistant", delta: event.delta });
  },
  "response.output_text.delta"(event) {
    this.emit("transcript", { itemId: event.item_id, role: "assistant", delta: event.delta });
  },
  "response.output_audio_transcript.done"(event) {
    this.emit("transcript", { itemId: event.item_id, role: "assistant", final: true });
  },
  "response.output_text.done"(event) {
    this.emit("transcript", { itemId: event.item_id, role: "assistant", final: true });
  },
  "response.done"(event) {
    const response = event.response;
    this.latencyOpen.delete(response.id);
    if (this.activeResponse === response.id) this.activeResponse = null;
    if (response.status === "failed") {
      const error = (response.status_details && response.status_details.error) || {};
      this.emit("error", { code: error.code || "response_failed", message: error.message || "The response failed." });
    } else if (response.status === "incomplete") {
      this.emit("notice", { message: "The reply was cut short (max_output_tokens)." });
    }
    this.settleReply();
  },
};
