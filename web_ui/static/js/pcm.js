// PCM16 little-endian <-> base64 and Float32, for the wire format of /v1/realtime (24 kHz mono).

export const RATE = 24000;

export function bytesToBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

/** Float32 samples in [-1, 1] from a base64 PCM16 payload (a trailing odd byte is ignored). */
export function base64ToFloat32(b64) {
  const binary = atob(b64);
  const view = new DataView(new ArrayBuffer(binary.length));
  for (let i = 0; i < binary.length; i++) view.setUint8(i, binary.charCodeAt(i));
  const out = new Float32Array(binary.length >> 1);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 0x8000;
  return out;
}

/** Milliseconds of 24 kHz audio in `samples`, rounded down (never more than was heard). */
export function samplesToMs(samples) {
  return Math.floor((samples * 1000) / RATE);
}
