// Optional camera: a preview, and JPEG frames (data URLs) at most one per `intervalMs`.

export class Camera {
  constructor({ intervalMs = 3000, width = 320, quality = 0.7 } = {}) {
    this.intervalMs = intervalMs;
    this.width = width;
    this.quality = quality;
    this.stream = null;
    this.video = null;
    this.lastFrameAt = -Infinity;
    this.framesSent = 0;
  }

  async start(video) {
    this.stream = await navigator.mediaDevices.getUserMedia({ video: { width: { ideal: this.width } } });
    this.video = video;
    video.srcObject = this.stream;
    await video.play();
  }

  /** A frame as a data URL, or null when the last one was less than `intervalMs` ago. */
  async frame() {
    const video = this.video;
    if (!video || !video.videoWidth || performance.now() - this.lastFrameAt < this.intervalMs) return null;
    const canvas = document.createElement("canvas");
    canvas.width = this.width;
    canvas.height = Math.round((video.videoHeight / video.videoWidth) * this.width);
    canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
    this.lastFrameAt = performance.now();
    this.framesSent += 1;
    return canvas.toDataURL("image/jpeg", this.quality);
  }

  stop() {
    if (this.stream) this.stream.getTracks().forEach((track) => track.stop());
    if (this.video) this.video.srcObject = null;
    this.stream = null;
    this.video = null;
  }
}
