// The four ways to hold a conversation, as the page offers them.
//   mic:   when microphone audio is sent: "between-replies" (paused while a reply plays),
//          "always", or "held" (only while the talk button is down)
//   query: extra query parameters of the WebSocket URL (server extensions, PROTOCOL.md)

export const SERVER_VAD = {
  type: "server_vad",
  threshold: 0.5,
  prefix_padding_ms: 300,
  silence_duration_ms: 500,
  create_response: true,
  interrupt_response: true,
};

export const PROFILES = {
  manual: {
    id: "manual",
    label: "Manual turns",
    help: "Speak, then press Send turn. The microphone pauses while the reply plays.",
    duplex: false,
    query: {},
    turnDetection: null,
    mic: "between-replies",
  },
  vad: {
    id: "vad",
    label: "Server VAD",
    help: "Just talk: the server hears when you stop. Speaking during a reply interrupts it.",
    duplex: false,
    query: {},
    turnDetection: SERVER_VAD,
    mic: "always",
  },
  ptt: {
    id: "ptt",
    label: "Push to talk",
    help: "Hold the Talk button (or the space bar) while you speak; release to send. Pressing during a reply stops it.",
    duplex: false,
    query: { turn: "push_to_talk" },
    turnDetection: null,
    mic: "held",
  },
  duplex: {
    id: "duplex",
    label: "Full duplex",
    help: "Audio flows both ways all the time; the model decides when to speak (needs a duplex model).",
    duplex: true,
    query: {},
    turnDetection: undefined, // the server owns turn-taking
    mic: "always",
  },
};
