// The page: reads the form, runs one VoiceSession at a time and shows what it reports.
// `window.omnirt` exposes the current session (its played counters and logs) for tests.

import { Camera } from "./camera.js";
import { fetchModels, modelForProfile } from "./model-info.js";
import { samplesToMs } from "./pcm.js";
import { PROFILES } from "./profiles.js";
import { TranscriptView } from "./transcript-view.js";
import { VoiceSession } from "./voice-session.js";

const $ = (id) => document.getElementById(id);
const ui = {
  form: $("setup"),
  connect: $("connect"),
  disconnect: $("disconnect"),
  status: $("status"),
  apiKey: $("api-key"),
  echo: $("echo-cancellation"),
  camera: $("camera"),
  preview: $("camera-preview"),
  help: $("profile-help"),
  level: $("level"),
  user: $("user-speaking"),
  assistant: $("assistant-speaking"),
  sendTurn: $("send-turn"),
  talk: $("talk"),
  latency: $("latency"),
  messages: $("messages"),
  model: $("model"),
  randomWeights: $("random-weights"),
  realModelFlag: $("real-model-flag"),
  duplexUnavailable: $("duplex-unavailable"),
};
const transcript = new TranscriptView($("transcript"));
let session = null;
let camera = null;
let starting = false; // connect() runs (the camera may still be asking): a second Connect is ignored
let models = null; // GET /v1/models, once read
let modelError = "";

window.omnirt = {
  get session() {
    return session;
  },
  /** Samples and milliseconds rendered per assistant item, as the player counted them. */
  played() {
    if (!session) return {};
    const out = {};
    for (const [itemId, samples] of session.player.played) {
      out[itemId] = { samples, ms: samplesToMs(samples), received: session.player.received.get(itemId) || 0 };
    }
    return out;
  },
};

function selectedProfile() {
  return ui.form.elements.profile.value;
}

function showMessage(kind, text) {
  const li = document.createElement("li");
  li.className = kind;
  li.textContent = text;
  ui.messages.append(li);
  li.scrollIntoView({ block: "nearest" });
}

function setStatus({ state, detail }) {
  ui.status.dataset.state = state;
  ui.status.textContent = detail ? `${state} (${detail})` : state;
  const live = state === "connecting" || state === "connected";
  ui.connect.disabled = live;
  ui.disconnect.disabled = !live;
  for (const input of ui.form.querySelectorAll("input")) input.disabled = live || input.dataset.unavailable === "true";
  const profile = session ? session.profile.id : selectedProfile();
  ui.sendTurn.disabled = !(state === "connected" && profile === "manual");
  ui.talk.disabled = !(state === "connected" && profile === "ptt");
}

function showProfileControls() {
  const profile = PROFILES[selectedProfile()];
  ui.help.textContent = profile.help;
  ui.sendTurn.hidden = profile.id !== "manual";
  ui.talk.hidden = profile.id !== "ptt";
  showModel();
}

/** The model the selected profile talks to (the duplex model for Full duplex). */
function selectedModel() {
  return models ? modelForProfile(models, PROFILES[selectedProfile()].duplex) : null;
}

function showModel() {
  if (modelError) {
    ui.model.textContent = `Model: unknown (${modelError})`;
    return;
  }
  if (!models) return;
  const model = selectedModel();
  ui.model.textContent = model
    ? `Model: ${model.id} (${model.architecture}, from ${model.source})`
    : "Model: none for this profile on this server";
  ui.randomWeights.hidden = !(model && model.random_weights);
  ui.realModelFlag.textContent = model && model.kind === "duplex" ? "--duplex-model PATH" : "--model PATH";
}

async function loadModel() {
  try {
    models = await fetchModels(ui.apiKey.value.trim());
    modelError = "";
  } catch (error) {
    models = null;
    modelError = error.message;
  }
  showModel();
}

async function connect() {
  if (starting || (session && ["connecting", "connected"].includes(session.state))) return;
  starting = true;
  try {
    await startSession();
  } finally {
    starting = false;
  }
}

async function startSession() {
  const profile = selectedProfile();
  transcript.clear();
  ui.latency.textContent = "–";
  stopCamera(); // a camera left from an earlier session
  const current = new VoiceSession({
    profile,
    apiKey: ui.apiKey.value.trim(),
    model: (selectedModel() || {}).id || "",
    echoCancellation: ui.echo.checked,
  });
  session = current;
  // Only the current session drives the page (an older one may still report its socket's close).
  const on = (type, handler) =>
    current.addEventListener(type, (e) => {
      if (session === current) handler(e);
    });
  on("status", (e) => {
    if (e.detail.state === "closed" || e.detail.state === "failed") {
      // However the session ended (Disconnect, refused, the server gone): camera off, Talk up.
      stopCamera();
      ui.talk.setAttribute("aria-pressed", "false");
    }
    setStatus(e.detail);
  });
  on("level", (e) => {
    ui.level.value = Math.min(1, e.detail.peak);
    ui.level.textContent = e.detail.peak.toFixed(2);
  });
  on("speaking", (e) => {
    ui.user.dataset.active = String(e.detail.user);
    ui.assistant.dataset.active = e.detail.assistant ? "true" : e.detail.waiting ? "waiting" : "false";
  });
  on("transcript", (e) => transcript.update(e.detail));
  on("latency", (e) => {
    ui.latency.textContent = `${e.detail.ms} ms`;
    transcript.note(e.detail.itemId, "latency", `first audio after ${e.detail.ms} ms`);
  });
  on("error", (e) => {
    const { code, message, param } = e.detail;
    showMessage("error", `Error${code ? ` (${code})` : ""}: ${message}${param ? ` [${param}]` : ""}`);
  });
  on("notice", (e) => showMessage("notice", e.detail.message));
  on("unavailable", (e) => {
    // This server does not offer the profile: say so beside it, and fall back to manual turns.
    const radio = ui.form.querySelector(`input[name=profile][value=${e.detail.profile}]`);
    radio.dataset.unavailable = "true";
    radio.setAttribute("aria-describedby", "duplex-unavailable");
    ui.form.querySelector("input[name=profile][value=manual]").checked = true;
    ui.duplexUnavailable.hidden = false;
    ui.duplexUnavailable.textContent = `unavailable on this server: ${e.detail.message}`;
    showProfileControls();
  });
  if (ui.camera.checked && profile !== "duplex") {
    const opened = new Camera();
    try {
      await opened.start(ui.preview);
      camera = opened;
      ui.preview.hidden = false;
      current.imageSource = () => opened.frame();
    } catch (error) {
      opened.stop();
      showMessage("error", `The camera could not be opened: ${error.message}`);
    }
  }
  await current.start();
}

function stopCamera() {
  if (camera) camera.stop();
  camera = null;
  ui.preview.hidden = true;
}

function disconnect() {
  if (session) session.stop();
  stopCamera();
}

// Push-to-talk: the Talk button (pointer) or the space bar, held.
function pressTalk() {
  if (!session || ui.talk.disabled || session.talking) return;
  ui.talk.setAttribute("aria-pressed", "true");
  session.pressTalk();
}

function releaseTalk() {
  if (!session || !session.talking) return;
  ui.talk.setAttribute("aria-pressed", "false");
  session.releaseTalk();
}

ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  connect();
});
ui.form.addEventListener("change", (event) => {
  if (event.target.name === "profile") showProfileControls();
});
ui.apiKey.addEventListener("change", loadModel);
ui.disconnect.addEventListener("click", disconnect);
ui.sendTurn.addEventListener("click", () => session && session.sendTurn());
ui.talk.addEventListener("pointerdown", (event) => {
  ui.talk.setPointerCapture(event.pointerId);
  pressTalk();
});
ui.talk.addEventListener("pointerup", releaseTalk);
ui.talk.addEventListener("pointercancel", releaseTalk);
document.addEventListener("keydown", (event) => {
  if (event.code !== "Space" || event.repeat || event.target.matches("input[type=password], textarea")) return;
  if (session && session.profile.id === "ptt" && session.state === "connected") {
    event.preventDefault();
    pressTalk();
  }
});
document.addEventListener("keyup", (event) => {
  if (event.code !== "Space") return;
  if (session && session.talking) {
    event.preventDefault();
    releaseTalk();
  }
});
// The page loses the keyboard (another window, another tab) while the space bar is down: its keyup
// never comes here, so the turn ends now rather than sending audio until the next press.
window.addEventListener("blur", releaseTalk);
document.addEventListener("visibilitychange", () => {
  if (document.hidden) releaseTalk();
});

showProfileControls();
setStatus({ state: "idle", detail: "" });
ui.status.textContent = "not connected";
loadModel();
