// The WebSocket to /v1/realtime on this page's origin: subprotocols, client event ids, and one
// DOM event per server event (listen for "server-event", or for the event's own type).

let counter = 0;

export function clientEventId() {
  counter += 1;
  const random = Math.random().toString(36).slice(2, 10);
  return `event_ui${counter}${random}`;
}

export function realtimeUrl({ model, duplex, extra = {} }) {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const query = new URLSearchParams();
  if (model) query.set("model", model);
  query.set("duplex", duplex ? "1" : "0");
  for (const [key, value] of Object.entries(extra)) query.set(key, value);
  return `${scheme}//${location.host}/v1/realtime?${query}`;
}

export class RealtimeClient extends EventTarget {
  constructor({ url, apiKey }) {
    super();
    this.url = url;
    this.apiKey = apiKey;
    this.ws = null;
    this.session = null;
    this.closeInfo = null;
  }

  /** Opens the socket; resolves with the session of `session.created`, rejects with the
   * first server error (or close) when the server refuses the connection. */
  connect() {
    const protocols = ["realtime"];
    if (this.apiKey) protocols.push(`openai-insecure-api-key.${this.apiKey}`);
    this.ws = new WebSocket(this.url, protocols);
    return new Promise((resolve, reject) => {
      let firstError = null;
      this.ws.onmessage = (message) => {
        let event;
        try {
          event = JSON.parse(message.data);
        } catch {
          return;
        }
        if (event.type === "session.created") {
          this.session = event.session;
          resolve(event.session);
        } else if (event.type === "error" && !this.session && !firstError) {
          firstError = event.error;
        }
        this.dispatchEvent(new CustomEvent("server-event", { detail: event }));
        this.dispatchEvent(new CustomEvent(event.type, { detail: event }));
      };
      this.ws.onclose = (close) => {
        this.closeInfo = { code: close.code, reason: close.reason };
        if (!this.session) {
          const error = new Error(firstError ? firstError.message : `connection closed (code ${close.code})`);
          error.serverError = firstError;
          error.closeCode = close.code;
          reject(error);
        }
        this.dispatchEvent(new CustomEvent("close", { detail: this.closeInfo }));
      };
      this.ws.onerror = () => {}; // a close follows and says the rest
    });
  }

  get open() {
    return this.ws !== null && this.ws.readyState === WebSocket.OPEN;
  }

  /** Sends a client event (an event_id is added); returns the id, or null when not open. */
  send(event) {
    if (!this.open) return null;
    const eventId = event.event_id || clientEventId();
    this.ws.send(JSON.stringify({ event_id: eventId, ...event }));
    this.dispatchEvent(new CustomEvent("client-event", { detail: { event_id: eventId, ...event } }));
    return eventId;
  }

  close() {
    if (this.ws && this.ws.readyState <= WebSocket.OPEN) this.ws.close(1000);
  }
}
